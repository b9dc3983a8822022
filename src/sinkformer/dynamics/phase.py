r"""Phase diagrams of attention on the sphere: many systems, one tensor program (``docs/theory.md`` §16.6).

Geshkovski et al. (*A mathematical perspective on Transformers*) draw the probability that
:math:`n` tokens, uniform on :math:`S^{d-1}` at :math:`t=0`, form a single cluster at time :math:`t`, over a
grid of inverse temperatures :math:`\beta`. :func:`phase_diagram` simulates every system of every
:math:`\beta` at once — ``len(betas) x n_systems`` clouds are the batch of one
:func:`~sinkformer.dynamics.simulate` call, :math:`\beta` folded into each system's :math:`Q` — and records
only the diagnostics of :mod:`.clustering` (never the positions), so the memory is that of one
state. It runs wherever its tensors live (``device="cuda"`` on a GPU).

Weights are drawn by :func:`random_weights` (``"identity"``, ``"gaussian"``, ``"goe"``), the same for
every :math:`\beta` (common random numbers), optionally redrawn every ``regenerate_every`` units of
time by :class:`LayerWeights` to mimic layers with their own parameters.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .._validation import check_choice, check_positive_int
from .clustering import RADIUS, diagnostics
from .simulate import simulate
from .velocity import on_sphere

__all__ = ["ENSEMBLES", "random_weights", "LayerWeights", "PhaseDiagram", "phase_diagram", "uniform_on_sphere"]

ENSEMBLES = ("identity", "gaussian", "goe")


def uniform_on_sphere(shape: tuple[int, ...], d: int, *, generator: torch.Generator | None = None,
                      device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> Tensor:
    """``shape + (d,)`` points uniform on :math:`S^{d-1}` (normalised Gaussians)."""
    return on_sphere(torch.randn(*shape, d, generator=generator, device=device, dtype=dtype))


def random_weights(
    ensemble: str,
    batch: tuple[int, ...],
    d: int,
    *,
    value_identity: bool = False,
    generator: torch.Generator | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(Q, K, V)``, each ``batch + (d, d)``, drawn from ``ensemble``.

    * ``"identity"``: :math:`Q=K=V=I` (the setting of Geshkovski et al.'s theorems);
    * ``"gaussian"``: i.i.d. :math:`\\mathcal N(0, 1/d)` entries, independent matrices;
    * ``"goe"``: :math:`(G+G^\\top)/\\sqrt{2d}`, :math:`G` as above (Gaussian orthogonal ensemble).

    ``value_identity=True`` keeps :math:`V=I` with random :math:`Q, K` (Karagodin et al.'s causal theorem).
    """
    check_choice(ensemble, "ensemble", ENSEMBLES)
    eye = torch.eye(d, device=device, dtype=dtype).expand(batch + (d, d))
    if ensemble == "identity":
        return eye, eye, eye

    def draw() -> Tensor:
        G = torch.randn(batch + (d, d), generator=generator, device=device, dtype=dtype) / math.sqrt(d)
        return (G + G.transpose(-1, -2)) / math.sqrt(2) if ensemble == "goe" else G

    Q, K, V = draw(), draw(), draw()
    return Q, K, (eye if value_identity else V)


class LayerWeights:
    """``t -> (Q, K, V)``: weights of :func:`random_weights`, redrawn every ``every`` units of time.

    Layer :math:`\\ell = \\lfloor t/\\text{every}\\rfloor` draws its weights from a generator seeded with
    ``seed + ℓ`` (reproducible, whatever order the times come in); the inverse temperatures ``betas``
    (broadcastable to ``batch``) multiply :math:`Q`. ``every=None`` is one layer for all times.
    """

    def __init__(self, ensemble: str, batch: tuple[int, ...], d: int, *, betas: Tensor | None = None,
                 every: float | None = None, value_identity: bool = False, seed: int = 0,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
        check_choice(ensemble, "ensemble", ENSEMBLES)
        if every is not None and not every > 0:
            raise ValueError(f"every (the regeneration period) must be > 0 or None, got {every!r}")
        self.ensemble, self.batch, self.d, self.every = ensemble, batch, d, every
        self.betas, self.value_identity, self.seed = betas, value_identity, seed
        self.device, self.dtype = torch.device(device), dtype
        self._layer: int | None = None
        self._params: tuple[Tensor, Tensor, Tensor] | None = None

    def layer(self, t: float) -> int:
        return 0 if self.every is None else int(math.floor(t / self.every + 1e-9))

    def __call__(self, t: float) -> tuple[Tensor, Tensor, Tensor]:
        layer = self.layer(t)
        if layer != self._layer:
            gen = torch.Generator(self.device).manual_seed(self.seed + layer)
            Q, K, V = random_weights(self.ensemble, self.batch, self.d, value_identity=self.value_identity,
                                     generator=gen, device=self.device, dtype=self.dtype)
            if self.betas is not None:
                Q = self.betas.to(self.device, self.dtype).reshape(self.betas.shape + (1, 1)) * Q
            self._layer, self._params = layer, (Q, K, V)
        return self._params


@dataclass
class PhaseDiagram:
    """What :func:`phase_diagram` returns; every ``(T, B)`` field is a mean over the systems of each :math:`\\beta`.

    Attributes:
        kind: the attention of the simulation. betas: ``(B,)``. times: ``(T,)``.
        single_cluster: ``(T, B)`` probability of a single cluster (diameter ``<= radius``).
        n_clusters: ``(B,)`` mean number of clusters at the last time. span_dimension: ``(B,)`` mean span
            dimension at the last time (both cost more than the recorded diagnostics).
        energy: ``(T, B)`` mean normalised interaction energy :math:`2\\beta e^{-\\beta}E_\\beta` (``nan`` at
            :math:`\\beta = 0`). energy_systems: ``(T, B, n_systems)`` the same per system (the staircases).
        n_systems, n_tokens, d: the sizes simulated.
    """

    kind: str
    betas: Tensor
    times: Tensor
    single_cluster: Tensor
    n_clusters: Tensor
    span_dimension: Tensor
    energy: Tensor
    energy_systems: Tensor
    n_systems: int
    n_tokens: int
    d: int


def phase_diagram(
    kind: str = "softmax",
    betas: Tensor | list[float] = (1.0,),
    *,
    n_systems: int = 1024,
    n_tokens: int = 32,
    d: int = 3,
    t1: float = 30.0,
    dt: float = 0.1,
    ensemble: str = "identity",
    value_identity: bool = False,
    regenerate_every: float | None = None,
    radius: float = RADIUS,
    record_every: int = 10,
    method: str = "euler",
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    progress: Callable[[float], None] | None = None,
    systems_per_chunk: int | None = None,
    **velocity_kwargs,
) -> PhaseDiagram:
    """Simulate ``len(betas) x n_systems`` token systems on the sphere at once and record their clustering.

    Args:
        kind: a kind of :func:`~sinkformer.dynamics.velocity` (``"softmax"`` is SA, ``"exp"`` USA,
            ``"sinkhorn"``, ``"causal"`` with ``n_iters=``).
        betas: inverse temperatures (the scores are :math:`\\beta\\langle Qx, Ky\\rangle`).
        n_systems: independent systems per :math:`\\beta` (initial tokens uniform on the sphere; weights of
            ``ensemble``, the same for every :math:`\\beta`). n_tokens, d: tokens per system and dimension.
        t1, dt, method: horizon, step (``ceil(t1/dt)`` steps) and integrator of :func:`~sinkformer.dynamics.simulate`.
        regenerate_every: redraw the weights every this many units of time (``None``: one layer).
        radius: linkage radius of the diagnostics. record_every: steps between recorded times.
        seed: seeds the initial tokens (``seed``) and the weights (``seed + 1 + layer``).
        device, dtype: where and in which precision the systems are simulated.
        progress: called at every recorded time with the simulated time of the whole diagram so far
            (``t1`` when done; with several chunks, each chunk advances it by ``t1 / chunks``).
        systems_per_chunk: systems per :math:`\beta` simulated at once; the chunks run one after
            the other and give the results of one batch. Default: all of them on a GPU; on a CPU
            enough that a chunk holds about ``CPU_CHUNK_SCORES`` attention scores (whole steps of
            a larger batch do not stay in the caches: 65,536 systems of 32 tokens run 1.9x slower
            per system and step than 4,096).
        **velocity_kwargs: ``n_iters``, ``tol``, ``chunk_size`` of :func:`~sinkformer.dynamics.velocity`.
    """
    betas = torch.as_tensor(betas, dtype=torch.float64).flatten()
    if betas.numel() == 0 or bool((betas < 0).any()):
        raise ValueError(f"betas must be a non-empty list of inverse temperatures >= 0, got {betas.tolist()}")
    for name, value in (("n_systems", n_systems), ("n_tokens", n_tokens), ("d", d), ("record_every", record_every)):
        check_positive_int(value, name)
    if not (t1 > 0 and dt > 0):
        raise ValueError(f"t1 and dt must be > 0, got t1={t1!r}, dt={dt!r}")
    steps = max(1, math.ceil(t1 / dt - 1e-9))
    B = betas.numel()
    gen = torch.Generator(torch.device(device)).manual_seed(seed)
    x0 = uniform_on_sphere((B, n_systems, n_tokens), d, generator=gen, device=device, dtype=dtype)
    weights = LayerWeights(ensemble, (1, n_systems), d, betas=betas.reshape(B, 1), every=regenerate_every,
                           value_identity=value_identity, seed=seed + 1, device=device, dtype=dtype)
    energy_beta = torch.where(betas > 0, betas, 1.0).to(device, dtype).reshape(B, 1)

    if systems_per_chunk is None:
        on_cpu = torch.device(device).type == "cpu"
        systems_per_chunk = max(1, CPU_CHUNK_SCORES // (B * n_tokens**2)) if on_cpu else n_systems
    check_positive_int(systems_per_chunk, "systems_per_chunk")
    starts = range(0, n_systems, systems_per_chunk)
    chunks = [_simulate_chunk(x0[:, s:s + systems_per_chunk], weights, slice(s, s + systems_per_chunk), kind,
                              steps, dt, method, record_every, radius, energy_beta,
                              None if progress is None else _chunk_progress(progress, i, len(starts), steps, dt),
                              velocity_kwargs)
              for i, s in enumerate(starts)]
    times = chunks[0][0].times
    obs = {name: torch.cat([traj.observed[name] for traj, _ in chunks], -1) for name in chunks[0][0].observed}
    final = {name: torch.cat([f[name] for _, f in chunks], -1) for name in chunks[0][1]}
    energy = obs["energy"].masked_fill((betas == 0).reshape(1, B, 1), float("nan"))
    return PhaseDiagram(
        kind, betas, times, obs["single_cluster"].mean(-1), final["n_clusters"].double().mean(-1).cpu(),
        final["span_dimension"].double().mean(-1).cpu(), energy.mean(-1), energy, n_systems, n_tokens, d,
    )


#: Attention scores per chunk of :func:`phase_diagram` on a CPU (4,096 systems of 32 tokens).
CPU_CHUNK_SCORES = 1 << 22


def _simulate_chunk(x0: Tensor, weights: LayerWeights, systems: slice, kind: str, steps: int, dt: float,
                    method: str, record_every: int, radius: float, energy_beta: Tensor,
                    progress: Callable[[int], None] | None, velocity_kwargs: dict):
    """One chunk of :func:`phase_diagram`: the systems ``systems`` (``x0``: ``(B, S, n, d)``), simulated with
    their weights; returns the trajectory (diagnostics only) and the final diagnostics (on the CPU)."""
    recorded = iter(range(steps // record_every + 2))

    def observe(x: Tensor) -> dict[str, Tensor]:
        out = diagnostics(x, radius=radius, beta=energy_beta, which=("single_cluster", "energy"))
        if progress is not None:
            progress(min(next(recorded) * record_every, steps))
        return {name: value.to("cpu", torch.float64) for name, value in out.items()}

    def chunk_weights(t: float) -> tuple[Tensor, Tensor, Tensor]:
        return tuple(w[:, systems] for w in weights(t))

    traj = simulate(x0, chunk_weights, t1=steps * dt, steps=steps, method=method, kind=kind, geometry="sphere",
                    record_every=record_every, observe=observe, keep_positions=False, **velocity_kwargs)
    final = diagnostics(traj.final, radius=radius)
    return traj, {"n_clusters": final["n_clusters"].cpu(), "span_dimension": final["span_dimension"].cpu()}


def _chunk_progress(progress: Callable[[float], None], chunk: int, chunks: int, steps: int,
                    dt: float) -> Callable[[int], None]:
    """Chunk ``chunk``'s step count -> ``progress`` of the simulated time of the whole diagram (a later
    chunk's step 0 is the previous chunk's end, not reported twice)."""

    def report(step: int) -> None:
        if step > 0 or chunk == 0:
            progress((chunk + step / steps) / chunks * steps * dt)

    return report
