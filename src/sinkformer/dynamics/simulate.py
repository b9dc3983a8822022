r"""Particle flows :math:`\dot x_i = \Gamma_{\mu_t}(x_i)`, :math:`\mu_t = \sum_i w_i\delta_{x_i(t)}` (``docs/theory.md`` §5, §16).

:func:`simulate` integrates the attention flow of :func:`~sinkformer.dynamics.velocity` with
explicit Euler or classical RK4; :func:`integrate` does the same for any right-hand side
``rhs(t, x)``. Euler with step 1 is a stack of residual attention layers
:math:`x \leftarrow x + \Gamma_\mu(x)` with tied (or, for a callable ``params``, per-layer) weights.
On the sphere (``geometry="sphere"``) the field is tangent and every step ends with the
renormalisation :math:`x \leftarrow x/|x|` (a residual layer followed by LayerNorm).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .._validation import check_choice, check_positive_int, check_tensor
from .params import Params
from .velocity import GEOMETRIES, on_sphere, velocity

__all__ = ["Trajectory", "ParticleField", "simulate", "integrate", "METHODS"]

METHODS = ("euler", "rk4")


@dataclass
class Trajectory:
    """A recorded particle flow.

    Attributes:
        times: ``(T,)`` recorded times.
        positions: ``(T, ..., N, d)`` particle positions at those times (``None`` when not kept).
        energies: ``(T, ...)`` the ``energy`` callable evaluated at those times, or ``None``.
        observed: name -> ``(T, ...)`` the values of the ``observe`` callable at those times.
        last: ``(..., N, d)`` positions at the last time.
    """

    times: Tensor
    positions: Tensor | None
    energies: Tensor | None = None
    observed: dict[str, Tensor] = field(default_factory=dict)
    last: Tensor | None = None

    @property
    def final(self) -> Tensor:
        """``(..., N, d)`` positions at the last recorded time."""
        return self.positions[-1] if self.last is None else self.last


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
    observe: Callable[[Tensor], dict[str, Tensor]] | None = None,
    keep_positions: bool = True,
    project: Callable[[Tensor], Tensor] | None = None,
) -> Trajectory:
    """Integrate :math:`\\dot x = \\mathrm{rhs}(t, x)` from ``t0`` to ``t1`` in ``steps`` fixed steps.

    Args:
        rhs: the velocity, ``rhs(t, x) -> (same shape as x)``.
        x0: initial state.
        method: ``"euler"`` (:math:`x \\leftarrow x + h\\,\\mathrm{rhs}`) or ``"rk4"`` (classical Runge–Kutta).
        record_every: record every this many steps (the first and last states are always recorded).
        energy: optional ``energy(x)`` recorded with the positions.
        observe: optional ``observe(x) -> {name: tensor}`` recorded at the same times (diagnostics of
            large batches whose positions are not kept).
        keep_positions: keep the recorded positions (``False``: only the last state, ``Trajectory.last``).
        project: applied to the state after every step (and to ``x0``), e.g. the renormalisation onto
            the sphere.
    """
    check_tensor(x0, "x0", floating=True)
    check_positive_int(steps, "steps")
    check_positive_int(record_every, "record_every")
    check_choice(method, "method", METHODS)
    h = (t1 - t0) / steps
    x = x0 if project is None else project(x0)
    times, states, energies, observed = [], [], [], {}

    def record(t: float, x: Tensor) -> None:
        times.append(t)
        if keep_positions:
            states.append(x)
        if energy is not None:
            energies.append(torch.as_tensor(energy(x)))
        for name, value in (observe(x) if observe is not None else {}).items():
            observed.setdefault(name, []).append(torch.as_tensor(value))

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
        if project is not None:
            x = project(x)
        if (step + 1) % record_every == 0 or step + 1 == steps:
            record(t0 + (step + 1) * h, x)
    return Trajectory(
        torch.tensor(times, dtype=torch.float64),
        torch.stack(states) if keep_positions else None,
        torch.stack(energies) if energy is not None else None,
        {name: torch.stack(values) for name, values in observed.items()},
        None if keep_positions else x,
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
    geometry: str = "euclidean",
    record_every: int = 1,
    energy: Callable[[Tensor], Tensor] | None = None,
    observe: Callable[[Tensor], dict[str, Tensor]] | None = None,
    keep_positions: bool = True,
    t0: float = 0.0,
    **velocity_kwargs,
) -> Trajectory:
    """Simulate the particle system :math:`\\dot x_i = \\Gamma_{\\mu_t}(x_i)` of attention ``kind``.

    Args:
        x0: ``(..., N, d)`` initial particles (leading dimensions: independent clouds).
        params: ``(Q, K, V)``, a list of head triples, or a callable ``t -> params`` (time-dependent layers);
            matrices may carry leading dimensions (one parameter set per cloud).
        t1, steps, method, record_every, energy, observe, keep_positions, t0: as in :func:`integrate`.
        kind, weights: as in :func:`~sinkformer.dynamics.velocity`; the weights travel with the particles.
        geometry: ``"euclidean"``, or ``"sphere"``: ``x0`` is projected on the unit sphere, the field is
            tangent (:math:`P^\\perp_x\\Gamma`) and each step ends with :math:`x \\leftarrow x/|x|`.
        **velocity_kwargs: ``eps``, ``token_positions``, ``n_iters``, ``tol``, ``max_iters``, ``chunk_size`` of
            :func:`~sinkformer.dynamics.velocity`.

    Returns:
        A :class:`Trajectory`.

    Example:
        >>> Q = K = V = torch.eye(2)
        >>> traj = simulate(torch.randn(100, 2), (Q, K, -V), t1=1.0, steps=10, kind="sinkhorn")
        >>> traj.positions.shape
        torch.Size([11, 100, 2])
    """
    check_choice(geometry, "geometry", GEOMETRIES)
    rhs = ParticleField(params, kind, weights=weights, geometry=geometry, **velocity_kwargs)
    return integrate(rhs, x0, t1, steps, method=method, t0=t0, record_every=record_every, energy=energy,
                     observe=observe, keep_positions=keep_positions,
                     project=on_sphere if geometry == "sphere" else None)
