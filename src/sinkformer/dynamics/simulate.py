r"""Particle flows :math:`\dot x_i = \Gamma_{\mu_t}(x_i)`, :math:`\mu_t = \sum_i w_i\delta_{x_i(t)}` (``docs/theory.md`` §5).

:func:`simulate` integrates the attention flow of :func:`~sinkformer.dynamics.velocity` with
explicit Euler or classical RK4; :func:`integrate` does the same for any right-hand side
``rhs(t, x)``. Euler with step 1 is a stack of residual attention layers
:math:`x \leftarrow x + \Gamma_\mu(x)` with tied (or, for a callable ``params``, per-layer) weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .._validation import check_choice, check_positive_int, check_tensor
from .params import Params
from .velocity import velocity

__all__ = ["Trajectory", "ParticleField", "simulate", "integrate", "METHODS"]

METHODS = ("euler", "rk4")


@dataclass
class Trajectory:
    """A recorded particle flow.

    Attributes:
        times: ``(T,)`` recorded times.
        positions: ``(T, ..., N, d)`` particle positions at those times.
        energies: ``(T, ...)`` the ``energy`` callable evaluated at those times, or ``None``.
    """

    times: Tensor
    positions: Tensor
    energies: Tensor | None = None

    @property
    def final(self) -> Tensor:
        """``(..., N, d)`` positions at the last recorded time."""
        return self.positions[-1]


class ParticleField:
    """``rhs(t, x) = velocity(x, params(t), kind, ...)``, remembering the Sinkhorn potential.

    Each Sinkhorn solve starts from the potential of the previous evaluation (warm start): along a
    flow this saves the normalisations that bring the potential from scratch to the previous
    solution (for 10,000 particles of the heat-flow Sinkformer, 8 instead of 15 per step).
    """

    def __init__(self, params: Params | Callable[[float], Params], kind: str = "softmax", **velocity_kwargs):
        self.params = params
        self.kind = kind
        self.kwargs = velocity_kwargs
        self.potential: Tensor | None = None
        self.sinkhorn_iters = 0  # total normalisations run, for benchmarks

    def __call__(self, t: float, x: Tensor) -> Tensor:
        params = self.params(t) if callable(self.params) else self.params
        if self.kind != "sinkhorn":
            return velocity(x, params, self.kind, **self.kwargs)
        result = velocity(x, params, "sinkhorn", warm_start=self.potential, return_result=True, **self.kwargs)
        self.potential = result.potential
        self.sinkhorn_iters += result.sinkhorn_iters
        return result.field


def integrate(
    rhs: Callable[[float, Tensor], Tensor],
    x0: Tensor,
    t1: float,
    steps: int,
    *,
    method: str = "euler",
    t0: float = 0.0,
    record_every: int = 1,
    energy: Callable[[Tensor], Tensor] | None = None,
) -> Trajectory:
    """Integrate :math:`\\dot x = \\mathrm{rhs}(t, x)` from ``t0`` to ``t1`` in ``steps`` fixed steps.

    Args:
        rhs: the velocity, ``rhs(t, x) -> (same shape as x)``.
        x0: initial state.
        method: ``"euler"`` (:math:`x \\leftarrow x + h\\,\\mathrm{rhs}`) or ``"rk4"`` (classical Runge–Kutta).
        record_every: record every this many steps (the first and last states are always recorded).
        energy: optional ``energy(x)`` recorded with the positions.
    """
    check_tensor(x0, "x0", floating=True)
    check_positive_int(steps, "steps")
    check_positive_int(record_every, "record_every")
    check_choice(method, "method", METHODS)
    h = (t1 - t0) / steps
    x = x0
    times, states, energies = [], [], []

    def record(t: float, x: Tensor) -> None:
        times.append(t)
        states.append(x)
        if energy is not None:
            energies.append(torch.as_tensor(energy(x)))

    record(t0, x)
    for step in range(steps):
        t = t0 + step * h
        if method == "euler":
            x = x + h * rhs(t, x)
        else:
            k1 = rhs(t, x)
            k2 = rhs(t + h / 2, x + (h / 2) * k1)
            k3 = rhs(t + h / 2, x + (h / 2) * k2)
            k4 = rhs(t + h, x + h * k3)
            x = x + (h / 6) * (k1 + 2 * k2 + 2 * k3 + k4)
        if (step + 1) % record_every == 0 or step + 1 == steps:
            record(t0 + (step + 1) * h, x)
    return Trajectory(
        torch.tensor(times, dtype=torch.float64),
        torch.stack(states),
        torch.stack(energies) if energy is not None else None,
    )


def simulate(
    x0: Tensor,
    params: Params | Callable[[float], Params],
    t1: float,
    steps: int,
    method: str = "euler",
    kind: str = "softmax",
    *,
    weights: Tensor | None = None,
    record_every: int = 1,
    energy: Callable[[Tensor], Tensor] | None = None,
    t0: float = 0.0,
    **velocity_kwargs,
) -> Trajectory:
    """Simulate the particle system :math:`\\dot x_i = \\Gamma_{\\mu_t}(x_i)` of attention ``kind``.

    Args:
        x0: ``(..., N, d)`` initial particles (leading dimensions: independent clouds).
        params: ``(Q, K, V)``, a list of head triples, or a callable ``t -> params`` (time-dependent layers).
        t1, steps, method, record_every, energy, t0: as in :func:`integrate`.
        kind, weights: as in :func:`~sinkformer.dynamics.velocity`; the weights travel with the particles.
        **velocity_kwargs: ``eps``, ``token_positions``, ``tol``, ``max_iters``, ``chunk_size`` of
            :func:`~sinkformer.dynamics.velocity`.

    Returns:
        A :class:`Trajectory`.

    Example:
        >>> Q = K = V = torch.eye(2)
        >>> traj = simulate(torch.randn(100, 2), (Q, K, -V), t1=1.0, steps=10, kind="sinkhorn")
        >>> traj.positions.shape
        torch.Size([11, 100, 2])
    """
    field = ParticleField(params, kind, weights=weights, **velocity_kwargs)
    return integrate(field, x0, t1, steps, method=method, t0=t0, record_every=record_every, energy=energy)
