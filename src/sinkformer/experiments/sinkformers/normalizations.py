r"""Figure 1 of the Sinkformers paper: K⁰, K¹ (SoftMax) and K^∞ (Sinkhorn) on two point clouds.

Two clouds of 10 points in the plane, queries :math:`W_Q x_i` and keys :math:`W_K x_j`, give
:math:`C_{ij} = \langle W_Q x_i, W_K x_j\rangle` and

* :math:`K^0 = e^{C}` — one interaction dominates;
* :math:`K^1 = \mathrm{SoftMax}(C)` — each query looks at its best keys, one key cluster is ignored;
* :math:`K^\infty = \mathrm{Sinkhorn}(C)` — doubly stochastic, every key takes part.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ...plotting import pyplot, save_png
from ...runs import Run, register
from ...sinkhorn import sinkhorn
from ._common import finding

__all__ = [
    "NormalizationsResult", "compute", "format_table", "figure", "plot", "run", "link_styles",
    "LINK_THRESHOLD", "LINK_WIDTH", "LINK_ALPHA",
]

#: Links below this weight are not drawn (as in the paper's figure).
LINK_THRESHOLD = 1e-12


@dataclass
class NormalizationsResult:
    queries: torch.Tensor  # (n, 2)
    keys: torch.Tensor  # (n, 2)
    matrices: dict[str, torch.Tensor]  # "K0", "K1", "Kinf" -> (n, n), float64
    sinkhorn_iters: int

    def summary(self) -> list[dict[str, float | str | int]]:
        """Per matrix: row/column sum ranges, entropy of K/sum(K) (nats), links >= 1e-12."""
        rows = []
        for name, K in self.matrices.items():
            r, c = K.sum(1), K.sum(0)
            p = K / K.sum()
            entropy = -(p * torch.log(p.clamp_min(1e-300))).sum().item()
            rows.append(
                {
                    "matrix": name,
                    "row_sum_min": r.min().item(),
                    "row_sum_max": r.max().item(),
                    "col_sum_min": c.min().item(),
                    "col_sum_max": c.max().item(),
                    "entropy": entropy,
                    "links": int((K >= LINK_THRESHOLD).sum()),
                    "keys_used": int(((K >= LINK_THRESHOLD).any(0)).sum()),
                }
            )
        return rows


def compute(n_points: int = 10, seed: int = 0) -> NormalizationsResult:
    """Build the two clouds and the three matrices (float64).

    Queries sit around (3, 3); keys form two clusters, one aligned with the queries (large
    :math:`q\\cdot k`) and one opposite, so that SoftMax gives the second cluster weights far
    below 1e-12 while Sinkhorn must give every key column mass 1.
    """
    gen = torch.Generator().manual_seed(seed)
    noise = lambda m: 0.35 * torch.randn(m, 2, generator=gen, dtype=torch.float64)  # noqa: E731
    queries = torch.tensor([3.0, 3.0], dtype=torch.float64) + noise(n_points)
    half = n_points // 2
    keys = torch.cat(
        [
            torch.tensor([3.0, 3.0], dtype=torch.float64) + noise(half),
            torch.tensor([-5.0, -2.5], dtype=torch.float64) + noise(n_points - half),
        ]
    )
    C = queries @ keys.T
    result = sinkhorn(C, None, tol=1e-12, max_iters=100_000, return_result=True)
    matrices = {"K0": torch.exp(C), "K1": sinkhorn(C, 1), "Kinf": result.matrix}
    return NormalizationsResult(queries, keys, matrices, result.n_iters)


def format_table(result: NormalizationsResult) -> str:
    """A plain-text table of the summary, for terminals and reports."""
    header = f"{'matrix':<7}{'row sums':>26}{'column sums':>26}{'entropy':>10}{'links':>7}{'keys used':>11}"
    lines = [header, "-" * len(header)]
    for row in result.summary():
        rs = f"{row['row_sum_min']:.4g} .. {row['row_sum_max']:.4g}"
        cs = f"{row['col_sum_min']:.4g} .. {row['col_sum_max']:.4g}"
        lines.append(
            f"{row['matrix']:<7}{rs:>26}{cs:>26}{row['entropy']:>10.3f}{row['links']:>7}{row['keys_used']:>11}"
        )
    return "\n".join(lines)


#: Line width (points) and opacity of a link, from the faintest (K_ij -> 0) to the panel's largest entry.
#: Both are linear in K_ij / max K of the panel; the floors keep every link >= LINK_THRESHOLD visible.
LINK_WIDTH = (0.35, 2.2)
LINK_ALPHA = (0.18, 0.7)
LINK_COLOR = "#1f3b73"


def link_styles(K: torch.Tensor) -> tuple[list[tuple[int, int]], list[float], list[float]]:
    """The links of ``K`` drawn in the figure, lightest first: ``(pairs, widths, alphas)``.

    Every entry ``K_ij >= LINK_THRESHOLD`` is a link; its width and opacity are linear in
    ``K_ij / max K`` (per panel) between the floors and ceilings of :data:`LINK_WIDTH` and
    :data:`LINK_ALPHA`, so every panel uses the same scale relative to its own largest entry.
    """
    W = (K / K.max()).clamp(0.0, 1.0)
    ii, jj = (K >= LINK_THRESHOLD).nonzero(as_tuple=True)
    order = W[ii, jj].argsort(stable=True)  # heavy links on top
    pairs = [(int(ii[o]), int(jj[o])) for o in order]
    w = [float(W[i, j]) for i, j in pairs]
    widths = [LINK_WIDTH[0] + (LINK_WIDTH[1] - LINK_WIDTH[0]) * x for x in w]
    alphas = [LINK_ALPHA[0] + (LINK_ALPHA[1] - LINK_ALPHA[0]) * x for x in w]
    return pairs, widths, alphas


def _draw_panel(ax, q, k, pairs, widths, alphas, marker_size: float) -> None:
    from matplotlib.collections import LineCollection
    from matplotlib.colors import to_rgba

    segments = [[(q[i, 0], q[i, 1]), (k[j, 0], k[j, 1])] for i, j in pairs]
    colors = [to_rgba(LINK_COLOR, a) for a in alphas]
    links = LineCollection(segments, linewidths=widths, colors=colors, capstyle="round", zorder=1)
    links.set_gid("links")
    ax.add_collection(links)
    ax.scatter(q[:, 0], q[:, 1], s=marker_size, color="tab:green", edgecolor="white", linewidth=0.5,
               label=r"queries $W_Q x_i$", zorder=3)
    ax.scatter(k[:, 0], k[:, 1], s=marker_size, color="tab:red", marker="s", edgecolor="white", linewidth=0.5,
               label=r"keys $W_K x_j$", zorder=3)


def figure(result: NormalizationsResult):
    """The three panels as a matplotlib figure.

    Each link ``K_ij >= 1e-12`` is a line whose width and opacity grow linearly with
    ``K_ij / max K`` of its panel (see :func:`link_styles`); an inset zooms on the cloud where
    the queries and the near keys overlap.
    """
    plt = pyplot()
    titles = {"K0": r"$K^0 = e^{C}$", "K1": r"$K^1$ = SoftMax$(C)$", "Kinf": r"$K^\infty$ = Sinkhorn$(C)$"}
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.9))
    q, k = result.queries.numpy(), result.keys.numpy()
    pts = torch.cat([result.queries, result.keys])
    lo, hi = pts.min(0).values.numpy(), pts.max(0).values.numpy()
    span = hi - lo
    # room in the lower right for the zoom inset (the links run along the other diagonal)
    xlim = (lo[0] - 0.06 * span[0], hi[0] + 0.06 * span[0])
    ylim = (lo[1] - 0.08 * span[1], hi[1] + 0.08 * span[1])
    near = torch.cat([result.queries, result.keys[(result.keys - result.queries.mean(0)).norm(dim=1) < 2.0]])
    zlo, zhi = near.min(0).values.numpy(), near.max(0).values.numpy()
    pad = 0.12 * float(max(zhi - zlo))
    for ax, (name, K) in zip(axes, result.matrices.items()):
        pairs, widths, alphas = link_styles(K)
        _draw_panel(ax, q, k, pairs, widths, alphas, marker_size=36)
        ax.set_xlim(*xlim)
        ax.set_ylim(*ylim)
        ax.set_aspect("equal")
        ax.set_xticks([])
        ax.set_yticks([])
        keys_used = int((K >= LINK_THRESHOLD).any(0).sum())
        ax.set_title(f"{titles[name]}\n{len(pairs)} links, {keys_used} of {K.shape[1]} keys reached, "
                     f"max $K_{{ij}}$ = {K.max().item():.3g}", fontsize=10.5)
        inset = ax.inset_axes([0.56, 0.03, 0.42, 0.42])
        _draw_panel(inset, q, k, pairs, widths, alphas, marker_size=22)
        inset.set_xlim(zlo[0] - pad, zhi[0] + pad)
        inset.set_ylim(zlo[1] - pad, zhi[1] + pad)
        inset.set_xticks([])
        inset.set_yticks([])
        inset.set_title("zoom", fontsize=8, pad=2)
        ax.indicate_inset_zoom(inset, edgecolor="0.4", alpha=0.8)
    axes[0].legend(loc="upper left", fontsize=8.5, framealpha=0.9)
    fig.suptitle(
        "Normalisations of the attention matrix, $C_{ij} = \\langle W_Q x_i, W_K x_j\\rangle$. Every link "
        "$K_{ij} \\geq$ 1e-12 is drawn;\nline width "
        f"({LINK_WIDTH[0]:g} to {LINK_WIDTH[1]:g} pt) and opacity ({LINK_ALPHA[0]:g} to {LINK_ALPHA[1]:g}) are "
        "linear in $K_{ij}$ / max $K$ of the panel, the same scale in all three panels",
        fontsize=11.5,
    )
    fig.tight_layout()
    return fig


def plot(result: NormalizationsResult, path: str | Path) -> Path:
    """Write :func:`figure` to a PNG at ``path``."""
    return save_png(figure(result), path)


@register(
    "normalizations",
    description="K0, K1 (SoftMax) and Kinf (Sinkhorn) on two point clouds",
    paper="Sinkformers, Figure 1",
    quick_minutes=0.01,
    defaults={"n_points": 10, "seed": 0},
)
def run(ctx: Run) -> None:
    result = compute(ctx.config["n_points"], ctx.config["seed"])
    rows = result.summary()
    for row in rows:
        ctx.log(**row)
    ctx.save_figure(figure(result), "normalizations")
    by_name = {row["matrix"]: row for row in rows}
    ctx.results.update(
        {
            "summary": rows,
            "sinkhorn_iterations": result.sinkhorn_iters,
            "softmax_keys_used": by_name["K1"]["keys_used"],
            "sinkhorn_keys_used": by_name["Kinf"]["keys_used"],
        }
    )
    n = ctx.config["n_points"]
    same = by_name["K1"]["keys_used"] < n and by_name["Kinf"]["keys_used"] == n
    verdict = (
        "Same picture as the paper: SoftMax ignores keys that Sinkhorn brings into play."
        if same
        else "Unlike the paper, SoftMax reaches every key in this configuration (try another seed)."
    )
    this_run = (
        f"K¹ gives links of at least 1e-12 to {by_name['K1']['keys_used']} of the {n} keys; K^∞ (doubly stochastic "
        f"after {result.sinkhorn_iters} normalisations, column sums {by_name['Kinf']['col_sum_min']:.6f} .. "
        f"{by_name['Kinf']['col_sum_max']:.6f}) links every query to {by_name['Kinf']['keys_used']} keys; entropies "
        f"{by_name['Kinf']['entropy']:.3f} (K^∞) vs {by_name['K1']['entropy']:.3f} (K¹) nats. {verdict}"
    )
    paper = ("For K⁰ one interaction dominates; for K¹ (SoftMax) one cluster is ignored; for K^∞ (Sinkhorn) all "
             "points are involved in an interaction.")
    ctx.write_report(
        f"""# Normalisations of the attention matrix (Sinkformers, Figure 1)

Two clouds of {n} points, queries W_Q x_i and keys W_K x_j, C_ij = ⟨W_Q x_i, W_K x_j⟩; line width ∝ K_ij,
links of at least 1e-12 drawn.

![K0, K1 and Kinf](normalizations.png)

```
{format_table(result)}
```

{finding(ctx, paper=paper, this_run=this_run)}"""
    )
