"""Transformers as interacting particles (Castin et al.; Sander et al. §4–5; Agarwal et al.).

Tokens are a weighted point cloud :math:`\\mu = \\sum_i w_i\\delta_{x_i}`, and an attention layer is the
velocity field :math:`\\Gamma_\\mu`; conventions are those of ``docs/theory.md`` §5 (:math:`A = K^\\top Q`, no
:math:`1/\\sqrt k`, :math:`\\varepsilon` a temperature).

* :func:`velocity` — the field of every attention variant, streamed over blocks for large clouds,
  in :math:`\\mathbb R^d` or on the sphere (``geometry="sphere"``: SA, USA, Sinkhorn, causal);
* :func:`simulate` / :func:`integrate` — particle flows (Euler, RK4), with warm-started Sinkhorn;
* :mod:`.clustering` — clusters, single-cluster indicator, inner-product histograms, span dimension,
  interaction energy, of simulated particles or of a model's hidden states;
* :mod:`.phase` — phase diagrams: thousands of systems over a grid of :math:`\\beta` in one tensor program;
* :mod:`.gaussian` — closed-form fields and moment ODEs of Gaussians, Riccati, drifting;
* :mod:`.heat` — Sinkhorn attention as a Schrödinger-bridge step and the heat flow;
* :mod:`.energies` — Sinkformer energies :math:`F_0`, :math:`F_\\infty`, gradient-flow checks and the
  twisted-Wasserstein rate of SoftMax attention;
* :mod:`.distances` — :math:`W_2` between Gaussians, point clouds, and the conditional distance.
"""

from . import clustering, distances, energies, gaussian, heat, phase
from .params import as_heads, from_multihead, interaction, split_heads
from .simulate import ParticleField, Trajectory, integrate, simulate
from .velocity import GEOMETRIES, KINDS, FieldResult, on_sphere, tangent, velocity

__all__ = [
    "velocity",
    "FieldResult",
    "KINDS",
    "GEOMETRIES",
    "on_sphere",
    "tangent",
    "simulate",
    "integrate",
    "Trajectory",
    "ParticleField",
    "as_heads",
    "from_multihead",
    "interaction",
    "split_heads",
    "gaussian",
    "heat",
    "energies",
    "distances",
    "clustering",
    "phase",
]
