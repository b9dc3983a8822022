"""A change measured before and after: the attention grid (or the block sorting) of two source trees, in
interleaved rounds.

``python -m benchmarks ab --before /tmp/before --after .`` times ``sinkformer.attention`` (forward and
backward, the default engine, b x h slices of n tokens, d = 64, float32) with the package of each tree
(``<tree>/src`` on the path), one fresh process per tree and round, the trees alternating round by
round so that both see the same machine load. It prints, per n, each tree's median time over rounds
and the median over rounds of the per-round ratio after/before with its range: a ratio above 1 is a
slowdown; and the aten calls of one forward+backward in each tree (profiler events, counted on one
thread so that the profiler sees every call), a count that machine load does not blur; and whether the
two trees compute the same results: the output and the gradients of one seeded forward+backward, equal
entry by entry or not (then the largest difference). ``--before`` is a folder (a clone at the commit
before the change: ``git worktree add /tmp/before HEAD``). With ``--out`` it also writes ``ab.json`` and
``ab.md``.

``--clock cpu`` (with ``--threads 1``) times each repeat in CPU time of the calling thread and takes the
lower decile of the repeats (the least disturbed ones) instead of the median wall time: a machine shared
with other virtual machines moves wall times by tens of percent from round to round, which hides the
few percent of a change to the cost per call at short sequences.

``--paired P`` times call against call within each round: one worker process per tree serves timed calls
on request, and the parent alternates them (before, after, then after, before, ...) ``P`` times per n, so
that each pair of calls sees nearly the same machine: a shared virtual machine's load moves between the
seconds of two rounds more than between two calls in a row. A round's ratio is the median of its pairs'; the
rounds, each with fresh processes, average out what belongs to one process for its whole life (its place
in memory: a bias even against the same tree). It reports,
per n, the median of the rounds' ratios and a 95 % interval for it (distribution-free: order statistics,
:func:`median_interval`).

``--dropout P`` times the attention with ``dropout_p = P`` (training's weight dropout); the results are then
compared from the same seed, so they are equal only when both trees draw the same masks.

``--workload sort`` times Sparse Sinkhorn Attention's block sorting instead:
:func:`sinkformer.attention.sparse.sort_matrix` (``sort_iters = --iters``, temperature 0.75, ``--causal``:
the causal, prefix-balanced sorting) forward and backward on ``(b, h, N_B, N_B)`` logits of spread 3,
``n`` being :math:`N_B` (:data:`SORT_SHAPES`: the quick experiments' sizes, 8 to 96 blocks, and longer).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

#: n -> (batch, heads, repeats per round)
SHAPES = {16: (4, 8, 50), 64: (4, 8, 30), 128: (4, 8, 20), 256: (4, 8, 10), 512: (4, 8, 5), 1024: (4, 8, 3),
          2048: (1, 8, 2), 4096: (1, 8, 1), 16384: (1, 2, 1)}
#: --workload sort: N_B -> (batch, heads, repeats per round)
SORT_SHAPES = {8: (32, 4, 50), 16: (32, 4, 30), 32: (32, 4, 20), 96: (32, 4, 5), 256: (1, 4, 5)}
WORKLOADS = {"attention": SHAPES, "sort": SORT_SHAPES}

_WORKER = r"""
import json, os, sys, time, torch
from torch.profiler import ProfilerActivity, profile
import sinkformer
ns, n_iters, causal = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
shapes, what, workload, cpu = json.loads(sys.argv[4]), sys.argv[5], sys.argv[6], sys.argv[8] == "cpu"
dropout = float(sys.argv[9])
clock = time.thread_time if cpu else time.perf_counter
count_ops = what == "ops"
def workload_of(n, b, h):  # (inputs, forward, step) of size n: each n's closures over its own tensors
    if workload == "sort":
        from sinkformer.attention.sparse import sort_matrix
        x, w = (3 * torch.randn(b, h, n, n)).requires_grad_(), torch.randn(b, h, n, n)
        def forward():
            return sort_matrix(x, sort_iters=n_iters, temperature=0.75, causal=causal)
        def step():
            (forward() * w).sum().backward()
        return (x,), forward, step
    q, k, v = (torch.randn(b, h, n, 64, requires_grad=True) for _ in range(3))
    def forward():
        return sinkformer.attention(q, k, v, n_iters=n_iters, is_causal=causal, dropout_p=dropout)
    def step():
        forward().sum().backward()
    return (q, k, v), forward, step
torch.manual_seed(0)
out = {}
for n in ns:
    b, h, repeats = shapes[str(n)]
    inputs, forward, step = workload_of(n, b, h)
    if what == "results":  # the output and the gradients of a seeded cotangent, saved for the parent
        torch.manual_seed(1)
        result = forward()
        grads = torch.autograd.grad((result * torch.randn_like(result)).sum(), inputs)
        path = os.path.join(sys.argv[7], f"{n}.pt")
        torch.save([result.detach()] + list(grads), path)
        out[n] = path
        continue
    step()
    if what == "serve":  # timed calls on request (--paired): the steps of every n, kept for the requests below
        out[n] = step
        continue
    if count_ops:  # the aten calls of one step (profiler events, nested ones included): no noise
        torch.set_num_threads(1)  # every call on this thread, where the profiler sees it
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        out[n] = sum(e.name.startswith("aten::") for e in prof.events())
        continue
    times = []
    for _ in range(repeats):
        t = clock(); step(); times.append(clock() - t)
    out[n] = sorted(times)[len(times) // 10 if cpu else len(times) // 2] * 1e3
if what == "serve":
    print("ready", flush=True)
    for line in sys.stdin:  # one n per line: one timed forward+backward, its milliseconds on one line
        t = clock(); out[int(line)](); elapsed = clock() - t
        print(elapsed * 1e3, flush=True)
else:
    print(json.dumps(out))
"""


def shapes(ns: list[int], heads: int | None = None, workload: str = "attention") -> dict[int, tuple[int, int, int]]:
    """``(batch, heads, repeats)`` per n: the ``workload``'s table (:data:`WORKLOADS`), or with ``heads`` heads
    (the repeats scaled up as the slices go down, so that a round times about as much work)."""
    table = WORKLOADS[workload]
    if heads is None:
        return {n: table[n] for n in ns}
    return {n: (table[n][0], heads, max(1, table[n][2] * table[n][1] // heads)) for n in ns}


def measure(tree: Path, ns: list[int], n_iters: int, causal: bool, threads: int | None,
            what: str = "time", heads: int | None = None, workload: str = "attention",
            folder: Path | None = None, clock: str = "wall", dropout: float = 0.0) -> dict[int, float]:
    """Per n, in a fresh process on ``tree``: milliseconds of one forward+backward, median of the
    repeats (``what="time"``; ``clock="cpu"``: the lower decile of their CPU times), the aten calls of
    one forward+backward (``what="ops"``), or the path of a file in ``folder`` holding the output and
    gradients of one seeded forward+backward (``what="results"``)."""
    command, env = _worker(tree, ns, n_iters, causal, threads, what, heads, workload, folder, clock, dropout)
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return {int(n): value for n, value in json.loads(done.stdout.strip().splitlines()[-1]).items()}


def _worker(tree: Path, ns: list[int], n_iters: int, causal: bool, threads: int | None, what: str,
            heads: int | None, workload: str, folder: Path | None, clock: str, dropout: float):
    """The command line and environment of a worker process on ``tree`` (:data:`_WORKER`)."""
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    shapes_json = json.dumps({str(n): shape for n, shape in shapes(ns, heads, workload).items()})
    return ([sys.executable, "-c", _WORKER, json.dumps(ns), str(n_iters), "1" if causal else "0", shapes_json, what,
             workload, str(folder or ""), clock, str(dropout)], env)


class Server:
    """A worker process on one tree that times one forward+backward of size ``n`` per :meth:`time` call
    (``--paired``); a context manager that ends the process. With one thread, every server runs on the same
    core (the first this process may use)."""

    def __init__(self, tree: Path, ns: list[int], n_iters: int, causal: bool, threads: int | None,
                 heads: int | None = None, workload: str = "attention", clock: str = "wall", dropout: float = 0.0):
        command, env = _worker(tree, ns, n_iters, causal, threads, "serve", heads, workload, None, clock, dropout)
        self.process = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if threads == 1 and hasattr(os, "sched_setaffinity"):
            # both trees' workers on one core: left on two cores, they would compare the cores as much as the trees
            os.sched_setaffinity(self.process.pid, {min(os.sched_getaffinity(0))})
        if self.process.stdout.readline().strip() != "ready":
            self.close()
            raise RuntimeError(f"the worker on {tree} did not start (exit code {self.process.returncode})")

    def time(self, n: int) -> float:
        """Milliseconds of one forward+backward of size ``n``."""
        self.process.stdin.write(f"{n}\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the worker ended (exit code {self.process.wait()})")
        return float(line)

    def close(self) -> None:
        if self.process.stdin and not self.process.stdin.closed:
            self.process.stdin.close()
        self.process.wait()

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """A distribution-free ``level`` interval for the median of the population ``values`` were drawn from:
    order statistics ``(x_(j), x_(N+1-j))`` with the largest ``j`` such that ``P(Binomial(N, 1/2) < j)`` is at
    most ``(1 - level) / 2``; the whole range when ``N`` is too small for ``level``."""
    x = sorted(values)
    N = len(x)
    j, below = 0, 0.0  # below: P(Binomial(N, 1/2) < j + 1)
    while True:
        below += math.comb(N, j) / 2**N
        if below > (1 - level) / 2:
            break
        j += 1
    j = max(j, 1)
    return x[j - 1], x[N - j]


def difference(before: str | Path, after: str | Path) -> float:
    """The largest absolute difference between two saved results (:func:`measure`'s ``"results"``): 0.0
    when every entry is equal (NaNs in the same places); ``inf`` when shapes or NaN places differ."""
    import torch

    a, b = torch.load(before), torch.load(after)
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        return float("inf")
    worst = 0.0
    for x, y in zip(a, b):
        if not torch.equal(x.isnan(), y.isnan()):
            return float("inf")
        same = (x == y) | x.isnan()
        gap = torch.where(same, 0.0, (x.double() - y.double()).abs())
        worst = max(worst, float(gap.max()) if gap.numel() else 0.0)
    return worst


def compare(before: Path, after: Path, ns: list[int], n_iters: int, causal: bool, rounds: int,
            threads: int | None = None, progress=print, heads: int | None = None,
            workload: str = "attention", clock: str = "wall", dropout: float = 0.0) -> list[dict]:
    """Per n: both trees' medians over rounds (ms), the per-round ratios after/before, the aten calls of
    one forward+backward in each tree (counted once: they do not vary) and the largest difference between
    their results (``max_difference``: 0.0 when identical; with ``dropout``, the seed is the same, the masks
    are each tree's own draw). ``heads``: instead of the table's heads."""
    times: dict[str, list[dict[int, float]]] = {"before": [], "after": []}
    for r in range(rounds):
        order = [("before", before), ("after", after)] if r % 2 == 0 else [("after", after), ("before", before)]
        for name, tree in order:
            times[name].append(measure(tree, ns, n_iters, causal, threads, heads=heads, workload=workload,
                                       clock=clock, dropout=dropout))
        progress(f"round {r + 1}/{rounds} done")
    rows = []
    for row in _calls_and_results(before, after, ns, n_iters, causal, threads, heads, workload, clock, dropout):
        n = row["n"]
        ratios = [a[n] / b[n] for a, b in zip(times["after"], times["before"])]
        rows.append(dict(row, before_ms=statistics.median(t[n] for t in times["before"]),
                         after_ms=statistics.median(t[n] for t in times["after"]), ratio=statistics.median(ratios),
                         ratio_min=min(ratios), ratio_max=max(ratios), rounds=rounds))
    return rows


def _calls_and_results(before: Path, after: Path, ns: list[int], n_iters: int, causal: bool, threads: int | None,
                       heads: int | None, workload: str, clock: str, dropout: float) -> list[dict]:
    """Per n, what does not need timing: the shape, the aten calls of one forward+backward in each tree
    (counted once: they do not vary) and the largest difference between their results."""
    ops = {name: measure(tree, ns, n_iters, causal, threads, what="ops", heads=heads, workload=workload,
                         dropout=dropout)
           for name, tree in (("before", before), ("after", after))}
    with tempfile.TemporaryDirectory() as folder:
        saved = {}
        for name, tree in (("before", before), ("after", after)):
            (Path(folder) / name).mkdir()
            saved[name] = measure(tree, ns, n_iters, causal, threads, what="results", heads=heads,
                                  workload=workload, folder=Path(folder) / name, dropout=dropout)
        differences = {n: difference(saved["before"][n], saved["after"][n]) for n in ns}
    sizes = shapes(ns, heads, workload)
    return [{"n": n, "batch_heads": sizes[n][:2], "before_ops": ops["before"][n], "after_ops": ops["after"][n],
             "max_difference": differences[n], "clock": clock, "dropout": dropout} for n in ns]


def compare_paired(before: Path, after: Path, ns: list[int], n_iters: int, causal: bool, pairs: int,
                   rounds: int, threads: int | None = None, progress=print, heads: int | None = None,
                   workload: str = "attention", clock: str = "wall", dropout: float = 0.0,
                   warmup: int = 3) -> list[dict]:
    """:func:`compare` call against call: ``rounds`` rounds, each with a fresh :class:`Server` per tree (started
    in alternating order) and ``pairs`` pairs of calls per n (before then after, then after then before, ...)
    after ``warmup`` calls of each. A round's ratio is the median of its pairs' ratios after/before: within a
    round the machine's drift cancels pair by pair, and across rounds what belongs to one process for its
    whole life (its place in memory: a bias even against the same tree) averages out.
    Per n: each tree's median call (ms), the median of the rounds' ratios and its 95 % interval
    (:func:`median_interval` over the rounds); the aten calls and the results as in :func:`compare`."""
    round_ratios: dict[int, list[float]] = {n: [] for n in ns}
    times: dict[str, dict[int, list[float]]] = {"before": {n: [] for n in ns}, "after": {n: [] for n in ns}}
    for r in range(rounds):
        trees = [("before", before), ("after", after)][::1 if r % 2 == 0 else -1]
        with Server(trees[0][1], ns, n_iters, causal, threads, heads, workload, clock, dropout) as first, \
                Server(trees[1][1], ns, n_iters, causal, threads, heads, workload, clock, dropout) as second:
            servers = {trees[0][0]: first, trees[1][0]: second}
            for n in ns:
                for _ in range(warmup):
                    first.time(n), second.time(n)
                ratios = []
                for i in range(pairs):
                    order = ("before", "after") if i % 2 == 0 else ("after", "before")
                    pair = {name: servers[name].time(n) for name in order}
                    for name, ms in pair.items():
                        times[name][n].append(ms)
                    ratios.append(pair["after"] / pair["before"])
                round_ratios[n].append(statistics.median(ratios))
        progress(f"round {r + 1}/{rounds} done")
    rows = []
    for row in _calls_and_results(before, after, ns, n_iters, causal, threads, heads, workload, clock, dropout):
        n = row["n"]
        low, high = median_interval(round_ratios[n])
        rows.append(dict(row, before_ms=statistics.median(times["before"][n]),
                         after_ms=statistics.median(times["after"][n]), ratio=statistics.median(round_ratios[n]),
                         ratio_low=low, ratio_high=high, round_ratios=round_ratios[n], pairs=pairs, rounds=rounds))
    return rows


def source(tree: Path) -> str:
    """The commit of ``tree`` (``+dirty`` when its tracked files differ from it), or ``"unknown"``."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short=12", "HEAD")
    if not commit:
        return "unknown"
    return commit + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def table(rows: list[dict], n_iters: int, causal: bool, trees: tuple[str, str] | None = None,
          workload: str = "attention") -> str:
    dropout = rows[0].get("dropout", 0.0)
    what = (f"{'causal ' if causal else ''}Sinkhorn, n_iters={n_iters}"
            f"{f', dropout_p={dropout:g}' if dropout else ''}, forward+backward, float32, d=64"
            if workload == "attention" else f"{'causal ' if causal else ''}block sorting (sort_matrix), "
            f"sort_iters={n_iters}, forward+backward, float32 logits, n = N_B")
    paired = "pairs" in rows[0]
    cpu = rows[0].get("clock") == "cpu"
    if paired:
        design = (f"{rows[0]['rounds']} rounds of fresh processes, each the median of {rows[0]['pairs']} pairs of "
                  "calls, the trees alternating call by call" + ("; CPU time of the calling thread, one thread, "
                                                                 "both trees on one core" if cpu else ""))
        spread = "after / before: median of the rounds (95 % interval)"
    else:
        design = (f"medians over {rows[0]['rounds']} interleaved rounds"
                  + ("; each round: the lower decile of its repeats' CPU times, one thread" if cpu else ""))
        spread = "after / before (range over rounds)"
    lines = [f"{what}; {design}" + (f"; before = {trees[0]}, after = {trees[1]}" if trees else ""), "",
             f"| n | b × h | before (ms) | after (ms) | {spread} | aten calls before → after | results |",
             "|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        b, h = r["batch_heads"]
        ops = f"{r['before_ops']} → {r['after_ops']}" if "before_ops" in r else "—"
        low, high = (r["ratio_low"], r["ratio_high"]) if paired else (r["ratio_min"], r["ratio_max"])
        lines.append(f"| {r['n']} | {b} × {h} | {r['before_ms']:.2f} | {r['after_ms']:.2f} | "
                     f"{r['ratio']:.3f} ({low:.3f}–{high:.3f}) | {ops} | "
                     f"{_results(r.get('max_difference'))} |")
    return "\n".join(lines)


def _results(difference: float | None) -> str:
    """The results column: ``identical`` (every entry equal), or the largest absolute difference (``—``: not
    compared)."""
    if difference is None:
        return "—"
    return "identical" if difference == 0 else f"differ (max \\|Δ\\| {difference:.2g})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks ab", description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, type=Path, help="the source tree before the change")
    parser.add_argument("--after", default=Path("."), type=Path, help="the source tree after it (default: .)")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="attention",
                        help="attention (default) or sort: Sparse Sinkhorn Attention's block sorting")
    parser.add_argument("--n", nargs="+", type=int, help="sizes (default: 64 256 1024 4096; sort: every N_B "
                        f"of {sorted(SORT_SHAPES)})")
    parser.add_argument("--iters", type=int, default=5, help="Sinkhorn iterations (default 5)")
    parser.add_argument("--causal", action="store_true", help="is_causal=True")
    parser.add_argument("--dropout", type=float, default=0.0, help="dropout_p of the attention workload (default 0)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--paired", type=int, metavar="P",
                        help="time call against call: in each round, P pairs of calls per n, the trees alternating")
    parser.add_argument("--threads", type=int, help="OMP_NUM_THREADS of the workers (default: torch's)")
    parser.add_argument("--heads", type=int, help="heads of every n (default: the table's, e.g. 8)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="wall: median wall time of the repeats (default); cpu: lower decile of their CPU "
                        "times (needs --threads 1)")
    parser.add_argument("--out", type=Path, help="folder for ab.json and ab.md")
    args = parser.parse_args(argv)
    if args.clock == "cpu" and args.threads != 1:
        parser.error(f"--clock cpu counts the calling thread only: it needs --threads 1, got --threads {args.threads}")
    if not 0.0 <= args.dropout < 1.0 or (args.dropout and args.workload != "attention"):
        parser.error(f"--dropout must be in [0, 1), with --workload attention, got {args.dropout} "
                     f"(--workload {args.workload})")
    if args.heads is not None and args.heads < 1:
        parser.error(f"--heads must be >= 1, got {args.heads}")
    sizes = WORKLOADS[args.workload]
    args.n = args.n or ([64, 256, 1024, 4096] if args.workload == "attention" else sorted(sizes))
    if any(n not in sizes for n in args.n):
        parser.error(f"--n must be among {sorted(sizes)} for --workload {args.workload}, got {args.n}")
    for name in ("before", "after"):
        tree = getattr(args, name)
        if not (tree / "src" / "sinkformer" / "__init__.py").is_file():
            parser.error(f"--{name} must be a source tree with src/sinkformer, got {str(tree)!r}")
    if args.paired is not None and args.paired < 1:
        parser.error(f"--paired must be >= 1, got {args.paired}")
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    common = dict(progress=lambda s: print(s, file=sys.stderr), heads=args.heads, workload=args.workload,
                  clock=args.clock, dropout=args.dropout)
    if args.paired is not None:
        rows = compare_paired(args.before.resolve(), args.after.resolve(), args.n, args.iters, args.causal,
                              args.paired, args.rounds, args.threads, **common)
    else:
        rows = compare(args.before.resolve(), args.after.resolve(), args.n, args.iters, args.causal, args.rounds,
                       args.threads, **common)
    trees = (source(args.before), source(args.after))
    text = table(rows, args.iters, args.causal, trees, args.workload)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        made = {"before": trees[0], "after": trees[1], "workload": args.workload,
                "machine": platform.processor() or platform.machine(),
                "cpus": os.cpu_count(), "rows": rows}
        (args.out / "ab.json").write_text(json.dumps(made, indent=1) + "\n")
        (args.out / "ab.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
