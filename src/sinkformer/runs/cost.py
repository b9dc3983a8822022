r"""What reproducing a table costs: training steps measured here, counted, and turned into GPU-hours.

An experiment's ``--full`` configuration trains some models (:class:`Workload`: the model at full
size, its batch shape, its number of optimizer steps and of runs — seeds and variants). For each,
:func:`measure` times one training step (forward, backward, Adam update) on this machine's CPU
on random inputs of the full shapes — on ``time_batch`` examples, scaled linearly to the full
batch — and multiplies by the steps. That is the CPU time of the full run. GPU-hours divide it by
the throughput ratio of a reference GPU to this CPU on dense float32/TF32 matrix products
(:func:`cpu_matmul_flops` is measured, :data:`GPU_FLOPS` is stated): training steps are dominated
by matrix products on both, so this is an estimate within a factor of about 3 (attention on long
sequences is memory-bound on a GPU and costs relatively more there).

``python -m sinkformer.runs.cost [NAME ...]`` measures and writes ``sinkformer/runs/measured/full-cost.json``,
which ``sinkformer experiments`` shows.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["Workload", "measure", "estimate", "cpu_matmul_flops", "GPU_FLOPS", "GPU_NAME", "COSTS", "images",
           "points", "tokens", "translation"]

#: The reference GPU's sustained matrix-product throughput (TF32/bf16; about a third of an A100's peak).
GPU_FLOPS = 100e12
GPU_NAME = "an A100 sustaining 100 TFLOP/s on matrix products"
COSTS = Path(__file__).resolve().parent / "measured" / "full-cost.json"


@dataclass(frozen=True)
class Workload:
    """One model of a full run: ``model``/``info``/``options`` for :func:`sinkformer.models.build_model`
    (or ``model`` a builder called as ``model(info, **options)``, for an experiment's own model),
    ``inputs(batch)`` the keyword inputs of one batch, ``steps`` optimizer steps per run, ``runs`` runs
    (seeds × identical variants)."""

    label: str
    model: str | Callable[..., torch.nn.Module]
    info: dict[str, Any]
    options: dict[str, Any]
    inputs: Callable[[int], dict[str, torch.Tensor]]
    batch_size: int
    steps: int
    runs: int = 1


def images(channels: int, size: int) -> Callable[[int], dict]:
    return lambda b: {"images": torch.randn(b, channels, size, size)}


def points(n: int) -> Callable[[int], dict]:
    return lambda b: {"points": torch.randn(b, n, 3)}


def tokens(vocab: int, length: int) -> Callable[[int], dict]:
    return lambda b: {"tokens": torch.randint(4, vocab, (b, length))}


def translation(vocab: int, source: int, target: int) -> Callable[[int], dict]:
    return lambda b: {"src": torch.randint(4, vocab, (b, source)), "tgt": torch.randint(4, vocab, (b, target))}


def measure(workload: Workload, *, time_batch: int = 4, repeats: int = 2) -> dict[str, Any]:
    """Seconds per optimizer step of ``workload`` at its full batch on this CPU (median of ``repeats``
    timed steps on ``min(time_batch, batch_size)`` examples after one warm-up, scaled linearly)."""
    from ..models import build_model

    torch.manual_seed(0)
    if callable(workload.model):
        model = workload.model(workload.info, **workload.options)
    else:
        model = build_model(workload.model, workload.info, **workload.options)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    b = min(time_batch, workload.batch_size)
    batch = workload.inputs(b)

    def step() -> float:
        start = time.perf_counter()
        optimizer.zero_grad()
        model(**batch).float().square().mean().backward()
        optimizer.step()
        return time.perf_counter() - start

    step()
    seconds = statistics.median(step() for _ in range(repeats)) * workload.batch_size / b
    return {"label": workload.label, "step_seconds": seconds, "steps": workload.steps, "runs": workload.runs,
            "parameters": sum(p.numel() for p in model.parameters()),
            "cpu_hours": seconds * workload.steps * workload.runs / 3600}


def cpu_matmul_flops(n: int = 1024, repeats: int = 5) -> float:
    """This CPU's float32 matrix-product throughput (FLOP/s), median of ``repeats`` ``n³`` products."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(times)


def estimate(name: str, *, time_batch: int = 4, config: dict | None = None) -> dict[str, Any]:
    """The cost of ``sinkformer run NAME --full`` (or of ``config``): per workload and in total."""
    from ..provenance import provenance
    from .registry import get

    exp = get(name)
    if exp.cost is None:
        raise ValueError(f"experiment {name!r} has no GPU cost model (it runs on the CPU: about "
                         f"{exp.full_minutes or exp.quick_minutes:g} min)")
    config = config if config is not None else {**exp.defaults, **exp.full}
    rows = [measure(w, time_batch=time_batch) for w in exp.cost(config)]
    cpu_hours = sum(r["cpu_hours"] for r in rows)
    flops = cpu_matmul_flops()
    facts = provenance()
    return {"experiment": name, "workloads": rows, "cpu_hours": cpu_hours, "cpu_matmul_gflops": flops / 1e9,
            "gpu_hours": cpu_hours * flops / GPU_FLOPS, "gpu": GPU_NAME, "cpu": facts["cpu"],
            "threads": facts["torch_threads"], "date": facts["date"]}


def load_costs() -> dict[str, dict]:
    """The committed estimates (``sinkformer/runs/measured/full-cost.json``), by experiment; empty if absent."""
    return json.loads(COSTS.read_text()) if COSTS.is_file() else {}


def main(argv: list[str] | None = None) -> int:
    from .registry import registry

    names = (argv if argv is not None else sys.argv[1:]) or [n for n, e in registry().items() if e.cost is not None]
    costs = load_costs()
    for name in names:
        costs[name] = estimate(name)
        print(f"{name}: {costs[name]['gpu_hours']:.1f} GPU-hours ({costs[name]['cpu_hours']:.0f} CPU-hours here)",
              flush=True)
        COSTS.parent.mkdir(parents=True, exist_ok=True)
        COSTS.write_text(json.dumps(costs, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
