r"""Castin et al., Figure 1: the Riccati covariance of Softmax attention on Gaussians (d = 1, 2).

With :math:`V = I` and symmetric :math:`A`, a Gaussian stays Gaussian and
:math:`\Sigma(t) = (\Sigma_0^{-1} - 2tA)^{-1}` (``docs/theory.md`` §8): if :math:`A \prec 0` the covariance shrinks to
0 (the tokens cluster), if :math:`A` has a positive eigenvalue the largest eigenvalue blows up at
:math:`t^* = 1/(2\lambda_{\max}(\Sigma_0^{1/2}A\Sigma_0^{1/2}))`. Each case is computed three ways: the closed
form, the moment ODE integrated by :func:`sinkformer.dynamics.gaussian.flow` (RK4), and ``N`` particles
of the attention flow (RK4), whose empirical covariance must follow both.
"""

from __future__ import annotations

import math

import torch

from ...dynamics import gaussian as G
from ...dynamics import simulate
from ...plotting import pyplot
from ...runs import Run, register

__all__ = ["CASES", "compute", "figure", "run"]

D64 = torch.float64

#: name -> (A, Sigma0, horizon as a fraction of t* or an absolute time)
CASES = {
    "d=1, A<0": (torch.tensor([[-1.0]], dtype=D64), torch.tensor([[1.0]], dtype=D64)),
    "d=1, A>0": (torch.tensor([[1.0]], dtype=D64), torch.tensor([[1.0]], dtype=D64)),
    "d=2, A<0": (torch.tensor([[-1.0, 0.3], [0.3, -0.4]], dtype=D64), torch.tensor([[1.0, 0.5], [0.5, 0.8]], dtype=D64)),
    "d=2, A indefinite": (torch.tensor([[0.6, 0.3], [0.3, -0.8]], dtype=D64),
                          torch.tensor([[1.0, -0.4], [-0.4, 0.6]], dtype=D64)),
}


def compute(case: str, n_particles: int, steps: int, seed: int, horizon: float = 3.0) -> dict:
    """Closed form, ODE and particles for one case; time runs to 0.9 t* (blow-up) or ``horizon``."""
    A, cov0 = CASES[case]
    d = A.shape[0]
    eye = torch.eye(d, dtype=D64)
    mean0 = torch.full((d,), 0.5, dtype=D64)
    t_star = G.blowup_time(cov0, A)
    t1 = 0.9 * t_star if math.isfinite(t_star) else horizon
    times = torch.linspace(0, t1, steps + 1, dtype=D64)
    closed = G.riccati(cov0, A, times)
    ode = G.flow("softmax", mean0, cov0, (A, eye, eye), t1=t1, steps=20 * steps, record_every=20)
    gen = torch.Generator().manual_seed(seed)
    x0 = mean0 + torch.randn(n_particles, d, dtype=D64, generator=gen) @ torch.linalg.cholesky(cov0).T
    traj = simulate(x0.float(), (A.float(), eye.float(), eye.float()), t1=t1, steps=steps, method="rk4")
    emp = torch.stack([torch.cov(x.double().T, correction=0).reshape(d, d) for x in traj.positions])
    detected = G.flow("softmax", mean0, cov0, (A, eye, eye), t1=2 * t1, steps=40 * steps).blowup_time
    return {
        "times": times, "closed": closed, "ode": ode.cov, "particles": emp, "snapshots": traj.positions,
        "t_star": t_star, "detected_blowup": float(detected),
        "ode_vs_closed": max(float((o - c).norm() / c.norm()) for o, c in zip(ode.cov, closed)),
        "particles_vs_closed": float((emp[-1] - closed[-1]).norm() / closed[-1].norm()),
        "particles_vs_closed_half": float((emp[steps // 2] - closed[steps // 2]).norm() / closed[steps // 2].norm()),
        "eig_final": torch.linalg.eigvalsh(closed[-1]).tolist(),
    }


def _ellipse(cov: torch.Tensor, center: torch.Tensor, k: float = 2.0):
    theta = torch.linspace(0, 2 * math.pi, 100, dtype=D64)
    circle = torch.stack([theta.cos(), theta.sin()], 1)
    lam, U = torch.linalg.eigh(cov)
    return (center + k * circle @ (U * lam.clamp_min(0).sqrt()).T).numpy()


def figure(results: dict):
    plt = pyplot()
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    colors = ["tab:blue", "tab:orange"]
    for row, (one, two) in enumerate((("d=1, A<0", "d=2, A<0"), ("d=1, A>0", "d=2, A indefinite"))):
        r1, r2 = results[one], results[two]
        ax = axes[row, 0]
        t = r1["times"].numpy()
        ax.plot(t, r1["closed"][:, 0, 0].numpy(), "k-", lw=2, label="closed form")
        ax.plot(t[::10], r1["ode"][::10, 0, 0].numpy(), "o", mfc="none", color="tab:red", label="ODE (RK4)")
        ax.plot(t[::5], r1["particles"][::5, 0, 0].numpy(), ".", color="tab:blue", label="particles")
        if math.isfinite(r1["t_star"]):
            ax.axvline(r1["t_star"], color="gray", ls="--", label=f"t* = {r1['t_star']:.3g}")
        ax.set_yscale("log")
        ax.set(xlabel="t", ylabel="variance", title=f"{one}: " + ("σ → 0" if row == 0 else "finite-time blow-up"))
        ax.legend(fontsize=8)
        ax = axes[row, 1]
        t = r2["times"].numpy()
        lam_c = torch.linalg.eigvalsh(r2["closed"]).numpy()
        lam_o = torch.linalg.eigvalsh(r2["ode"]).numpy()
        lam_p = torch.linalg.eigvalsh(r2["particles"]).numpy()
        for i in range(2):
            ax.plot(t, lam_c[:, i], "-", color=colors[i], lw=2, label=f"λ{i + 1} closed form")
            ax.plot(t[::10], lam_o[::10, i], "o", mfc="none", color=colors[i])
            ax.plot(t[::5], lam_p[::5, i], ".", color=colors[i])
        if math.isfinite(r2["t_star"]):
            ax.axvline(r2["t_star"], color="gray", ls="--", label=f"t* = {r2['t_star']:.3g}")
        ax.set_yscale("log")
        ax.set(xlabel="t", ylabel="eigenvalues of Σ(t)", title=f"{two}: lines closed form, ○ ODE, · particles")
        ax.legend(fontsize=8)
        ax = axes[row, 2]
        snaps, T = r2["snapshots"], len(r2["times"]) - 1
        for idx, c in zip((0, T // 2, T), ("tab:gray", "tab:green", "tab:purple")):
            pts = snaps[idx].double()
            ax.scatter(pts[:, 0].numpy(), pts[:, 1].numpy(), s=2, color=c, alpha=0.25)
            ell = _ellipse(r2["closed"][idx], pts.mean(0))
            ax.plot(ell[:, 0], ell[:, 1], color=c, lw=2, label=f"t = {float(r2['times'][idx]):.2f}")
        ax.set_aspect("equal", adjustable="datalim")
        ax.set(title=f"{two}: particles and 2σ ellipses of Σ(t)")
        ax.legend(fontsize=8, loc="upper right")
    fig.suptitle("Softmax attention on Gaussians, V = I: Σ(t) = (Σ₀⁻¹ − 2tA)⁻¹ (Castin et al., Figure 1)")
    fig.tight_layout()
    return fig


@register(
    "riccati",
    description="Riccati covariance of Softmax attention: closed form vs ODE vs particles, clustering vs blow-up",
    paper="Castin et al. 2025, Figure 1",
    quick_minutes=0.12,
    full_minutes=5.0,
    defaults={"n_particles": 1000, "steps": 50, "seed": 0},
    full={"n_particles": 20000, "steps": 100},
)
def run(ctx: Run) -> None:
    cfg = ctx.config
    results = {case: compute(case, cfg["n_particles"], cfg["steps"], cfg["seed"]) for case in CASES}
    for case, r in results.items():
        ctx.log(case=case, t_star=r["t_star"], detected_blowup=r["detected_blowup"], ode_vs_closed=r["ode_vs_closed"],
                particles_vs_closed_half=r["particles_vs_closed_half"], particles_vs_closed=r["particles_vs_closed"])
    ctx.save_figure(figure(results), "riccati")
    keys = ("t_star", "detected_blowup", "ode_vs_closed", "particles_vs_closed_half", "particles_vs_closed", "eig_final")
    ctx.results.update({case: {k: r[k] for k in keys} for case, r in results.items()})
    rows = "\n".join(
        f"| {case} | {r['t_star']:.6g} | {r['detected_blowup']:.6g} | {r['ode_vs_closed']:.1e} | "
        f"{r['particles_vs_closed_half']:.1e} | {r['particles_vs_closed']:.1e} |" for case, r in results.items()
    )
    ctx.write_report(f"""# Riccati covariance of Softmax attention (Castin et al., Figure 1)

![Riccati](riccati.png)

| case | t* (closed form) | blow-up detected by the ODE integrator | ODE vs closed form (max rel.) | particles vs closed form, half-way | particles vs closed form, end |
|---|---|---|---|---|---|
{rows}

**Paper.** For V = I the covariance solves a Riccati equation with closed form
Σ(t) = (Σ₀⁻¹ − 2tA)⁻¹: if A ≺ 0 the solution is global and Σ(t) → 0 (tokens cluster); if A has a
positive eigenvalue the largest eigenvalue of Σ blows up in finite time t*.

**This run.** Same two behaviours in d = 1 and d = 2 (Σ₀ and A do not commute in d = 2). The RK4
integrator of the moment ODE agrees with the closed form to the rounding level, and detects the
blow-up within one step of t* (columns 2–4). {cfg['n_particles']} particles (RK4, float32; the relative
errors are those of the empirical covariance) follow the closed form up to Monte-Carlo error while
the tilted measures stay well sampled: in the convergent cases to the end, in the blow-up cases
half-way. Close to t* they lag behind: the Softmax weights exp(⟨Ax, y⟩) of a query in the tail
need keys further out than {cfg['n_particles']} samples reach (the self-normalised importance error grows
like exp(xᵀAΣAx/2), `docs/theory.md` §13), and a finite particle system cannot
blow up in finite time at all. The mean-field limit holds on [0, T] for every T < t*, not
uniformly up to t*.
""")
