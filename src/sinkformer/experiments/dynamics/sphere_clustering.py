r"""Clustering of tokens on the sphere: phase diagrams (Geshkovski et al.) and metastability (Geshkovski, Koubbi et al.).

``phase-diagram``: ``n_systems`` systems of ``n_tokens`` tokens uniform on :math:`S^{d-1}`, for each
inverse temperature :math:`\beta` of a grid, follow SoftMax (SA), Sinkhorn and causal SoftMax attention
on the sphere (:func:`sinkformer.dynamics.phase.phase_diagram`, one tensor program per attention); the
figure is the probability of a single cluster over :math:`(\beta, t)` (``docs/theory.md`` §16.6).

``metastability``: a few systems on the circle at large :math:`\beta` for a long time; the normalised
interaction energy :math:`2\beta e^{-\beta}E_\beta(t)\approx\sum_k m_k^2` climbs a staircase — plateaus
at multi-cluster states that last exponentially long in :math:`\beta`, and jumps when two clusters merge —
for SoftMax and for Sinkhorn attention.
"""

from __future__ import annotations

import math

import torch

from ...dynamics import simulate
from ...dynamics.clustering import diagnostics
from ...dynamics.phase import LayerWeights, phase_diagram, uniform_on_sphere
from ...plotting import method_color, pyplot
from ...runs import Run, register

__all__ = ["phase_diagrams", "staircases", "phase_figure", "staircase_figure", "run_phase", "run_metastability"]

#: attention -> (velocity kind, extra velocity arguments)
ATTENTIONS = {"softmax": ("softmax", {}), "sinkhorn": ("sinkhorn", {}), "causal": ("causal", {"n_iters": 1})}
LABELS = {"softmax": "SoftMax (SA)", "sinkhorn": "Sinkhorn", "causal": "causal SoftMax"}


def phase_diagrams(cfg: dict, ctx: Run | None = None) -> dict:
    """One :class:`~sinkformer.dynamics.phase.PhaseDiagram` per attention of ``cfg["attentions"]`` (with ``ctx``,
    a progress row per recorded time)."""
    betas = torch.linspace(0.0, cfg["beta_max"], cfg["n_betas"], dtype=torch.float64)
    out = {}
    for name in cfg["attentions"]:
        kind, kwargs = ATTENTIONS[name]
        systems = cfg["n_systems_sinkhorn"] if name == "sinkhorn" else cfg["n_systems"]
        out[name] = phase_diagram(
            kind, betas, n_systems=systems, n_tokens=cfg["n_tokens"], d=cfg["d"], t1=cfg["t1"], dt=cfg["dt"],
            ensemble=cfg["ensemble"], regenerate_every=cfg["regenerate_every"], record_every=cfg["record_every"],
            seed=cfg["seed"], device=cfg["device"],
            progress=None if ctx is None else (lambda t, name=name: ctx.log(attention=name, simulated_time=t)), **kwargs,
        )
    return out


def _critical_beta(pd) -> float:
    """The smallest beta whose single-cluster probability at the last time is below 1/2 (nan if none)."""
    below = (pd.single_cluster[-1] < 0.5).nonzero()
    return float(pd.betas[below[0, 0]]) if len(below) else float("nan")


def phase_figure(results: dict, cfg: dict):
    plt = pyplot()
    names = list(results)
    fig, axes = plt.subplots(1, len(names) + 1, figsize=(4.6 * (len(names) + 1), 4.2))
    for ax, name in zip(axes, names):
        pd = results[name]
        extent = (float(pd.betas[0]), float(pd.betas[-1]), float(pd.times[0]), float(pd.times[-1]))
        image = ax.imshow(pd.single_cluster.numpy(), origin="lower", aspect="auto", extent=extent, vmin=0, vmax=1,
                          cmap="viridis", interpolation="nearest")
        ax.set(xlabel="β", ylabel="t", title=f"{LABELS[name]}: P(single cluster)\n{pd.n_systems} systems per β")
    fig.colorbar(image, ax=axes[len(names) - 1])
    ax = axes[-1]
    for name in names:
        pd = results[name]
        ax.plot(pd.betas.numpy(), pd.single_cluster[-1].numpy(), "o-", ms=3, color=method_color(name, "tab:green"),
                label=LABELS[name])
    ax.set(xlabel="β", ylabel=f"P(single cluster) at t = {float(results[names[0]].times[-1]):g}", ylim=(-0.03, 1.03),
           title="last time")
    ax.legend(fontsize=8)
    fig.suptitle(f"{cfg['n_tokens']} tokens uniform on S^{cfg['d'] - 1}, weights '{cfg['ensemble']}'"
                 + (f" redrawn every {cfg['regenerate_every']:g}" if cfg["regenerate_every"] else "")
                 + f"; single cluster = every pair within {0.1:g} (chordal)")
    fig.tight_layout()
    return fig


@register(
    "phase-diagram",
    description="Probability of a single cluster over (beta, t) on the sphere: SoftMax, Sinkhorn, causal attention",
    paper="Geshkovski, Letrouit, Polyanskiy, Rigollet, A mathematical perspective on Transformers (phase diagrams)",
    quick_minutes=0.6,
    full_minutes=20.0,
    defaults={"attentions": ["softmax", "sinkhorn", "causal"], "n_betas": 12, "beta_max": 9.0, "n_systems": 48,
              "n_systems_sinkhorn": 16, "n_tokens": 32, "d": 3, "t1": 30.0, "dt": 0.1, "record_every": 10,
              "ensemble": "identity", "regenerate_every": None, "seed": 0, "device": "cpu"},
    full={"n_betas": 64, "n_systems": 1024, "n_systems_sinkhorn": 256},
)
def run_phase(ctx: Run) -> None:
    cfg = ctx.config
    results = phase_diagrams(cfg, ctx)
    for name, pd in results.items():
        for i, beta in enumerate(pd.betas.tolist()):
            ctx.log(attention=name, beta=beta, single_cluster_final=float(pd.single_cluster[-1, i]),
                    n_clusters_final=float(pd.n_clusters[i]), span_dimension_final=float(pd.span_dimension[i]))
    ctx.save_figure(phase_figure(results, cfg), "phase_diagram")
    ctx.results.update({name: {"betas": pd.betas.tolist(), "single_cluster_final": pd.single_cluster[-1].tolist(),
                               "n_clusters_final": pd.n_clusters.tolist(), "critical_beta": _critical_beta(pd),
                               "n_systems": pd.n_systems} for name, pd in results.items()})
    rows = "\n".join(
        f"| {LABELS[name]} | {pd.n_systems} | {_critical_beta(pd):.2f} | "
        f"{float(pd.single_cluster[-1, 0]):.2f} | {float(pd.single_cluster[-1, -1]):.2f} | "
        f"{float(pd.n_clusters[-1]):.2f} |" for name, pd in results.items()
    )
    ctx.write_report(f"""# Phase diagrams of attention on the sphere

![phase diagram](phase_diagram.png)

| attention | systems per β | smallest β with P(single cluster at t = {cfg['t1']:g}) < 1/2 | P at β = 0 | P at β = {cfg['beta_max']:g} | mean number of clusters at β = {cfg['beta_max']:g} |
|---|---|---|---|---|---|
{rows}

**Paper.** Geshkovski et al. show that tokens on the sphere following self-attention with
Q = K = V = I cluster: for small β (and, for d ≥ 3, every β, as t → ∞) they end in a single cluster,
and their phase diagrams show the single-cluster probability at finite time falling from 1 to 0 as β
grows — at large β the tokens first form several clusters that persist (metastability).

**This run.** {cfg['n_tokens']} tokens in d = {cfg['d']}, Euler step {cfg['dt']:g} to t = {cfg['t1']:g}
(a residual layer followed by LayerNorm per step), weights `{cfg['ensemble']}`; a single cluster means
every pair of tokens within chordal distance 0.1. {_comparison(results)} In causal attention token 1
sees only itself and never moves; the others converge to it as t → ∞ (`causal-clustering`), which a
finite horizon shows as a slower rise. Probabilities are over {cfg['n_systems']} systems per β
({cfg['n_systems_sinkhorn']} for Sinkhorn): the standard error of a probability p is √(p(1 − p)/n) ≤
{0.5 / math.sqrt(min(cfg['n_systems_sinkhorn'], cfg['n_systems'])):.2f}.
""")


def _comparison(results: dict) -> str:
    """A sentence comparing each attention's last-time single-cluster probabilities with SoftMax's, over the β grid."""
    if "softmax" not in results:
        return ""
    base = results["softmax"].single_cluster[-1]
    parts = []
    for name, pd in results.items():
        if name == "softmax":
            continue
        diff = pd.single_cluster[-1] - base
        parts.append(f"{LABELS[name]} minus SoftMax, averaged over the β grid: {float(diff.mean()):+.2f} "
                     f"(largest gap {float(diff.abs().max()):.2f} at β = {float(pd.betas[diff.abs().argmax()]):.2f})")
    return "Single-cluster probability at the last time, " + "; ".join(parts) + "."


def staircases(cfg: dict, ctx: Run | None = None) -> dict:
    """Normalised energy and number of clusters over time, ``(T, betas, systems)``, per attention (with ``ctx``,
    a progress row every 100 recorded times)."""
    betas = torch.tensor(cfg["betas"], dtype=torch.float64)
    B = len(betas)
    gen = torch.Generator().manual_seed(cfg["seed"])
    x0 = uniform_on_sphere((B, cfg["n_systems"], cfg["n_tokens"]), cfg["d"], generator=gen, dtype=torch.float64)
    params = LayerWeights("identity", (1, 1), cfg["d"], betas=betas.reshape(B, 1), dtype=torch.float64)(0.0)
    steps = math.ceil(cfg["t1"] / cfg["dt"])
    out = {}
    for name in cfg["attentions"]:
        kind, kwargs = ATTENTIONS[name]
        records = iter(range(steps + 1))

        def observe(x, name=name):
            if ctx is not None and next(records) % 100 == 0:
                ctx.log(attention=name, progress="recorded 100 more times")
            return diagnostics(x, beta=betas.reshape(B, 1), which=("energy", "n_clusters"))

        traj = simulate(x0, params, t1=steps * cfg["dt"], steps=steps, kind=kind, geometry="sphere",
                        record_every=cfg["record_every"], keep_positions=False, observe=observe, **kwargs)
        out[name] = {"times": traj.times, "energy": traj.observed["energy"], "n_clusters": traj.observed["n_clusters"]}
    return out


def staircase_figure(results: dict, cfg: dict):
    plt = pyplot()
    names = list(results)
    fig, axes = plt.subplots(2, len(names), figsize=(6.2 * len(names), 7.5), sharex=True, squeeze=False)
    colors = plt.get_cmap("plasma")(torch.linspace(0.05, 0.8, len(cfg["betas"])).numpy())
    for col, name in enumerate(names):
        r = results[name]
        t = r["times"].numpy()
        keep = t > 0
        for b, beta in enumerate(cfg["betas"]):
            for s in range(cfg["n_systems"]):
                label = f"β = {beta:g}" if s == 0 else None
                axes[0, col].plot(t[keep], r["energy"][keep, b, s].numpy(), color=colors[b], lw=1.2, label=label)
                axes[1, col].step(t[keep], r["n_clusters"][keep, b, s].numpy(), where="post", color=colors[b], lw=1.0)
        axes[0, col].set(xscale="log", ylabel=r"$2\beta e^{-\beta}E_\beta(t)$  ($\approx\sum_k m_k^2$)", ylim=(0, 1.05),
                         title=f"{LABELS[name]}: interaction energy")
        axes[1, col].set(xscale="log", xlabel="t (log scale)", ylabel="number of clusters",
                         title=f"{LABELS[name]}: clusters (radius 0.1)")
        axes[0, col].legend(fontsize=8, loc="upper left")
    fig.suptitle(f"Metastability: {cfg['n_tokens']} tokens on S^{cfg['d'] - 1}, Q = K = V = I, "
                 f"{cfg['n_systems']} systems per β (Euler step {cfg['dt']:g})")
    fig.tight_layout()
    return fig


def _last_merge(times: torch.Tensor, clusters: torch.Tensor) -> float:
    """The last recorded time at which the number of clusters dropped (0 if it never did)."""
    drops = (clusters[1:] < clusters[:-1]).nonzero()
    return float(times[drops[-1, 0] + 1]) if len(drops) else 0.0


@register(
    "metastability",
    description="Staircase of the interaction energy on the circle at large beta: SoftMax vs Sinkhorn attention",
    paper="Geshkovski, Koubbi, Polyanskiy, Rigollet, Dynamic metastability in the self-attention model",
    quick_minutes=0.5,
    full_minutes=15.0,
    defaults={"attentions": ["softmax", "sinkhorn"], "betas": [4.0, 9.0, 16.0], "n_systems": 2, "n_tokens": 32,
              "d": 2, "t1": 300.0, "dt": 0.25, "record_every": 2, "seed": 0},
    full={"n_systems": 6, "t1": 5000.0, "record_every": 8},
)
def run_metastability(ctx: Run) -> None:
    cfg = ctx.config
    results = staircases(cfg, ctx)
    summary = {}
    for name, r in results.items():
        for b, beta in enumerate(cfg["betas"]):
            e = r["energy"][:, b, :]
            clusters = r["n_clusters"][:, b, :]
            row = {"final_energy": e[-1].tolist(), "final_clusters": clusters[-1].tolist(),
                   "last_merge": [_last_merge(r["times"], clusters[:, s]) for s in range(cfg["n_systems"])]}
            summary.setdefault(name, {})[str(beta)] = row
            ctx.log(attention=name, beta=beta, **{k: str(v) for k, v in row.items()})
    ctx.save_figure(staircase_figure(results, cfg), "metastability")
    ctx.results.update(summary)
    rows = "\n".join(
        f"| {LABELS[name]} | {beta} | {row['final_clusters']} | "
        f"{', '.join(f'{e:.3f}' for e in row['final_energy'])} | {', '.join(f'{t:g}' for t in row['last_merge'])} |"
        for name, by_beta in summary.items() for beta, row in by_beta.items()
    )
    ctx.write_report(f"""# Metastability: the staircase of the interaction energy

![metastability](metastability.png)

| attention | β | clusters at t = {cfg['t1']:g} (per system) | 2β e^(−β) E_β at t = {cfg['t1']:g} | time of the last merge |
|---|---|---|---|---|
{rows}

**Paper.** Geshkovski, Koubbi, Polyanskiy and Rigollet show that at large β the tokens of
self-attention on the sphere quickly gather into a few clusters and stay there for a time exponential
in β before two clusters merge: the interaction energy E_β = (1/2β) Σᵢⱼ e^(β⟨xᵢ, xⱼ⟩)/n² climbs a staircase.

**This run.** {cfg['n_tokens']} tokens on the circle, Euler step {cfg['dt']:g} to t = {cfg['t1']:g}. The
normalised energy 2β e^(−β) E_β is 1 for one cluster and close to Σ_k m_k² for tight clusters of
masses m_k far apart, so each plateau is a metastable configuration and each jump a merge (a drop of
the number of clusters, bottom row). The table gives, per system, the clusters left at the end and the
last time two of them merged within the run; a merge still to come can take a time exponential in β.
The two attentions start from the same tokens.
""")
