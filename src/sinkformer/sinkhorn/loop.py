r"""The Sinkhorn loop and its reverse schedule, written once against the operators an engine supplies.

**Forward** (:func:`sinkhorn_loop`). Normalisation :math:`t` is a row update for odd :math:`t`,
:math:`f_t = \log a - \mathrm{LSE}_j(S + g_{t-1})`, and a column update for even :math:`t`,
:math:`g_t = \log b - \mathrm{LSE}_i(S + f_{t-1})` (0 on rows/columns without mass). With a fixed
``n_iters`` every matrix runs them all; with ``tol`` each matrix stops on its own after a row update
whose column error is ``<= tol`` (:class:`~.problem.Tolerance`), its potentials frozen from then on.
The engine supplies ``row_update(g, last) -> f`` and ``col_update(f, g) -> (g_new, error)``, where
``error`` is the column error of the plan :math:`e^{S + f\oplus g}` before the update (read only with
``tol``): the dense engine computes them on the whole matrix, the tiled engine on its cached tile
(log domain) or as scalings :math:`u = e^f`, :math:`v = e^g` in one fused pass per row update that
also sums the columns and, on the ``last`` one, writes the output; the streamed engine in one such
pass over row blocks; the flash engine with Triton sweeps in base 2.

**Reverse** (:func:`reverse_schedule`): the exact gradient of the ``n_iters`` map through the
potentials. With :math:`dF = \partial\ell/\partial f`, :math:`dG` of the final potentials, going back
from the last step :math:`T`: a row step has coefficient :math:`\gamma_t = dF/a` and passes
:math:`-R_t^\top\gamma_t` on to :math:`dG` (:math:`R_t = e^{S + f_t\oplus g_{t-1}}`, rows summing to
:math:`a`); a column step has :math:`\delta_t = dG/b` and passes :math:`-C_t\delta_t` on to :math:`dF`;
each step consumes its own dual. Steps past a matrix's count (``tol``) have coefficient 0. The
engine supplies ``row_step(t, gamma, dG) -> dG - R_t^T gamma`` and ``col_step(t, delta, dF) -> dF -
C_t delta`` and records the terms :math:`-\gamma_t\odot R_t`, :math:`-C_t\odot\delta_t` of
:math:`dS` its own way (on a tile, or as coefficients its kernels fold).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .problem import Tolerance

__all__ = ["Iterates", "sinkhorn_loop", "reverse_schedule"]


@dataclass
class Iterates:
    """What :func:`sinkhorn_loop` ran: ``fs = [f_1, f_3, ..]`` (after each row update), ``gs = [g_0,
    g_2, ..]`` (the start, then after each column update), ``counts (...)`` int64 normalisations per
    matrix, and the :class:`~.problem.Tolerance` (``None`` with a fixed ``n_iters``) for its warning."""

    fs: list[Tensor]
    gs: list[Tensor]
    counts: Tensor
    stop: Tolerance | None


def sinkhorn_loop(
    row_update: Callable[[Tensor | None, bool], Tensor],
    col_update: Callable[[Tensor, Tensor], tuple[Tensor, Tensor | None]],
    g0: Tensor | Callable[[], Tensor],
    *,
    n_iters: int | None,
    tol: float | None = None,
    max_iters: int = 1000,
    engine: str = "dense",
    symmetric: bool = False,
) -> Iterates:
    """Alternate ``row_update`` and ``col_update`` from the column potential ``g0 (..., m)``: ``n_iters``
    normalisations, or with ``tol`` until each matrix's column error after a row update is ``<= tol``
    (at most ``max_iters`` normalisations).

    ``row_update(g, last)`` returns the row potential; ``last`` is True on the final normalisation of
    a fixed count, so an engine whose row pass is fused with its output writes the output there.
    ``col_update(f, g)`` returns the new column potential and the column error ``(...)`` of
    :math:`e^{S + f\\oplus g}` (may be ``None`` when ``tol`` is ``None``); an engine whose row pass
    also sums the columns keeps those sums for it. ``g0`` may be a function, read after the first
    row update, for an engine whose first pass picks its own shifts (``row_update`` then gets
    ``None``). ``symmetric``: ``col_update`` is the averaged update of the streamed engine and only
    row updates count as normalisations (a fixed count runs ``n_iters`` row updates)."""
    fixed = tol is None
    f = row_update(g0 if isinstance(g0, Tensor) else None, fixed and n_iters == 1)
    fs, gs = [f], [g0 if isinstance(g0, Tensor) else g0()]
    batch, done = tuple(f.shape[:-1]), 1
    stop = None if fixed else Tolerance(tol, max_iters, batch, f.device, engine, step=1 if symmetric else 2)
    while not fixed or done < n_iters:
        g, error = col_update(fs[-1], gs[-1])
        if stop is not None and stop.check(error, done):
            break
        gs.append(g if fixed else torch.where(stop.active.unsqueeze(-1), g, gs[-1]))
        done += 0 if symmetric else 1
        if fixed and done >= n_iters:
            break
        f = row_update(gs[-1], fixed and done + 1 >= n_iters)
        fs.append(f if fixed else torch.where(stop.active.unsqueeze(-1), f, fs[-1]))
        done += 1
    counts = stop.counts if stop is not None else torch.full(batch, n_iters, dtype=torch.int64, device=f.device)
    return Iterates(fs, gs, counts, stop)


def reverse_schedule(
    dF: Tensor,
    dG: Tensor,
    counts: Tensor,
    steps: int,
    inv_a: Tensor | float,
    inv_b: Tensor | float,
    row_step: Callable[[int, Tensor, Tensor], Tensor],
    col_step: Callable[[int, Tensor, Tensor], Tensor],
) -> None:
    """Run the reverse mode of :func:`sinkhorn_loop` from step ``steps`` down to 1, given the
    gradients ``dF (..., n)``, ``dG (..., m)`` of the final potentials and ``counts (...)`` of each
    matrix. ``inv_a``, ``inv_b``: :math:`1/a`, :math:`1/b` (0 where there is no mass). Step ``t`` calls
    ``row_step(t, gamma_t, dG)`` (odd) or ``col_step(t, delta_t, dF)`` (even), which record the step's
    term of :math:`dS` and return the other side's dual with the step's contribution passed on."""
    for t in range(steps, 0, -1):
        act = (counts >= t).unsqueeze(-1)
        if t % 2:
            gamma = torch.where(act, dF * inv_a, torch.zeros_like(dF))
            dG = row_step(t, gamma, dG)
            dF = torch.where(act, torch.zeros_like(dF), dF)
        else:
            delta = torch.where(act, dG * inv_b, torch.zeros_like(dG))
            dF = col_step(t, delta, dF)
            dG = torch.where(act, torch.zeros_like(dG), dG)
