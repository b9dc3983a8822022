"""The linear solve of the implicit backward, shared by every engine that offers ``backward="implicit"``."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["implicit_duals"]


def implicit_duals(Pv, Ptv, r: Tensor, c: Tensor, *, tol: float, max_iters: int = 1000) -> tuple[Tensor, Tensor]:
    """Solve ``[diag(a) P; P^T diag(b)] [alpha; beta] = [r; c]`` by Jacobi-preconditioned conjugate
    gradients, given only the products ``Pv(y) = P y`` and ``Ptv(x) = P^T x`` (``a = P 1``, ``b = P^T 1``:
    the matrix's actual row and column sums) — the duals of the implicit backward of every engine.

    ``r``: ``(..., n)``, ``c``: ``(..., m)``. Stops at a relative residual ``tol`` (engines pass 1e-10
    in float64, 1e-6 in float32: asking float32 for less runs past its rounding floor, and the drift
    costs 0.1-10 % of the gradient) or after ``max_iters`` steps.
    """
    a, b = Pv(torch.ones_like(c)), Ptv(torch.ones_like(r))
    pa, pb = torch.where(a > 0, 1 / a, torch.ones_like(a)), torch.where(b > 0, 1 / b, torch.ones_like(b))
    x, y = torch.zeros_like(r), torch.zeros_like(c)
    rx, ry = r.clone(), c.clone()
    zx, zy = pa * rx, pb * ry
    px, py = zx.clone(), zy.clone()
    rz = (rx * zx).sum(-1) + (ry * zy).sum(-1)
    norm0 = torch.sqrt((r.square().sum(-1) + c.square().sum(-1))).clamp_min(1e-30)
    for _ in range(max_iters):
        hx, hy = a * px + Pv(py), Ptv(px) + b * py
        curvature = (px * hx).sum(-1) + (py * hy).sum(-1)
        step = torch.where(curvature > 0, rz / curvature, torch.zeros_like(rz))
        x, y = x + step.unsqueeze(-1) * px, y + step.unsqueeze(-1) * py
        rx, ry = rx - step.unsqueeze(-1) * hx, ry - step.unsqueeze(-1) * hy
        if bool((torch.sqrt(rx.square().sum(-1) + ry.square().sum(-1)) / norm0).max() <= tol):
            break
        zx, zy = pa * rx, pb * ry
        rz_new = (rx * zx).sum(-1) + (ry * zy).sum(-1)
        beta = torch.where(rz > 0, rz_new / rz, torch.zeros_like(rz))
        px, py = zx + beta.unsqueeze(-1) * px, zy + beta.unsqueeze(-1) * py
        rz = rz_new
    return x, y
