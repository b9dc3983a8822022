"""A performance model of the flash engine next to SDPA-flash on an H100, counted from the launcher.

    python -m benchmarks flash-model [--out DIR]      # writes flash_model.md

The flash engine's own launcher (:mod:`sinkformer.sinkhorn.flash`) runs its forward and backward on
``meta`` tensors with every kernel replaced by a recorder, so the counts below are those of the
launches the code makes, not typed: each ``sweep`` or ``dscore`` launch is one pass over the
``n × m`` scores (one exponential per score: the backward's correction terms are folded into the
``dP`` product), and its matrix products are read off its mode (``QKᵀ`` always; ``PV``/``P dO`` for
output and dV sweeps; ``dO Vᵀ``, the correction product and ``dS K`` for ``dscore``). SDPA-flash is
FlashAttention-2 as published: a forward pass (``QKᵀ``, ``PV``, one exponential per score) and one
backward pass (``QKᵀ``, ``dO Vᵀ``, ``Pᵀ dO``, ``dS K``, ``dSᵀ Q``, one exponential).

Also modelled, not built: ``dq`` computed in the ``dk`` pass (FlashAttention-2's way), from the same
launches with the ``dq`` pass removed and the ``dk`` pass doing one more product, ``dS K``, whose
rows it adds into a float32 ``dq`` with atomic adds: 4 bytes per query row, head dim and key block
of that pass. The floors do not price those adds, so the model gives the rate at which the GPU would
have to absorb them for the fused pass to pay (its floor saving over the bytes), and that rate over
the H100's memory bandwidth.

Floors on an H100 (SXM, 132 multiprocessors): tensor-core products at 800 TFLOP/s (a bf16 8192³
product measured on this workplace's H100s), exponentials on the special-function units at
3.9 T/s (16 per multiprocessor and clock at 1.83 GHz), the larger of the two per configuration
(they overlap at best). Every figure here is a model; the measured column reads the committed GPU
check (``benchmarks/results/attention_cuda.json``) and says "unmeasured" where it has no row.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
#: rates of one H100 SXM: the tensor-core rate measured on this workplace's H100 (bf16, 8192^3,
#: 798 TFLOP/s), the special-function rate from its datasheet figures (132 SMs x 16 x 1.83 GHz)
TENSOR_FLOPS = 800e12
EXP_PER_S = 132 * 16 * 1.83e9
#: an H100 SXM's memory bandwidth (datasheet: 3.35 TB/s), the scale the atomic adds' rate is read against
HBM_BYTES_PER_S = 3.35e12
SHAPE = dict(B=32, n=4096, d=64)
ITERS = (3, 5, 21)


class _Recorder:
    """Stands in for a kernel: records each launch (kernel, mode, grid, sizes) and runs nothing."""

    def __init__(self, fn, name: str, launches: list):
        self.fn, self.name, self.launches = fn, name, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            names = self.fn.arg_names
            bound = dict(zip(names, args))
            self.launches.append(dict(kernel=self.name, grid=tuple(grid), n_r=bound.get("n_r", bound.get("n")),
                                      n_c=bound.get("n_c", 0), **{k: v for k, v in kwargs.items() if k.isupper()}))
        return launch


def launches(n_iters: int, B: int, n: int, d: int) -> list[dict]:
    """The launches of one forward+backward of flash (bf16, no mask, ``n_iters`` fixed)."""
    import torch

    from benchmarks.flash_compile import stand_in_kernels
    from sinkformer.sinkhorn import flash
    from sinkformer.sinkhorn.problem import Problem

    record: list = []
    meta = dict(device="meta", dtype=torch.bfloat16)
    q, k, v = (torch.empty(B, n, d, **meta) for _ in range(3))
    with stand_in_kernels(flash, lambda fn, name: _Recorder(fn, name, record)):
        p = flash._Operands(Problem(q, k, v, None, None, [B], d ** -0.5, n_iters), interpreted=False)
        out, fs, gs, counts, *_ = flash._forward(p, v, n_iters, None, 1000, "unrolled")
        forward = len(record)
        flash._backward(p, torch.empty_like(out), v, out, fs, gs, counts, "unrolled", fixed=True)
    for i, launch in enumerate(record):
        launch["phase"] = "forward" if i < forward else "backward"
    return record


def cost_of(launch: dict, B: int) -> dict:
    """Scores visited, exponentials, tensor-core FLOPs and float32 atomic bytes of one launch (0 for
    the vector kernels, rowdot and fold, and for the term-by-term dscore variant, which returns at
    once on slices that fold). ``FUSED_DQ`` marks a dk pass modelled with dq in it."""
    kernel = launch["kernel"]
    if kernel in ("rowdot", "fold") or (kernel == "dscore" and not launch["FOLDED"]):
        return dict(passes=0, exps=0, flops=0, atomic_bytes=0)
    scores = B * launch["n_r"] * launch["n_c"]
    d, e = launch["D"], launch["E"]
    atomic_bytes = 0
    if kernel == "sweep":
        products = 2 * d + (2 * e if launch["MODE"] in (1, 2, 4) else 0)  # QK^T, and PV (LSE_OUT, FIXED_OUT, DV)
    else:  # dscore: QK^T, dO V^T, the folded correction (inner size BLOCK_T), dS C
        products = 2 * d + 2 * e + 2 * launch["BLOCK_T"] + 2 * d
        if launch.get("FUSED_DQ"):  # and dS^T of the other side, added into dq by each block of rows
            products += 2 * d
            atomic_bytes = 4 * B * launch["n_c"] * d * -(-launch["n_r"] // launch["BLOCK_R"])
    return dict(passes=1, exps=scores, flops=scores * products, atomic_bytes=atomic_bytes)


def fuse_dq(recorded: list[dict]) -> list[dict]:
    """The launches with dq computed in the dk pass: the folded query-orientation dscore launch (dq,
    launched first) removed, the folded key-orientation one (dk) marked ``FUSED_DQ``."""
    folded = [i for i, x in enumerate(recorded) if x["kernel"] == "dscore" and x["FOLDED"]]
    assert len(folded) == 2, "one folded dscore launch each for dq and dk"
    dq, dk = folded
    return [dict(x, FUSED_DQ=True) if i == dk else x for i, x in enumerate(recorded) if i != dq]


def flash_model(n_iters: int, B: int, n: int, d: int, fused_dq: bool = False) -> dict:
    recorded = launches(n_iters, B, n, d)
    if fused_dq:
        recorded = fuse_dq(recorded)
    row = dict(engine="flash, dq in the dk pass" if fused_dq else "flash", n_iters=n_iters, launches=len(recorded),
               atomic_bytes=0)
    for phase in ("forward", "backward"):
        costs = [cost_of(x, B) for x in recorded if x["phase"] == phase]
        row[f"{phase}_passes"] = sum(c["passes"] for c in costs)
        row[f"{phase}_exps"] = sum(c["exps"] for c in costs)
        row[f"{phase}_flops"] = sum(c["flops"] for c in costs)
        row["atomic_bytes"] += sum(c["atomic_bytes"] for c in costs)
    return _floors(row, B * n * n)


def sdpa_model(B: int, n: int, d: int) -> dict:
    """FlashAttention-2 (the structure of the published algorithm, not counted from code here)."""
    scores = B * n * n
    row = dict(engine="sdpa-flash", n_iters=1, launches=None, forward_passes=1, backward_passes=1,
               forward_exps=scores, backward_exps=scores, forward_flops=scores * 4 * d, backward_flops=scores * 10 * d)
    return _floors(row, scores)


def _floors(row: dict, scores: int) -> dict:
    exps = row["forward_exps"] + row["backward_exps"]
    flops = row["forward_flops"] + row["backward_flops"]
    row.update(exps_per_score=exps / scores, tflop=flops / 1e12, exp_ms=1e3 * exps / EXP_PER_S,
               mma_ms=1e3 * flops / TENSOR_FLOPS)
    row["floor_ms"] = max(row["exp_ms"], row["mma_ms"])
    return row


def measured(data: dict) -> dict:
    """``{(method, n_iters): forward+backward ms}`` of a GPU check's rows (bf16, the model's shape)."""
    out = {}
    for r in data.get("rows", []):
        if (r.get("status") == "ok" and r["dtype"] == "bfloat16" and r["n"] == SHAPE["n"]
                and r["b"] * r["h"] == SHAPE["B"] and r["d"] == SHAPE["d"]):
            out[r["method"], 1 if r["method"] == "sdpa-flash" else r["n_iters"]] = r["forward_backward_ms"]
    return out


def model(results: Path = RESULTS) -> dict:
    B, n, d = SHAPE["B"], SHAPE["n"], SHAPE["d"]
    rows = [sdpa_model(B, n, d)] + [flash_model(t, B, n, d) for t in ITERS]
    fused = [flash_model(t, B, n, d, fused_dq=True) for t in ITERS]
    for row, plain in zip(fused, rows[1:]):
        saving_s = (plain["floor_ms"] - row["floor_ms"]) / 1e3
        row["break_even_tb_per_s"] = row["atomic_bytes"] / saving_s / 1e12 if saving_s > 0 else None
    check = results / "attention_cuda.json"
    data = json.loads(check.read_text()) if check.exists() else {}
    times = measured(data)
    sdpa_floor, sdpa_time = rows[0]["floor_ms"], times.get(("sdpa-flash", 1))
    for r in fused:
        r["floor_over_sdpa"] = r["floor_ms"] / sdpa_floor
    for r in rows:
        r["floor_over_sdpa"] = r["floor_ms"] / sdpa_floor
        r["measured_ms"] = times.get((r["engine"], r["n_iters"]))
        r["measured_over_sdpa"] = r["measured_ms"] / sdpa_time if r["measured_ms"] and sdpa_time else None
    from benchmarks.attention_cuda import targets

    env = data.get("environment", data.get("meta", {}))
    return dict(shape=SHAPE, tensor_flops=TENSOR_FLOPS, exp_per_s=EXP_PER_S, rows=rows, fused_dq=fused,
                targets=targets(data.get("rows", []), data.get("graph")), measured_on=env.get("gpu") if data else None,
                smoke=bool(data.get("smoke", False)))


def _what_the_targets_ask(data: dict) -> list[str]:
    """For each measured ratio target (flash <= limit x SDPA-flash): the measured/floor it asks of
    flash, ``limit x SDPA's measured time / flash's floor``, next to SDPA-flash's own measured/floor."""
    rows = {(r["engine"], r["n_iters"]): r for r in data["rows"]}
    sdpa = rows[("sdpa-flash", 1)]
    asked = [(t, rows[("flash", t["n_iters"])]) for t in data["targets"]
             if "limit" in t and ("flash", t["n_iters"]) in rows and sdpa["measured_ms"]]
    if not asked:
        return []
    return ["", "What the ratio targets ask: "
            + "; ".join(f"{t['limit']:g}× SDPA-flash at {t['n_iters']} iterations needs flash within "
                        f"{t['limit'] * sdpa['measured_ms'] / r['floor_ms']:.2f}× its floor" for t, r in asked)
            + f", where SDPA-flash ran at {sdpa['measured_ms'] / sdpa['floor_ms']:.2f}× its own: closer to the floor "
              "than FlashAttention-2 comes."]


def markdown(data: dict) -> str:
    s = data["shape"]
    lines = [f"Model (`python -m benchmarks flash-model`, counted from the launcher): bf16, b·h = {s['B']}, "
             f"n = {s['n']}, d = {s['d']}, forward+backward, no mask. Floors on an H100: tensor-core products at "
             f"{data['tensor_flops'] / 1e12:.0f} TFLOP/s, exponentials at {data['exp_per_s'] / 1e12:.1f} T/s; the floor "
             "is the larger. Measured: the committed GPU check, or *unmeasured*.", "",
             "| engine | n_iters | passes over the scores (fwd + bwd) | exponentials per score | tensor-core TFLOP | "
             "exp floor ms | product floor ms | floor ms | floor / SDPA's | measured ms | measured / SDPA | "
             "measured / floor |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in data["rows"]:
        meas = "unmeasured" if r["measured_ms"] is None else f"{r['measured_ms']:.3f}"
        ratio = "unmeasured" if r["measured_over_sdpa"] is None else f"{r['measured_over_sdpa']:.2f}"
        gap = "unmeasured" if r["measured_ms"] is None else f"{r['measured_ms'] / r['floor_ms']:.2f}"
        lines.append(f"| {r['engine']} | {r['n_iters']} | {r['forward_passes']} + {r['backward_passes']} | "
                     f"{r['exps_per_score']:.0f} | {r['tflop']:.2f} | {r['exp_ms']:.3f} | {r['mma_ms']:.3f} | "
                     f"{r['floor_ms']:.3f} | {r['floor_over_sdpa']:.2f} | {meas} | {ratio} | {gap} |")
    lines += ["", "Not built, modelled: dq computed in the dk pass (FlashAttention-2's way), its rows added into a "
              "float32 dq with atomic adds. The floors above do not price those adds: it pays only if the GPU "
              "absorbs them at the rate below (unmeasured), and it makes dq differ from run to run (the order "
              "of the adds).", "",
              "| n_iters | passes (fwd + bwd) | exponentials per score | floor ms | floor / SDPA's | "
              "floor saved ms | float32 atomic adds GB | pays if atomics run faster than TB/s | "
              "that rate / the H100's memory bandwidth |",
              "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r, plain in zip(data["fused_dq"], data["rows"][1:]):
        rate = "never" if r["break_even_tb_per_s"] is None else f"{r['break_even_tb_per_s']:.1f}"
        over = "" if r["break_even_tb_per_s"] is None else f"{r['break_even_tb_per_s'] * 1e12 / HBM_BYTES_PER_S:.1f}"
        lines.append(f"| {r['n_iters']} | {r['forward_passes']} + {r['backward_passes']} | {r['exps_per_score']:.0f} | "
                     f"{r['floor_ms']:.3f} | {r['floor_over_sdpa']:.2f} | {plain['floor_ms'] - r['floor_ms']:.3f} | "
                     f"{r['atomic_bytes'] / 1e9:.2f} | {rate} | {over} |")
    if data["measured_on"]:
        lines += ["", f"Measured on {data['measured_on']}{' (a smoke run: not a measurement)' if data['smoke'] else ''}"
                      f"; every figure of the check: [attention_cuda.md](../benchmarks/results/attention_cuda.md)."]
    lines += ["", "The GPU targets:", "", "| target | measured | met |", "|---|---:|---|"]
    for t in data["targets"]:
        value = "" if t["value"] is None else f"{t['value']:.2f}"
        value = "unmeasured" if t["met"] is None else value
        met = "unmeasured" if t["met"] is None else "yes" if t["met"] else "**no**"
        lines.append(f"| {t['target']} | {value} | {met} |")
    lines += _what_the_targets_ask(data)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks flash-model", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmark-results",
                        help="folder for flash_model.md (docs/speed.md includes benchmarks/results/flash_model.md)")
    args = parser.parse_args(argv)
    data = model()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "flash_model.md").write_text(markdown(data))
    print(markdown(data))
    print(f"wrote {out / 'flash_model.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
