"""What a short sequence costs beyond its arithmetic: the attention call against a bare floor.

At short sequences much of Sinkhorn attention's time is not arithmetic but a cost per call (validation,
the engine choice, the engine's Python and its few hundred PyTorch operations). To measure that
cost, this benchmark times, on one thread (CPU time of the calling thread, which a busy machine blurs
less than wall time):

* ``sdpa``: ``scaled_dot_product_attention``;
* ``ours``: ``sinkformer.attention`` (``backend="auto"``, 5 iterations);
* ``floor``: :class:`Floor`, the same arithmetic as the tiled engine's scaling domain on one tile
  (the scores, their double shift, the 5 normalisations as matrix-vector products, the output, and
  the exact backward of the 5-iteration map as one rank-5 correction), with no mask, no validation
  and no choice: a bare ``torch.autograd.Function`` of about 25 operations forward and 30 backward;
* ``prepare``: ``sinkformer.attention``'s validation and engine choice alone.

It prints per n the forward and forward+backward times and ``ours - floor``: the cost the library
adds to the arithmetic. The floor is an instrument of this benchmark, held equal to the
library by ``tests/test_overhead_benchmark.py``; it is not an engine.

    python -m benchmarks overhead --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

#: sequence lengths, (batch, heads) = (4, 8), d = 64
NS = (16, 64, 128)
N_ITERS = 5


class Floor(torch.autograd.Function):
    """Sinkhorn attention with ``N_ITERS`` normalisations, no mask: ``(B, n, d) x (B, n, d) x (B, n, e) -> (B, n, e)``.

    Scaling domain on the doubly shifted tile :math:`\\tilde K = e^{S - m_i - c_j}`: :math:`u \\leftarrow
    1 \\oslash \\tilde K\\tilde v`, :math:`\\tilde v \\leftarrow (n/m) \\oslash \\tilde K^\\top u` from
    :math:`\\tilde v = e^{c}`, output :math:`u \\odot \\tilde K(\\tilde v\\odot V)`; the backward runs the
    reverse recursion through the scalings and forms :math:`dS = \\tilde K \\odot ([u\\odot dO, X]
    [\\tilde v\\odot V, Y]^\\top)`."""

    @staticmethod
    def forward(q, k, v, scale):
        S = torch.baddbmm(q.new_empty(()), q, k.transpose(1, 2), beta=0.0, alpha=scale)
        S.sub_(S.amax(-1, keepdim=True))
        col_shift = S.amax(-2, keepdim=True)
        K = S.sub_(col_shift).exp_()
        b = q.shape[1] / k.shape[1]
        vt, us, vs = col_shift.exp(), [], []  # (B, 1, m)
        vs.append(vt)
        for t in range(N_ITERS):
            if t % 2 == 0:
                us.append(torch.bmm(vt, K.transpose(1, 2)).reciprocal_())  # (B, 1, n)
            else:
                vt = torch.bmm(us[-1], K).reciprocal_().mul_(b)
                vs.append(vt)
        out = torch.bmm(K, v * vt.transpose(1, 2)).mul_(us[-1].transpose(1, 2))
        return out, K, torch.cat(us, 1), torch.cat(vs, 1)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, scale = inputs
        out, K, us, vs = output
        ctx.save_for_backward(q, k, v, out, K, us, vs)
        ctx.scale = scale
        ctx.mark_non_differentiable(K, us, vs)

    @staticmethod
    def backward(ctx, dO, *unused):
        q, k, v, out, K, us, vs = ctx.saved_tensors
        b = q.shape[1] / k.shape[1]
        u, vt = us[:, -1], vs[:, -1]  # (B, n), (B, m)
        uO = u.unsqueeze(-1) * dO
        D = torch.bmm(K.transpose(1, 2), uO)
        du = torch.linalg.vecdot(dO, out) / u
        dvt = torch.linalg.vecdot(v, D)
        X, Y = [], []
        for t in range(N_ITERS, 0, -1):  # reverse mode through the scalings
            if t % 2:  # row step u_t = 1 / K v_{t-1}
                ut, before = us[:, (t - 1) // 2], vs[:, (t - 1) // 2]
                dr = -du * ut * ut
                X.append(dr), Y.append(before)
                dvt = dvt + torch.bmm(dr.unsqueeze(1), K).squeeze(1)
                du = torch.zeros_like(du)
            else:  # column step v_t = b / K^T u_{t-1}
                vtt, before = vs[:, t // 2], us[:, t // 2 - 1]
                ds = -dvt * vtt * vtt / b
                X.append(before), Y.append(ds)
                du = du + torch.bmm(ds.unsqueeze(1), K.transpose(1, 2)).squeeze(1)
                dvt = torch.zeros_like(dvt)
        left = torch.cat([uO, torch.stack(X, -1)], -1)
        right = torch.cat([v * vt.unsqueeze(-1), torch.stack(Y, -1)], -1)
        dS = torch.bmm(left, right.transpose(1, 2)).mul_(K)
        return (torch.bmm(dS, k).mul_(ctx.scale), torch.bmm(dS.transpose(1, 2), q).mul_(ctx.scale),
                D * vt.unsqueeze(-1), None)


def floor_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """:class:`Floor` on ``(b, h, n, d)`` inputs (flattened to ``(b·h, n, d)`` and back)."""
    shape = q.shape
    flat = [t.reshape(-1, *t.shape[-2:]) for t in (q, k, v)]
    return Floor.apply(*flat, shape[-1] ** -0.5)[0].view(*shape[:-1], v.shape[-1])


def measure(ns=NS, rounds: int = 5, progress=print) -> list[dict]:
    """Per n: the median over rounds (methods interleaved) of each method's p10 thread time in ms."""
    import sinkformer
    from sinkformer.attention.functional import _prepare

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows = []
    try:
        for n in ns:
            q, k, v = (torch.randn(4, 8, n, 64, requires_grad=True) for _ in range(3))
            calls = {
                ("sdpa", "forward+backward"): lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)
                .sum().backward(),
                ("ours", "forward+backward"): lambda: sinkformer.attention(q, k, v, n_iters=N_ITERS).sum().backward(),
                ("floor", "forward+backward"): lambda: floor_attention(q, k, v).sum().backward(),
                ("sdpa", "forward"): lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v),
                ("ours", "forward"): lambda: sinkformer.attention(q, k, v, n_iters=N_ITERS),
                ("floor", "forward"): lambda: floor_attention(q, k, v),
                ("prepare", "forward"): lambda: _prepare(q, k, v, n_iters=N_ITERS),
            }
            repeats = max(10, 2000 // n)
            times: dict = {key: [] for key in calls}
            for r in range(rounds):
                for key in (list(calls) if r % 2 == 0 else list(calls)[::-1]):
                    with torch.set_grad_enabled(key[1] == "forward+backward"):
                        calls[key]()
                        runs = []
                        for _ in range(repeats):
                            start = time.thread_time()
                            calls[key]()
                            runs.append(time.thread_time() - start)
                    times[key].append(sorted(runs)[len(runs) // 10] * 1e3)
            row = {"n": n, "batch": 4, "heads": 8, "rounds": rounds}
            for (method, what), values in times.items():
                row[f"{method} {what}"] = statistics.median(values)
            rows.append(row)
            progress(f"n={n}: ours {row['ours forward+backward']:.2f} ms, "
                     f"floor {row['floor forward+backward']:.2f} ms")
    finally:
        torch.set_num_threads(threads)
    return rows


def render(rows: list[dict], meta: dict) -> str:
    lines = [f"One thread, CPU time of the calling thread (p10 of the repeats, median over {meta['rounds']} "
             f"interleaved rounds); b × h = 4 × 8, d = 64, float32, {N_ITERS} iterations; measured {meta['when']} on "
             f"{meta['machine']}, torch {meta['torch']}. Times in ms; `floor`: the same arithmetic in a bare autograd "
             "function (no mask, no validation, no engine choice); `ours − floor`: the library's cost beyond the "
             "arithmetic.", "",
             "| n | SDPA fwd / fwd+bwd | ours fwd / fwd+bwd | floor fwd / fwd+bwd | prepare | ours − floor, fwd+bwd "
             "| ours / SDPA, fwd+bwd | floor / SDPA, fwd+bwd |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        def pair(method):
            return f"{r[f'{method} forward']:.3f} / {r[f'{method} forward+backward']:.3f}"

        sdpa = r["sdpa forward+backward"]
        lines.append(f"| {r['n']} | {pair('sdpa')} | {pair('ours')} | {pair('floor')} | {r['prepare forward']:.3f} | "
                     f"{r['ours forward+backward'] - r['floor forward+backward']:.3f} | "
                     f"{r['ours forward+backward'] / sdpa:.2f} | {r['floor forward+backward'] / sdpa:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks overhead", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="benchmark-results")
    args = parser.parse_args(argv)
    rows = measure(rounds=args.rounds)
    meta = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
            "machine": platform.processor() or platform.machine(), "rounds": args.rounds}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "overhead.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    text = render(rows, meta)
    (out / "overhead.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
