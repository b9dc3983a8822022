r"""The flash engine: fused Triton kernels that never write the ``n × m`` matrix (GPUs).

Sinkhorn in the log domain is a sequence of row-wise log-sum-exps of biased dot-product scores
:math:`s_{ij} = \mathrm{scale}\,q_i\cdot k_j + \mathrm{bias}_{ij}`, from :math:`g^{(0)} = 0`:

.. math::

    f_i \leftarrow \log a_i - \mathrm{LSE}_j(s_{ij} + g_j), \qquad
    g_j \leftarrow \log b_j - \mathrm{LSE}_i(s_{ij} + f_i),

the normalisation of attention with a key bias, so each one tiles and streams like FlashAttention
(:mod:`._flash_kernels`: a column update is the same kernel on the transposed problem, no atomics;
scores and potentials are kept in base 2, so every exponential is one ``exp2``). The last row update
is fused with the output :math:`o = Pv` (online rescaling); after an even count the output is one
more sweep with both potentials known. Only the potentials of every iteration are saved,
:math:`O((n+m)\,n\_iters)` per slice.

The sweeps run on the *doubly shifted* scores :math:`x_{ij} = s_{ij} - \rho_i - \kappa_j`
(:func:`~.problem.double_shift`: :math:`\rho_i = \max_j s_{ij}`,
:math:`\kappa_j = \max_i (s_{ij} - \rho_i)`), which change no plan (Proposition 1: the potentials
move by the shifts) but keep the potentials of the size of :math:`\log n` instead of
:math:`\max|s|`: in float32, potentials of 1e4 added to the scores cost 1e-3 of every weight. The
shifts cost no pass of their own: the first row update finds :math:`\rho` (its running maximum of
the scores, in natural units) and the first column update :math:`\kappa`; both are saved for the
backward, and the start :math:`g^{(0)} = 0` of the plain scores is :math:`\kappa` of the shifted ones.

The backward is the **exact gradient of the** ``n_iters`` **map**, the recursion of the tiled
engine's log domain (:func:`.tiled._log_backward`) without its tile: with
:math:`P = e^{s + F\oplus G}` the final plan and :math:`dP = dO\,V^\top`,

.. math::

    \frac{\partial\ell}{\partial s_{ij}} = P_{ij}\,dP_{ij} - \sum_{t=1}^{n\_iters}
    e^{s_{ij} + \alpha_{ti} + \beta_{tj}}\,U_{ti} W_{tj}
    = P_{ij}\Big(dP_{ij} - \sum_t X_{ti} Y_{tj}\Big),

one term per normalisation (:math:`\alpha, \beta` that iteration's potentials; :math:`U = \gamma_t`,
:math:`W = 1` for a row step, :math:`U = 1`, :math:`W = \delta_t` for a column step), and with
:math:`X_{ti} = e^{\alpha_{ti} - F_i - c_t} U_{ti}`, :math:`Y_{tj} = e^{\beta_{tj} - G_j + c_t} W_{tj}`
the terms fold into the ``dP`` product: one exponential per score, as FlashAttention's backward
(slices whose :math:`e^{\pm}` factors do not fit the float range keep one exponential per term; a
per-slice flag on the device chooses, so no host synchronisation). The coefficients come from a
vector recursion with one matrix-vector sweep per normalisation (:data:`._flash_kernels.MATVEC`);
its start :math:`\sum_j P_{ij}dP_{ij} = dO_i\cdot o_i` costs nothing and
:math:`\sum_i P_{ij}dP_{ij} = v_j\cdot dV_j` comes with :math:`dV = P^\top dO`, in the same pass as
the first reverse step after an odd count (:data:`._flash_kernels.DV`). Then
:math:`dq = \mathrm{scale}\;\partial S\,k` and :math:`dk = \mathrm{scale}\;\partial S^\top q` are one
sweep each (:func:`._flash_kernels.dscore`). ``tol=`` runs the same sweeps with the stop rule of
:class:`~.problem.Tolerance` (one host synchronisation per iteration). ``backward="implicit"``
differentiates the balanced fixed point instead, as the tiled engine does: two folded terms,
:math:`\partial S = P\odot(dP - \alpha\oplus\beta)`, with the duals solved by conjugate gradients
whose products with :math:`P` and :math:`P^\top` are matrix-vector sweeps.

Cost (:func:`cost_model` counts it): the forward runs ``n_iters`` log-sum-exp sweeps (the last fused
with the output; one more after an even count); the backward one ``dV`` sweep (fused with the
first reverse step after an odd count), the remaining matrix-vector sweeps and the ``dq`` and ``dk``
sweeps, each with one exponential per score.

Launches are tuned per head dimension and dtype (:data:`GPU_CONFIGS`: rows and columns per block,
warps, pipeline stages); :func:`unavailable` refuses, by name and with the reason, every call the
kernels cannot serve (device, Triton version, dtype, head dimension), and ``backend="auto"`` then
picks the next engine. On CUDA tensors the kernels compile for the GPU; on CPU tensors they run
only under Triton's interpreter (``TRITON_INTERPRET=1`` set before the first call), which is how
they are tested without a GPU. ``triton`` is optional (``pip install 'sinkformer[gpu]'``) and
imported on first use.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
from dataclasses import dataclass

import torch
from torch import Tensor

from .problem import (
    Problem,
    column_error,
    converged_tol,
    log_marginal,
    warn_if_unconverged,
    warn_unbalanced,
)
from .implicit import implicit_duals
from .loop import reverse_schedule, sinkhorn_loop
from .ops import refuse_implicit_second_derivatives, register_engine_autograd

__all__ = ["flash_attention", "unavailable", "LaunchConfig", "GPU_CONFIGS", "launch_config",
           "MIN_TRITON", "MAX_HEAD_DIM", "operand_dtype"]

ENGINE = "flash"
LOG2E = 1.4426950408889634

#: Oldest Triton whose compiler these kernels were compiled with (``tests/sinkhorn/test_flash_compile.py``,
#: on 3.6, the version of the project's GPU machines, and on the newest).
MIN_TRITON = (3, 6)
#: float64 matrix products fail to compile for sm_90 on Tritons 3.6 and 3.8 ("Currently fp64 don't
#: support largeK MMA", when a product's operand comes from registers next to a byte mask); 3.9 compiles them.
MIN_TRITON_FLOAT64 = (3, 9)
#: Triton's interpreter (CPU tensors) before 3.7 cannot run a loop whose bound is a kernel argument
#: under numpy >= 2.4, which no longer converts its 1-element arrays to an index (triton-lang/triton#9171);
#: every kernel here has such a loop.
MIN_TRITON_INTERPRETER_NUMPY_2_4 = (3, 7)
#: Largest head (and value) dimension a block of the kernels holds.
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class LaunchConfig:
    """One kernel's launch: rows and columns per block, warps per program, software-pipeline stages."""

    block_r: int
    block_c: int
    num_warps: int = 4
    num_stages: int = 2


def _launches(sweep: tuple, dscore: tuple, vector_rows: int = 64) -> dict[str, LaunchConfig]:
    return {"sweep": LaunchConfig(*sweep), "dscore": LaunchConfig(*dscore),
            "vector": LaunchConfig(vector_rows, 1024, 4, 1)}


_HALF = (torch.float16, torch.bfloat16)
#: ``(operand dtype, padded head dim) -> {kernel: LaunchConfig}`` on GPUs (sm_90). The padded head
#: dim is the power of two >= max(d, d_v, 16). ``sweep`` serves the forward, the matrix-vector and
#: the dV sweeps, ``dscore`` the dq/dk sweeps, ``vector`` the rowdot (rows per program) and fold
#: (entries per step) kernels. Each entry compiles for sm_90 within an H100's 227 KiB of shared
#: memory without register spills (``python -m benchmarks flash-compile`` reports it). Timed on a GPU
#: (``python -m benchmarks flash-tune``, an H200): bfloat16 and float32 at d = 64, the fastest of
#: the candidates in benchmarks/results/flash_tune_{bf16,fp32}.md (a test holds them equal); the
#: other entries are untimed. An absent entry is refused by :func:`unavailable`.
GPU_CONFIGS: dict[tuple[torch.dtype, int], dict[str, LaunchConfig]] = {
    # half precision: 128-row forward blocks up to d = 64, as FlashAttention's Triton kernels on Hopper
    **{(dtype, d): _launches((128, 64, 4, 3), (64, 64, 4, 2)) for dtype in _HALF for d in (16, 32)},
    # timed in bfloat16 (float16 runs the same products, untimed): dscore 64 x 32 is 0.94x the 64 x 64
    # launch forward+backward at n = 4096 and 16384
    **{(dtype, 64): _launches((128, 64, 4, 3), (64, 32, 4, 2)) for dtype in _HALF},
    **{(dtype, 128): _launches((64, 64, 4, 2), (64, 32, 4, 2)) for dtype in _HALF},
    **{(dtype, 256): _launches((64, 32, 8, 2), (32, 32, 4, 1), 32) for dtype in _HALF},
    # float32 products on CUDA cores (no TF32: within 1e-5 of float64)
    **{(torch.float32, d): _launches((64, 32, 4, 2), (64, 32, 4, 2)) for d in (16, 32)},
    # timed: 0.64x the 64 x 32 launches forward+backward at n = 4096, 5 iterations (0.70x at n = 1024)
    (torch.float32, 64): _launches((128, 64, 8, 2), (64, 64, 4, 2)),
    (torch.float32, 128): _launches((32, 32, 4, 2), (32, 32, 4, 1), 32),
    (torch.float32, 256): _launches((32, 16, 8, 1), (16, 16, 4, 1), 16),
    # float64: small blocks (its products take twice the registers and shared memory); none at d = 256
    **{(torch.float64, d): _launches((32, 16, 4, 2), (32, 16, 4, 1), 32) for d in (16, 32, 64)},
    (torch.float64, 128): _launches((16, 16, 4, 1), (16, 16, 4, 1), 16),
}
#: Under Triton's interpreter (CPU tests): few programs, several blocks already at n = 40.
INTERPRETER_CONFIG = {"sweep": LaunchConfig(32, 32), "dscore": LaunchConfig(32, 32), "vector": LaunchConfig(32, 64)}
#: the grid's second axis (slices) is limited to 65535 programs: larger batches run in chunks.
_MAX_SLICES = 65535
#: Largest exponent (base 2) of a folded factor ``X``, ``Y`` of the backward: beyond it a slice takes
#: one exponential per term. ``P X Y`` is then exact for every term above 2^-LIMIT (the product of
#: a factor pair is at most 2^(2 LIMIT), so P stays above the smallest normal number).
FOLD_LIMIT = {torch.float32: 40.0, torch.float64: 400.0}


def _interpreter_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _pow2(x: int) -> int:
    return max(16, 1 << max(0, x - 1).bit_length())


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def operand_dtype(dtype: torch.dtype, device_type: str) -> torch.dtype:
    """The dtype ``q, k, v`` enter the kernels in: half precision as given on CUDA (tensor cores),
    float64 as given, anything else float32 (what :func:`sinkformer.attention` passes)."""
    if dtype in (torch.float16, torch.bfloat16) and device_type == "cuda":
        return dtype
    return torch.float64 if dtype == torch.float64 else torch.float32


def _triton_version() -> tuple[int, int]:
    import triton

    major, minor = (int("".join(ch for ch in part if ch.isdigit()) or 0) for part in triton.__version__.split(".")[:2])
    return major, minor


def _triton_built_for_a_gpu() -> bool:
    """Whether triton is already imported with its jitted helpers built for a GPU (the interpreter
    is chosen once, when triton is first imported; the kernels cannot run interpreted then)."""
    import sys

    language = sys.modules.get("triton.language")
    return language is not None and type(language.standard.max).__name__ != "InterpretedFunction"


def _numpy_version() -> tuple[int, int]:
    import numpy

    return tuple(int(part) for part in numpy.__version__.split(".")[:2])


def _version(v: tuple[int, ...]) -> str:
    return ".".join(map(str, v))


def launch_config(dtype: torch.dtype, head_dim: int, value_dim: int, interpreted: bool) -> dict[str, LaunchConfig] | None:
    """The launches of a call (:data:`GPU_CONFIGS`), ``None`` when no configuration fits."""
    if interpreted:
        return INTERPRETER_CONFIG
    return GPU_CONFIGS.get((dtype, _pow2(max(head_dim, value_dim))))


def unavailable(device_type: str, dtype: torch.dtype | None = None, head_dim: int | None = None,
                value_dim: int | None = None) -> str | None:
    """Why the flash engine cannot run a call here (a sentence naming what to change), or ``None``.

    It needs the ``triton`` package (version >= :data:`MIN_TRITON`), and either CUDA tensors or CPU
    tensors with Triton's interpreter switched on (``TRITON_INTERPRET=1`` before the kernels are first
    imported); with ``dtype`` (the call's q dtype) and the head/value dims, also a compiled
    configuration for them (:data:`GPU_CONFIGS`)."""
    if importlib.util.find_spec("triton") is None:
        return ("engine 'flash' needs triton, which the core of sinkformer does not install: "
                "pip install 'sinkformer[gpu]' (Linux x86-64)")
    interpreted = False
    if device_type == "cpu":
        import sys

        loaded = sys.modules.get(__name__.rsplit(".", 1)[0] + "._flash_kernels")
        interpreted = loaded.INTERPRETED if loaded is not None else _interpreter_requested()
        if not interpreted:
            return (f"engine 'flash' runs Triton kernels on CUDA tensors, got device {device_type!r} (CPU tensors run "
                    "only under Triton's interpreter: set TRITON_INTERPRET=1 before the first call)")
        if _triton_built_for_a_gpu():
            return ("engine 'flash' on CPU tensors needs Triton's interpreter, but triton was imported before "
                    "TRITON_INTERPRET=1 was set, so its own helpers are built for a GPU: set it before anything "
                    "imports triton")
    elif device_type != "cuda":
        return f"engine 'flash' runs Triton kernels on CUDA tensors, got device {device_type!r}"
    version = _triton_version()
    if version < MIN_TRITON:
        return (f"engine 'flash' needs triton >= {_version(MIN_TRITON)} (the oldest its kernels are "
                f"compiled with), found {_version(version)}: pip install -U triton")
    if interpreted and version < MIN_TRITON_INTERPRETER_NUMPY_2_4 and _numpy_version() >= (2, 4):
        return (f"engine 'flash' on CPU tensors runs Triton's interpreter, which before triton "
                f"{_version(MIN_TRITON_INTERPRETER_NUMPY_2_4)} cannot run its kernels with numpy >= 2.4 (found triton "
                f"{_version(version)}, numpy {_version(_numpy_version())}; triton-lang/triton#9171): "
                "pip install -U triton, or 'numpy<2.4'")
    if dtype is None:
        return None
    kernel_dtype = operand_dtype(dtype, device_type)
    if kernel_dtype == torch.float64 and not interpreted and version < MIN_TRITON_FLOAT64:
        return (f"engine 'flash' cannot compile float64 on triton {_version(version)} (its float64 matrix "
                f"products need triton >= {_version(MIN_TRITON_FLOAT64)}): use float32 inputs, another "
                "backend, or pip install -U triton")
    if head_dim is None:
        return None
    value_dim = head_dim if value_dim is None else value_dim
    if max(head_dim, value_dim) > MAX_HEAD_DIM:
        return (f"engine 'flash' holds head dims up to {MAX_HEAD_DIM} in a block, got head_dim={head_dim}, "
                f"value_dim={value_dim}; use backend='tiled' or 'streamed'")
    if launch_config(kernel_dtype, head_dim, value_dim, interpreted) is None:
        return (f"engine 'flash' has no launch configuration that fits a GPU's shared memory for "
                f"{str(kernel_dtype).removeprefix('torch.')} with head_dim={head_dim}, value_dim={value_dim}; "
                "use float32 or half-precision inputs, or backend='tiled'")
    return None


def _kernels():
    from . import _flash_kernels

    return _flash_kernels


def flash_attention(problem: Problem, *, backward: str = "unrolled") -> Tensor:
    """Sinkhorn attention ``(B, n, d) x (B, m, d) x (B, m, e) -> (B, n, e)`` of a validated
    :class:`~.problem.Problem` on the fused kernels.

    Its operands are all of one dtype (float32/float64, or float16/bfloat16 whose products the kernels
    run on tensor cores with float32 accumulation); ``bias`` has no gradient. Returns ``(B, n, e)`` in
    the dtype of ``v`` for half inputs, else in the compute dtype (float64 for float64, else float32).
    ``backward``: ``"unrolled"`` (exact gradient of the ``n_iters`` map) or ``"implicit"`` (the
    balanced fixed point's, by conjugate gradients on matrix-vector sweeps).
    """
    q, v = problem.q, problem.v
    why = unavailable(q.device.type, q.dtype, q.shape[-1], v.shape[-1])
    if why is not None:
        raise ValueError(f"backend='flash' cannot serve this call: {why}")
    return _forward_autograd(*problem.fields(), backward)[0]


def _on_device(t: Tensor):
    """Launch on ``t``'s GPU (Triton launches on the current device, which may be another one)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


# ------------------------------------------------------------------------------------------------
# launching the kernels


@dataclass
class _Marginal:
    """A marginal as the kernels take it: ``log2`` and ``inv`` (1/mass, 0 without mass) are ``(B, n)``
    tensors, or floats when the marginal is uniform (no mask); ``mass`` likewise."""

    mass: Tensor | float
    log2: Tensor | float
    inv: Tensor | float

    @staticmethod
    def of(mass: Tensor) -> _Marginal:
        mass = mass.contiguous()
        log2 = log_marginal(mass, mass > 0, empty=float("-inf")) * LOG2E
        return _Marginal(mass, log2, torch.where(mass > 0, 1 / mass, torch.zeros_like(mass)))


class _Operands:
    """A :class:`~.problem.Problem` as the kernels see it: slices, masks (strided, never expanded),
    marginals and the launch configuration (``interpreted``: the interpreter's, else the GPU's)."""

    def __init__(self, problem: Problem, interpreted: bool | None = None):
        q, k = problem.q, problem.k
        self.q, self.k, self.scale = q, k, problem.scale
        self.B, self.n, self.m, self.d, self.e = problem.B, problem.n, problem.m, q.shape[2], problem.v.shape[-1]
        self.acc = _acc_dtype(q.dtype)
        keep_s, bias_s = problem.keep_of(), problem.bias_of()
        self.keep = None if keep_s is None else keep_s.view(torch.uint8)
        self.bias = None if bias_s is None else bias_s.to(self.acc)
        if keep_s is None:  # rows sum to 1, columns to n / m
            self.rows = _Marginal(1.0, 0.0, 1.0)
            self.cols = _Marginal(self.n / self.m, math.log2(self.n / self.m), self.m / self.n)
        else:
            a, b = problem.marginals(q.new_empty((), dtype=self.acc))
            self.rows, self.cols = _Marginal.of(a), _Marginal.of(b)
        self.dummy = torch.zeros(1, dtype=self.acc, device=q.device)
        #: the shifts of the scores (:mod:`._flash_kernels`), ``(B, n)`` and ``(B, m)``: allocated by
        #: :func:`_forward` (the keys' 0 until the first column sweep finds it), saved for the backward
        self.shift_q: Tensor | None = None
        self.shift_k: Tensor | None = None
        interpreted = q.device.type == "cpu" if interpreted is None else interpreted
        self.config = launch_config(q.dtype, self.d, self.e, interpreted)
        self.precision = "ieee" if q.dtype in (torch.float32, torch.float64) else "tf32"
        self.term_precision = "ieee" if q.dtype in (torch.float32, torch.float64) else "tf32"

    def _mask(self, t: Tensor | None, transposed: bool) -> tuple:
        """``(pointer, batch stride, row stride, column stride)`` of a mask in one orientation."""
        if t is None:
            return self.dummy, 0, 0, 0
        sb, sr, sc = (0 if t.shape[i] == 1 else t.stride(i) for i in range(3))
        return (t, sb, sc, sr) if transposed else (t, sb, sr, sc)

    def _orient(self, transposed: bool) -> tuple:
        """``(R, C, n_r, n_c, keep, bias, shift_r, shift_c)``: the query orientation, or the key orientation."""
        if self.shift_q is None or self.shift_k is None:  # the kernels would read them out of bounds
            raise RuntimeError("flash: the score shifts are set by _forward (or from its outputs) before a sweep")
        if transposed:
            return (self.k, self.q, self.m, self.n, self._mask(self.keep, True), self._mask(self.bias, True),
                    self.shift_k, self.shift_q)
        return (self.q, self.k, self.n, self.m, self._mask(self.keep, False), self._mask(self.bias, False),
                self.shift_q, self.shift_k)

    def _vec(self, t: Tensor | float | None) -> tuple[Tensor, int]:
        """``(pointer, batch stride)`` of a ``(B, n)`` vector (a dummy for a float or ``None``)."""
        return (t, t.stride(0)) if isinstance(t, Tensor) else (self.dummy, 0)

    def _chunks(self):
        """``(take, slices)`` per launch: ``take(t)`` is the part of a ``(B, ...)`` tensor it covers (the
        tensor itself when one launch covers all: the grid's second axis holds at most 65535 slices)."""
        if self.B <= _MAX_SLICES:
            yield (lambda t: t), self.B
            return
        for s in range(0, self.B, _MAX_SLICES):
            sl = slice(s, min(self.B, s + _MAX_SLICES))
            yield (lambda t, sl=sl: t[sl]), sl.stop - sl.start

    def sweep(self, mode: int, transposed: bool, pot_c: Tensor, *, pot_r: Tensor | None = None,
              log_a: Tensor | float = 0.0, w: Tensor | None = None, dual: Tensor | None = None,
              xrow: Tensor | None = None, inv: Tensor | float = 1.0, v: Tensor | None = None,
              vec: Tensor | None = None, find_shift: bool = False) -> tuple[Tensor, Tensor | None]:
        """Run :func:`._flash_kernels.sweep`; returns ``(row vector, output or None)``. ``vec`` is
        where the row vector goes (a view into the potentials; a new tensor by default);
        ``find_shift``: the rows' shift is written, not read (the forward's first two sweeps)."""
        K = _kernels()
        R, C, n_r, n_c, keep, bias, shift_r, shift_c = self._orient(transposed)
        vec = torch.empty(self.B, n_r, dtype=self.acc, device=R.device) if vec is None else vec
        e = v.shape[-1] if v is not None else 0
        out = torch.empty(self.B, n_r, e, dtype=_out_dtype(v), device=R.device) if v is not None else None
        cfg = self.config["sweep"]
        dummy3 = self.dummy.view(1, 1, 1)
        for take, slices in self._chunks():
            vectors = [self._vec(take(x) if isinstance(x, Tensor) else x)
                       for x in (pot_r, pot_c, shift_r, shift_c, log_a, w, dual, inv, vec)]
            (pr, s_pr), (pc, s_pc), (sr, s_sr), (sc, s_sc), (la, s_la), (ww, s_w), (du, s_du), (iv, s_inv), \
                (po, s_po) = vectors
            vv, oo, xx = (dummy3 if x is None else take(x) for x in (v, out, xrow))
            K.sweep[(_cdiv(n_r, cfg.block_r), slices)](
                take(R), take(C), vv, oo, pr, pc, sr, sc, la, ww, du, xx, iv, po, _at(keep, take), _at(bias, take),
                n_r, n_c, self.scale, log_a if isinstance(log_a, float) else 0.0, inv if isinstance(inv, float) else 1.0,
                *R.stride(), *C.stride(), *_strides3(v), *_strides3(out), *_strides3(xrow),
                s_pr, s_pc, s_sr, s_sc, s_la, s_w, s_du, s_inv, s_po, keep[1], keep[2], keep[3], bias[1], bias[2],
                bias[3], MODE=mode, FIND_SHIFT=find_shift, HAS_KEEP=self.keep is not None, HAS_BIAS=self.bias is not None,
                HAS_LOG_A=isinstance(log_a, Tensor), HAS_W=w is not None, HAS_DUAL=dual is not None,
                HAS_INV=isinstance(inv, Tensor), BLOCK_R=cfg.block_r, BLOCK_C=cfg.block_c, D=self.d,
                BLOCK_D=_pow2(self.d), E=e, BLOCK_E=_pow2(e), PRECISION=self.precision,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            )
        return vec, out

    def rowdot(self, x: Tensor, y: Tensor, inv: Tensor | float, out: Tensor | None = None) -> Tensor:
        """``(x_i . y_i) * inv_i`` per row of ``(B, n, e)`` tensors, as a ``(B, n)`` vector (into ``out``)."""
        K = _kernels()
        n, e = x.shape[1], x.shape[2]
        out = torch.empty(self.B, n, dtype=self.acc, device=x.device) if out is None else out
        cfg = self.config["vector"]
        for take, slices in self._chunks():
            iv, s_inv = self._vec(take(inv) if isinstance(inv, Tensor) else inv)
            K.rowdot[(_cdiv(n, cfg.block_r), slices)](
                take(x), take(y), iv, take(out), n, inv if isinstance(inv, float) else 1.0, *x.stride(), *y.stride(), s_inv,
                out.stride(0), HAS_INV=isinstance(inv, Tensor), BLOCK_R=cfg.block_r, E=e, BLOCK_E=_pow2(e),
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        return out

    def fold(self, fs: Tensor, gs: Tensor, u: Tensor, w: Tensor, implicit: bool) -> _Terms:
        """The terms of :meth:`dscore` from the saved potentials and the coefficients ``u (B, T, n)``,
        ``w (B, T, m)`` (:func:`._flash_kernels.fold`; ``implicit``: every term at the final potentials)."""
        K = _kernels()
        T = u.shape[1]
        xa, a, ya, b = torch.empty_like(u), torch.empty_like(u), torch.empty_like(w), torch.empty_like(w)
        ok = torch.empty(self.B, T, dtype=torch.int32, device=u.device)
        for take, slices in self._chunks():
            K.fold[(T, slices)](*map(take, (fs, gs, u, w, xa, ya, a, b, ok)), self.n, self.m, T,
                                FOLD_LIMIT[self.acc], fs.stride(0), fs.stride(1), gs.stride(0), gs.stride(1),
                                fs.shape[1] - 1, gs.shape[1] - 1, IMPLICIT=implicit,
                                BLOCK=self.config["vector"].block_c, num_warps=self.config["vector"].num_warps)
        return _Terms(xa, ya, a, b, u, w, ok)

    def dscore(self, transposed: bool, x: Tensor, y: Tensor, pot_r: Tensor, pot_c: Tensor, terms: _Terms) -> Tensor:
        """Run :func:`._flash_kernels.dscore` (both variants, each on its slices): ``scale * dS @ C``
        (``dq``; ``dk`` when transposed)."""
        K = _kernels()
        R, C, n_r, n_c, keep, bias, shift_r, shift_c = self._orient(transposed)
        terms = terms.transposed() if transposed else terms
        out = torch.empty(self.B, n_r, self.d, dtype=_out_dtype(R), device=R.device)
        e, T = x.shape[-1], terms.count
        cfg = self.config["dscore"]
        for take, slices in self._chunks():
            for folded in (1, 0):
                K.dscore[(_cdiv(n_r, cfg.block_r), slices)](
                    *map(take, (R, C, x, y, out, pot_r, pot_c, shift_r, shift_c, terms.ok, terms.xa, terms.ya,
                                terms.a, terms.b, terms.u, terms.w)), _at(keep, take), _at(bias, take),
                    n_r, n_c, T, self.scale,
                    *R.stride(), *C.stride(), *x.stride(), *y.stride(), *out.stride(), pot_r.stride(0),
                    pot_c.stride(0), shift_r.stride(0), shift_c.stride(0), T * n_r, T * n_c, keep[1], keep[2], keep[3], bias[1], bias[2], bias[3],
                    FOLDED=folded, HAS_KEEP=self.keep is not None, HAS_BIAS=self.bias is not None,
                    BLOCK_R=cfg.block_r, BLOCK_C=cfg.block_c, D=self.d, BLOCK_D=_pow2(self.d), E=e,
                    BLOCK_E=_pow2(e), BLOCK_T=_pow2(T), PRECISION=self.precision,
                    TERM_PRECISION=self.term_precision, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                )
        return out


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _at(mask: tuple, take) -> Tensor:
    """The mask pointer for the slices ``take`` covers (a broadcast batch dimension stays as it is)."""
    t, sb = mask[0], mask[1]
    return t if sb == 0 else take(t)


def _strides3(t: Tensor | None) -> tuple[int, int, int]:
    return (0, 0, 0) if t is None else tuple(t.stride())


def _half_operands(q: Tensor) -> bool:
    return q.dtype in (torch.float16, torch.bfloat16)


def _out_dtype(operand: Tensor) -> torch.dtype:
    """A kernel output's dtype: the operand's when half (as FlashAttention), else float32/float64."""
    return operand.dtype if operand.dtype in (torch.float16, torch.bfloat16) else _acc_dtype(operand.dtype)


# ------------------------------------------------------------------------------------------------
# forward


def _forward_impl(
    q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None, bias: Tensor | None, batch: list[int], scale: float,
    n_iters: int | None, tol: float | None, max_iters: int, backward: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns ``out (B, n, e)``, the row potentials ``(B, Lf, n)`` (``f_1, f_3, ..``), the column
    potentials ``(B, Lg, m)`` (``g_0, g_2, ..``), both in base 2 and relative to the doubly shifted
    scores, the normalisations each slice ran ``(B,)`` and the shifts of the queries ``(B, n)`` and
    keys ``(B, m)``. ``backward="implicit"`` keeps the last potentials only (``Lf = Lg = 1``)."""
    with _on_device(q):
        problem = Problem(q, k, v, keep, bias, batch, scale, n_iters, tol, max_iters)
        return _forward(_Operands(problem), v, n_iters, tol, max_iters, backward)


def _forward(p: _Operands, v: Tensor, n_iters: int | None, tol: float | None, max_iters: int, backward: str):
    """The forward op's outputs; the shifts also stay on ``p`` (for a backward on the same problem)."""
    p.shift_q = torch.empty(p.B, p.n, dtype=p.acc, device=v.device)
    p.shift_k = torch.zeros(p.B, p.m, dtype=p.acc, device=v.device)  # 0 in the first sweep
    fs, gs, out, counts = _iterations(p, v, n_iters, tol, max_iters, implicit=backward == "implicit")
    if backward == "implicit":
        fs, gs = fs[:, -1:], gs[:, -1:]
        if tol is None:
            col_sums = p.sweep(_kernels().MATVEC, True, fs[:, 0], pot_r=gs[:, 0], w=torch.ones_like(fs[:, 0]), inv=-1.0)[0]
            b = p.cols.mass if isinstance(p.cols.mass, Tensor) else torch.full_like(col_sums, p.cols.mass)
            warn_unbalanced(column_error(col_sums, b), n_iters, converged_tol(v.dtype), ENGINE)
    return out, fs, gs, counts, p.shift_q, p.shift_k


_forward_op = torch.library.custom_op("sinkformer::flash_forward", _forward_impl, mutates_args=())


@_forward_op.register_fake
def _(q, k, v, keep, bias, batch, scale, n_iters, tol, max_iters, backward):
    B, n, m = q.shape[0], q.shape[1], k.shape[1]
    acc = _acc_dtype(q.dtype)
    if backward == "implicit":
        lf = lg = 1
    elif tol is None:
        lf, lg = (n_iters + 1) // 2, n_iters // 2 + 1
    else:
        lf = torch.library.get_ctx().new_dynamic_size()
        lg = lf
    return (q.new_empty(B, n, v.shape[-1], dtype=_out_dtype(v)), q.new_empty(B, lf, n, dtype=acc),
            q.new_empty(B, lg, m, dtype=acc), q.new_empty(B, dtype=torch.int64), q.new_empty(B, n, dtype=acc),
            q.new_empty(B, m, dtype=acc))


def _iterations(p: _Operands, v: Tensor, n_iters: int | None, tol: float | None, max_iters: int,
                implicit: bool = False):
    """:func:`~.loop.sinkhorn_loop` on sweeps from ``g = 0``: ``n_iters`` normalisations, or until each
    slice's column error after a row update is ``<= tol`` (its potentials then freeze) or
    ``max_iters``. Returns ``fs = [f1, f3, ..] (B, Lf, n)``, ``gs = [g0, g2, ..] (B, Lg, m)``, the
    output and the counts ``(B,)``. The first row and column sweeps find the shifts, and ``g0 = 0`` of
    the plain scores is ``log2 e · shift_k`` of the shifted ones. The last row sweep of an odd fixed
    count writes the output; the column error comes from the next column update:
    :math:`\\sum_i P_{ij} = b_j 2^{g_j - g'_j}` for the new potential ``g'``."""
    K = _kernels()
    fixed = tol is None
    # a fixed count writes its potentials in place; a tol run stacks them
    fs = torch.empty(p.B, (n_iters + 1) // 2, p.n, dtype=p.acc, device=v.device) if fixed else None
    gs = torch.zeros(p.B, n_iters // 2 + 1 if fixed else 1, p.m, dtype=p.acc, device=v.device)
    done = {"row": 0, "col": 0}
    out = None

    def row_update(g: Tensor, last: bool) -> Tensor:
        nonlocal out
        f, out = p.sweep(K.LSE_OUT if last else K.LSE, False, g, log_a=p.rows.log2, v=v if last else None,
                         vec=fs[:, done["row"]] if fixed else None, find_shift=done["row"] == 0)
        done["row"] += 1
        return f

    def col_update(f: Tensor, g: Tensor) -> tuple[Tensor, Tensor | None]:
        g_new = p.sweep(K.LSE, True, f, log_a=p.cols.log2, vec=gs[:, done["col"] + 1] if fixed else None,
                        find_shift=done["col"] == 0)[0]
        if done["col"] == 0:  # g0 = 0 of the plain scores, relative to the shifted ones (in place: the saved g0)
            torch.mul(p.shift_k, LOG2E, out=g)
        done["col"] += 1
        if fixed:
            return g_new, None
        gap = (p.cols.mass * torch.exp2(g - g_new) - p.cols.mass).abs()  # 0 where b_j = 0
        gap = gap if isinstance(p.cols.mass, float) else torch.where(p.cols.mass > 0, gap, 0.0)
        return g_new, gap.amax(-1) if p.m else gap.sum(-1)

    run = sinkhorn_loop(row_update, col_update, gs[:, 0], n_iters=n_iters, tol=tol, max_iters=max_iters,
                        engine=ENGINE)
    if run.stop is not None:
        warn_if_unconverged([run.stop], implicit=implicit)
        fs, gs = torch.stack(run.fs, 1), torch.stack(run.gs, 1)
    if out is None:  # ends on a column update, or tol: o = e^{s + f ⊕ g} v
        out = p.sweep(K.FIXED_OUT, False, run.gs[-1], pot_r=run.fs[-1], v=v)[1]
    return fs, gs, out, run.counts


# ------------------------------------------------------------------------------------------------
# backward


@dataclass
class _Terms:
    """The correction terms of ``dS`` (module docstring), ``(B, T, n)`` row-side and ``(B, T, m)``
    column-side: the folded factors ``xa``, ``ya``; the base-2 exponents ``a = alpha - F - c``,
    ``b = beta - G + c`` and coefficients ``u``, ``w`` of the term-by-term variant; ``ok (B, T)``
    int32, 1 where a term's folded factors fit the float range (:func:`._flash_kernels.fold`)."""

    xa: Tensor
    ya: Tensor
    a: Tensor
    b: Tensor
    u: Tensor
    w: Tensor
    ok: Tensor

    @property
    def count(self) -> int:
        return self.xa.shape[1]

    def transposed(self) -> _Terms:
        return _Terms(self.ya, self.xa, self.b, self.a, self.w, self.u, self.ok)


def _backward_impl(
    grad_out: Tensor, out: Tensor, q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None, bias: Tensor | None,
    batch: list[int], scale: float, n_iters: int | None, tol: float | None, max_iters: int, fs: Tensor, gs: Tensor,
    counts: Tensor, shift_q: Tensor, shift_k: Tensor, backward: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv)`` of the forward op: the output and its gradient, the problem's fields, the
    saved potentials and shifts, the backward mode (with ``tol`` the slices ran different counts)."""
    with _on_device(q):
        p = _Operands(Problem(q, k, v, keep, bias, batch, scale, n_iters, tol, max_iters))
        p.shift_q, p.shift_k = shift_q, shift_k
        return _backward(p, grad_out, v, out, fs, gs, counts, backward, tol is None)


def _backward(p: _Operands, grad_out: Tensor, v: Tensor, out: Tensor, fs: Tensor, gs: Tensor, counts: Tensor,
              backward: str, fixed: bool) -> tuple[Tensor, Tensor, Tensor]:
    K = _kernels()
    dO = grad_out.to(v.dtype if _half_operands(p.q) else p.acc)
    F, G = fs[:, -1], gs[:, -1]
    if backward == "implicit":  # dS = P * (dP - alpha ⊕ beta): the terms (alpha, 1) and (1, beta)
        dF = p.rowdot(dO, out, 1.0)
        dG, dv = p.sweep(K.DV, True, F, pot_r=G, v=dO, xrow=v, inv=1.0)
        u, w = p.q.new_ones(p.B, 2, p.n, dtype=p.acc), p.q.new_ones(p.B, 2, p.m, dtype=p.acc)
        u[:, 0], w[:, 1] = _implicit_duals(p, F, G, dF, dG)
    else:
        T = fs.shape[1] + gs.shape[1] - 1
        u, w = p.q.new_ones(p.B, T, p.n, dtype=p.acc), p.q.new_ones(p.B, T, p.m, dtype=p.acc)
        dv = (_reverse_fixed if fixed else _reverse_tolerance)(p, fs, gs, counts, dO, out, v, u, w)
    terms = p.fold(fs, gs, u, w, implicit=backward == "implicit")
    dq = p.dscore(False, dO, v, F, G, terms)
    dk = p.dscore(True, v, dO, G, F, terms)
    return dq.to(p.q.dtype), dk.to(p.k.dtype), dv.to(v.dtype)


_backward_op = torch.library.custom_op("sinkformer::flash_backward", _backward_impl, mutates_args=())


@_backward_op.register_fake
def _(grad_out, out, q, k, v, *rest):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _step_potentials(fs: Tensor, gs: Tensor, t: int) -> tuple[Tensor, Tensor]:
    """``(alpha, beta)`` of step ``t``: ``(f_t, g_{t-1})`` for a row step (odd), ``(f_{t-1}, g_t)`` for
    a column step; in the saved lists both are ``fs[(t - 1) // 2]``, ``gs[t // 2]``."""
    return fs[:, (t - 1) // 2], gs[:, t // 2]


def _reverse_fixed(p: _Operands, fs: Tensor, gs: Tensor, counts: Tensor, dO: Tensor, out: Tensor, v: Tensor,
                   u: Tensor, w: Tensor) -> Tensor:
    """Reverse mode through the potentials (as :func:`.tiled._log_backward`, the tile replaced by
    sweeps) when every slice ran ``T`` steps. Step ``t`` (odd: ``f_t = log a - LSE_j(s + g_{t-1})``;
    even: the column update) has coefficient ``gamma_t = dF / a`` (``delta_t = dG / b``), passes its
    row (column) sums on to ``dG`` (``dF``) and consumes its own dual. Each sweep writes the next
    step's coefficient into ``u[:, t - 1]`` (a row step's) or ``w[:, t - 1]`` (a column step's), whose
    other entries stay 1. Returns ``dV``."""
    K = _kernels()
    T = u.shape[1]
    F, G = fs[:, -1], gs[:, -1]
    if T % 2:  # gamma_T = dF / a; dV = P^T dO with delta_{T-1} = (v.dV - P^T gamma_T) / b in one pass
        p.rowdot(dO, out, p.rows.inv, out=u[:, T - 1])
        dv = p.sweep(K.DV, True, F, pot_r=G, v=dO, w=u[:, T - 1], xrow=v, inv=p.cols.inv,
                     vec=w[:, T - 2] if T > 1 else None)[1]
        t, dual = T - 1, None
    else:  # delta_T = v.dV / b, and dF = dO.o enters step T's product
        dv = p.sweep(K.DV, True, F, pot_r=G, v=dO, xrow=v, inv=p.cols.inv, vec=w[:, T - 1])[1]
        t, dual = T, p.rowdot(dO, out, 1.0)
    for t in range(t, 1, -1):  # step 1 passes nothing on: g_0 is a constant
        alpha, beta = _step_potentials(fs, gs, t)
        if t % 2:  # delta_{t-1} = -(R^T gamma_t) / b
            p.sweep(K.MATVEC, True, alpha, pot_r=beta, w=u[:, t - 1], inv=p.cols.inv, vec=w[:, t - 2])
        else:  # gamma_{t-1} = (dF - C delta_t) / a
            p.sweep(K.MATVEC, False, beta, pot_r=alpha, w=w[:, t - 1], dual=dual, inv=p.rows.inv, vec=u[:, t - 2])
        dual = None
    return dv


def _reverse_tolerance(p: _Operands, fs: Tensor, gs: Tensor, counts: Tensor, dO: Tensor, out: Tensor, v: Tensor,
                       u: Tensor, w: Tensor) -> Tensor:
    """:func:`_reverse_fixed` when slices ran different counts (``tol``): :func:`~.loop.reverse_schedule`
    on sweeps (steps past a slice's count frozen: coefficient 0, its dual passed on unchanged)."""
    K = _kernels()
    F, G = fs[:, -1], gs[:, -1]
    dF = p.rowdot(dO, out, 1.0)
    dG, dv = p.sweep(K.DV, True, F, pot_r=G, v=dO, xrow=v, inv=1.0)

    def row_step(t: int, gamma: Tensor, dG: Tensor) -> Tensor:
        u[:, t - 1] = gamma
        if t == 1:  # step 1 passes nothing on: g_0 is a constant
            return dG
        alpha, beta = _step_potentials(fs, gs, t)
        return p.sweep(K.MATVEC, True, alpha, pot_r=beta, w=u[:, t - 1], dual=dG, inv=1.0)[0]

    def col_step(t: int, delta: Tensor, dF: Tensor) -> Tensor:
        w[:, t - 1] = delta
        alpha, beta = _step_potentials(fs, gs, t)
        return p.sweep(K.MATVEC, False, beta, pot_r=alpha, w=w[:, t - 1], dual=dF, inv=1.0)[0]

    reverse_schedule(dF, dG, counts, u.shape[1], p.rows.inv, p.cols.inv, row_step, col_step)
    return dv


def _implicit_duals(p: _Operands, F: Tensor, G: Tensor, r: Tensor, c: Tensor, max_iters: int = 1000):
    """:func:`~.implicit.implicit_duals` for :math:`P = e^{s + F\\oplus G}`, its products with ``P`` and
    ``P^T`` matrix-vector sweeps."""
    K = _kernels()
    tol = 1e-10 if p.acc == torch.float64 else 1e-6
    return implicit_duals(lambda y: p.sweep(K.MATVEC, False, G, pot_r=F, w=y, inv=-1.0)[0],
                          lambda x: p.sweep(K.MATVEC, True, F, pot_r=G, w=x, inv=-1.0)[0], r, c, tol=tol,
                          max_iters=max_iters)


# ------------------------------------------------------------------------------------------------
# autograd


def _setup_context(ctx, inputs, output):
    q, k, v, keep, bias, batch, scale, n_iters, tol, max_iters, backward = inputs
    out, fs, gs, counts, shift_q, shift_k = output
    ctx.save_for_backward(q, k, v, out, keep, bias, fs, gs, counts, shift_q, shift_k)
    ctx.schedule, ctx.backward = (batch, scale, n_iters, tol, max_iters), backward


def _first_derivatives(ctx, grad_out, backward):
    q, k, v, out, keep, bias, fs, gs, counts, shift_q, shift_k = ctx.saved_tensors
    return backward(grad_out, out, q, k, v, keep, bias, *ctx.schedule, fs, gs, counts, shift_q, shift_k,
                    ctx.backward)


def _second_derivatives(ctx, grad_out):
    from .dense import attention_grads_with_graph

    q, k, v, out, keep, bias, *_ = ctx.saved_tensors
    refuse_implicit_second_derivatives(ctx.backward, "flash")
    return attention_grads_with_graph(grad_out, Problem(q, k, v, keep, bias, *ctx.schedule))


_forward_autograd = register_engine_autograd(
    "sinkformer::flash_forward", "sinkformer::flash_backward", n_inputs=11, forward_impl=_forward_impl,
    backward_impl=_backward_impl,
    setup_context=_setup_context, first_derivatives=_first_derivatives, second_derivatives=_second_derivatives)
