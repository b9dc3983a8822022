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

__all__ = ["NormalizationsResult", "compute", "format_table", "figure", "plot", "run", "LINK_THRESHOLD"]

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


def figure(result: NormalizationsResult):
    """The three panels (line width proportional to K_ij, links >= 1e-12) as a matplotlib figure."""
    plt = pyplot()
    titles = {"K0": r"$K^0$", "K1": r"$K^1$ (SoftMax)", "Kinf": r"$K^\infty$ (Sinkhorn)"}
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.4))
    q, k = result.queries.numpy(), result.keys.numpy()
    for ax, (name, K) in zip(axes, result.matrices.items()):
        W = (K / K.max()).numpy()
        for i, j in zip(*(K >= LINK_THRESHOLD).nonzero(as_tuple=True)):
            i, j = int(i), int(j)
            ax.plot([q[i, 0], k[j, 0]], [q[i, 1], k[j, 1]], color="0.25", lw=0.2 + 4.0 * W[i, j], alpha=0.8, zorder=1)
        ax.scatter(q[:, 0], q[:, 1], s=40, color="tab:green", label=r"$W_Q x_i$", zorder=2)
        ax.scatter(k[:, 0], k[:, 1], s=40, color="tab:red", label=r"$W_K x_j$", zorder=2)
        n_links = int((K >= LINK_THRESHOLD).sum())
        ax.set_title(f"{titles[name]} — {n_links} links")
        ax.set_aspect("equal")
        ax.set_xticks([])
        ax.set_yticks([])
    axes[0].legend(loc="lower right", fontsize=8)
    fig.suptitle("Normalisations of the attention matrix (line width ∝ $K_{ij}$, links ≥ 1e-12)")
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
