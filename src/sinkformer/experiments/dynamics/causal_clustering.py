r"""Clustering in causal attention (Karagodin, Polyanskiy, Rigollet): every token converges to the first.

Token :math:`k` attends to the tokens :math:`j \le k` only. Token 1 sees only itself, so on the sphere
its velocity :math:`P^\perp_{x_1}Vx_1` vanishes for :math:`V = I` and it never moves; Karagodin et al.
prove that, for any :math:`Q, K` and :math:`V = I`, every other token converges to it: a single cluster
at :math:`x_1(0)`. The experiment follows causal SoftMax (``kind="causal"``, ``n_iters=1``) and its
Sinkformer counterpart, causal Sinkhorn attention (every prefix balanced on its own,
``sinkformer.attention(..., is_causal=True, n_iters=3)``; ``docs/theory.md`` §3.7, §16.3), for random
Gaussian :math:`Q, K`, and measures the distance of every token to :math:`x_1(0)`.
"""

from __future__ import annotations

import math

import torch

from ...dynamics import simulate
from ...dynamics.clustering import RADIUS
from ...dynamics.phase import random_weights, uniform_on_sphere
from ...plotting import pyplot
from ...runs import Run, register

__all__ = ["compute", "figure", "run"]

ATTENTIONS = {"causal SoftMax": 1, "causal Sinkhorn": 3}  # label -> n_iters of kind="causal"


def compute(cfg: dict) -> dict:
    """Distances to the first token over time, ``(T, betas, systems, tokens)``, per attention."""
    betas = torch.tensor(cfg["betas"], dtype=torch.float64)
    B, S, n, d = len(betas), cfg["n_systems"], cfg["n_tokens"], cfg["d"]
    gen = torch.Generator().manual_seed(cfg["seed"])
    x0 = uniform_on_sphere((B, S, n), d, generator=gen, dtype=torch.float64)
    Q, K, V = random_weights("gaussian", (1, S), d, value_identity=True, generator=gen, dtype=torch.float64)
    params = (betas.reshape(B, 1, 1, 1) * Q, K, V)
    steps = math.ceil(cfg["t1"] / cfg["dt"])
    out = {}
    for label, n_iters in ATTENTIONS.items():
        traj = simulate(x0, params, t1=steps * cfg["dt"], steps=steps, kind="causal", n_iters=n_iters,
                        geometry="sphere", record_every=cfg["record_every"])
        first = x0[..., :1, :]
        out[label] = {"times": traj.times, "distance": (traj.positions - first).norm(dim=-1),
                      "first_moved": float((traj.positions[..., 0, :] - x0[..., 0, :]).norm(dim=-1).max())}
    return out


def summarise(results: dict, cfg: dict) -> dict:
    summary = {}
    for label, r in results.items():
        dist = r["distance"]  # (T, B, S, n)
        worst = dist.amax(-1)  # (T, B, S): the farthest token of each system
        single = (worst <= RADIUS).double().mean(-1)  # (T, B)
        summary[label] = {
            "first_token_moved": r["first_moved"],
            "single_cluster_final": single[-1].tolist(),
            "median_worst_distance_final": worst[-1].median(-1).values.tolist(),
            "max_worst_distance_final": worst[-1].amax(-1).tolist(),
        }
    return summary


def figure(results: dict, cfg: dict):
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    colors = plt.get_cmap("viridis")(torch.linspace(0.1, 0.8, len(cfg["betas"])).numpy())
    styles = dict(zip(results, ("-", "--")))
    for label, r in results.items():
        t = r["times"].numpy()
        worst = r["distance"].amax(-1)
        for b, beta in enumerate(cfg["betas"]):
            axes[0].plot(t, worst[:, b].median(-1).values.numpy(), styles[label], color=colors[b],
                         label=f"{label}, β = {beta:g}")
            axes[1].plot(t, (worst[:, b] <= RADIUS).double().mean(-1).numpy(), styles[label], color=colors[b])
        # when does token k join the first one (first recorded time within the radius), at the largest beta
        joined = r["distance"][:, -1] <= RADIUS  # (T, S, n)
        first_time = torch.where(joined.any(0), r["times"][joined.double().argmax(0)], torch.nan)  # (S, n)
        axes[2].plot(range(1, cfg["n_tokens"] + 1), torch.nanmean(first_time, 0).numpy(), styles[label] + "o", ms=3,
                     color="k" if label.endswith("SoftMax") else "tab:orange", label=label)
    axes[0].set(yscale="log", xlabel="t", ylabel="max_k |x_k(t) − x_1(0)| (median over systems)",
                title="distance of the farthest token to the first")
    axes[0].axhline(RADIUS, color="gray", lw=0.8, ls=":")
    axes[0].legend(fontsize=7)
    axes[1].set(xlabel="t", ylabel="fraction of systems", ylim=(-0.03, 1.03),
                title=f"every token within {RADIUS:g} of x_1(0)")
    axes[2].set(xlabel="token k", ylabel="time to come within 0.1 of x_1(0) (mean)",
                title=f"when token k joins the first (β = {cfg['betas'][-1]:g})")
    axes[2].legend(fontsize=8)
    fig.suptitle(f"Causal attention on S^{cfg['d'] - 1}: {cfg['n_tokens']} tokens, {cfg['n_systems']} systems per β, "
                 "random Gaussian Q, K, V = I")
    fig.tight_layout()
    return fig


@register(
    "causal-clustering",
    description="Causal SoftMax and causal Sinkhorn attention on the sphere: every token converges to the first",
    paper="Karagodin, Polyanskiy, Rigollet, Clustering in causal attention masking",
    quick_minutes=0.4,
    full_minutes=10.0,
    defaults={"betas": [1.0, 4.0], "n_systems": 24, "n_tokens": 32, "d": 3, "t1": 60.0, "dt": 0.1,
              "record_every": 5, "seed": 0},
    full={"betas": [1.0, 4.0, 9.0], "n_systems": 256, "t1": 200.0},
)
def run(ctx: Run) -> None:
    cfg = ctx.config
    results = compute(cfg)
    summary = summarise(results, cfg)
    for label, row in summary.items():
        ctx.log(attention=label, **{k: str(v) for k, v in row.items()})
    ctx.save_figure(figure(results, cfg), "causal_clustering")
    ctx.results.update(summary)
    rows = "\n".join(
        f"| {label} | {beta:g} | {row['single_cluster_final'][b]:.2f} | {row['median_worst_distance_final'][b]:.1e} | "
        f"{row['max_worst_distance_final'][b]:.1e} | {row['first_token_moved']:.0e} |"
        for label, row in summary.items() for b, beta in enumerate(cfg["betas"])
    )
    ctx.write_report(f"""# Clustering in causal attention

![causal clustering](causal_clustering.png)

| attention | β | fraction of systems in one cluster at x_1(0) at t = {cfg['t1']:g} | farthest token's distance to x_1(0) (median) | (max over systems) | largest move of token 1 |
|---|---|---|---|---|---|
{rows}

**Paper.** Karagodin, Polyanskiy and Rigollet prove that causally masked self-attention on the sphere
with V = I and any Q, K converges to a single cluster: token 1 does not move and the others converge
to it. Near-parking configurations can delay it (metastable states).

**This run.** {cfg['n_systems']} systems per β of {cfg['n_tokens']} tokens uniform on S^{cfg['d'] - 1}, random
Gaussian Q and K (entries N(0, 1/d)), V = I, Euler step {cfg['dt']:g} to t = {cfg['t1']:g}. Token 1's
largest displacement (last column) is the rounding error of the renormalisation: it does not move, for
SoftMax and for causal Sinkhorn attention alike (row 1 of every prefix-balanced problem is [1]). The
distance of the farthest token to x_1(0) (left panel; median over systems) and the fraction of systems
within {RADIUS:g} of it (middle) measure the convergence; the right panel shows when each token k first comes
within {RADIUS:g} of the first token (mean over the systems where it does, at the largest β).
""")
