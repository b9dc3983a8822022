"""Which engine serves an attention call: the one table behind ``backend="auto"``.

Engines (one name per concept, the same in code, errors and docs):

=============  ====================================================================================
``"sdpa"``     PyTorch's fused ``scaled_dot_product_attention``: SoftMax, and Sinkhorn with
               ``n_iters=1`` (exactly SoftMax).
``"dense"``    the ``n_q × n_k`` weights materialised, autograd through the log-domain iterations
               (:mod:`sinkformer.sinkhorn.dense`, the reference): every normalisation and option,
               :math:`O(n_q n_k\\cdot n\\_iters)` memory when differentiated.
``"tiled"``    Sinkhorn on cached tiles with a custom backward (:mod:`sinkformer.sinkhorn.tiled`):
               :math:`O(n)` saved per slice; dropout and ``backward="implicit"``.
``"streamed"`` Sinkhorn streamed over row blocks (:mod:`sinkformer.sinkhorn.streamed`): never an
               ``n_q × n_k`` tile, for long sequences.
``"flash"``    fused Triton kernels (:mod:`sinkformer.sinkhorn.flash`): never an ``n_q × n_k``
               matrix, exact custom backward; CUDA tensors (CPU ones under Triton's interpreter).
``"causal"``   causal Sinkhorn (``is_causal=True``): row :math:`t` is row :math:`t` of the balanced
               prefix :math:`0..t` (:mod:`sinkformer.sinkhorn.prefix`). 2 or 3 iterations with at
               most key padding: row blocks, never an ``n × n`` matrix, custom backward
               (:mod:`sinkformer.sinkhorn.causal_blocks`); otherwise weights materialised,
               autograd, :math:`O(n^2)` for ``n_iters <= 3``; from 4 on :math:`O(n^3)` time (one
               log-sum-exp matrix product per further normalisation), which :func:`causal_cost`
               states and a one-time warning announces at sizes where it matters.
=============  ====================================================================================

:func:`choose` applies the rules of ``"auto"`` in order and checks a forced engine against
:func:`unsupported`; :func:`sinkformer.attention.explain` shows the result for a call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sinkhorn.flash import unavailable as flash_unavailable
from ..sinkhorn.problem import STREAM_ABOVE

__all__ = ["BACKENDS", "ENGINES", "Call", "Choice", "choose", "unsupported", "causal_cost"]

ENGINES = ("sdpa", "dense", "tiled", "streamed", "causal", "flash")
BACKENDS = ("auto",) + ENGINES


@dataclass(frozen=True)
class Call:
    """What the choice depends on (shapes, options), read off a validated call."""

    normalization: str
    n_iters: int | None
    tol: float | None
    n_q: int
    n_k: int
    return_weights: bool = False
    measure_weights: bool = False
    bias_requires_grad: bool = False
    dropout_p: float = 0.0
    backward: str = "unrolled"
    chunk_size: int | None = None
    causal: bool = False
    device: str = "cpu"
    #: what the flash kernels compile for: the dtype of q, its last dimension as the kernels see it
    #: (L2 cost: one more) and the value dimension; ``None`` where unknown (not checked then)
    dtype: torch.dtype | None = None
    head_dim: int | None = None
    value_dim: int | None = None

    @property
    def softmax(self) -> bool:
        """SoftMax exactly: ``"softmax"``, or Sinkhorn with one normalisation."""
        return self.normalization == "softmax" or (
            self.normalization == "sinkhorn" and self.tol is None and self.n_iters == 1
        )


@dataclass(frozen=True)
class Choice:
    """The engine that serves a call, and why."""

    engine: str
    reason: str

    def __str__(self) -> str:
        return f"{self.engine}: {self.reason}"


def unsupported(engine: str, call: Call) -> str | None:
    """Why ``engine`` cannot serve ``call`` (a sentence naming the argument), or ``None``."""
    if call.causal and not call.softmax and engine != "causal":
        return (f"is_causal=True with Sinkhorn attention (n_iters={call.n_iters}) is served by engine 'causal' only "
                f"(every prefix balanced on its own), not {engine!r}")
    if engine == "causal":
        return _unsupported_causal(call)
    if engine == "sdpa":
        if not call.softmax:
            what = f"normalization={call.normalization!r}"
            if call.normalization == "sinkhorn":
                what += f" with n_iters={call.n_iters}" if call.tol is None else f" with tol={call.tol}"
            return f"engine 'sdpa' computes SoftMax only (normalization='softmax' or n_iters=1), got {what}"
    elif engine in ("tiled", "streamed", "flash") and call.normalization != "sinkhorn":
        return (f"engine {engine!r} computes Sinkhorn attention, got normalization={call.normalization!r} "
                "(use backend='dense', or 'sdpa' for SoftMax)")
    if engine != "dense":
        if call.return_weights:
            return f"return_weights=True needs the n_q x n_k weights, which engine {engine!r} never forms; use backend='dense'"
        if call.measure_weights:
            return f"key_weights/query_weights are served by the dense engine only, not {engine!r}; use backend='dense'"
    if engine in ("tiled", "streamed", "flash") and call.bias_requires_grad:
        return (f"a float attn_mask that requires grad (a learned bias) is differentiated on the dense engine only, "
                f"not {engine!r}; use backend='dense' or detach the mask")
    if call.chunk_size is not None and engine != "streamed":
        return f"chunk_size is an option of the streamed engine, got chunk_size={call.chunk_size} with engine {engine!r}"
    if engine in ("streamed", "flash") and call.dropout_p > 0:
        return f"dropout_p={call.dropout_p} is not served by engine {engine!r}; use backend='tiled' or 'dense'"
    if call.backward == "implicit" and not call.softmax and engine not in ("tiled", "flash"):
        return (f"backward='implicit' is served by engines 'tiled' and 'flash' only, not {engine!r}; "
                "use backward='unrolled'")
    if engine == "flash":
        return flash_unavailable(call.device, call.dtype, call.head_dim, call.value_dim)
    return None


def _unsupported_causal(call: Call) -> str | None:
    if not call.causal:
        return "engine 'causal' serves is_causal=True only (each prefix balanced on its own); pass is_causal=True"
    if call.normalization != "sinkhorn" or call.softmax:
        return f"engine 'causal' computes causal Sinkhorn attention with n_iters >= 2, got normalization={call.normalization!r}" + (
            f" with n_iters={call.n_iters}" if call.normalization == "sinkhorn" else "")
    if call.measure_weights:
        return "key_weights/query_weights are served by the dense engine only, not 'causal'"
    if call.backward != "unrolled":
        return f"backward={call.backward!r} is not served by engine 'causal'; use backward='unrolled'"
    if call.chunk_size is not None:
        return f"chunk_size is an option of the streamed engine, got chunk_size={call.chunk_size} with engine 'causal'"
    return None


def choose(call: Call, backend: str = "auto") -> Choice:
    """The engine for ``call``: the rules of ``"auto"`` in order, or the forced ``backend``
    (``ValueError`` naming the argument when it cannot serve the call)."""
    if backend != "auto":
        why = unsupported(backend, call)
        if why is not None:
            raise ValueError(f"backend={backend!r} cannot serve this call: {why}")
        return Choice(backend, "forced by backend=" + (f"; {causal_cost(call)}" if backend == "causal" else ""))
    return _auto(call)


def _auto(call: Call) -> Choice:
    scores = call.n_q * call.n_k
    if call.normalization not in ("softmax", "sinkhorn"):
        return Choice("dense", f"normalization={call.normalization!r} is pointwise on the materialised scores")
    if call.causal and not call.softmax:
        why = _unsupported_causal(call)
        if why is not None:
            raise ValueError(f"is_causal=True with Sinkhorn attention cannot be served: {why}")
        return Choice("causal", "is_causal=True: every prefix 0..t balanced on its own, row t kept (zero leakage); "
                      + causal_cost(call))
    for flag, why in (
        (call.return_weights, "return_weights=True needs the n_q x n_k weights"),
        (call.measure_weights, "key_weights/query_weights (weighted point clouds) are served by the dense engine"),
    ):
        if flag:
            return _dense_fallback(call, why)
    if call.softmax:
        return Choice("sdpa", "SoftMax (n_iters=1 is exactly SoftMax) runs PyTorch's fused kernel")
    if call.bias_requires_grad:
        return _dense_fallback(call, "a float attn_mask that requires grad (a learned bias) is differentiated by autograd")
    if call.chunk_size is not None:
        why = unsupported("streamed", call)
        if why is not None:
            raise ValueError(f"chunk_size={call.chunk_size} asks for engine 'streamed', which cannot serve this call: {why}")
        return Choice("streamed", f"chunk_size={call.chunk_size} asks for row blocks (memory linear in the length)")
    not_flash = ""
    if call.device == "cuda":
        why = unsupported("flash", call)
        if why is None:
            return Choice("flash", "fused Triton kernels on CUDA: never an n_q x n_k matrix, O(n) saved per slice")
        not_flash = f" (not 'flash': {why})"
    if scores > STREAM_ABOVE and call.dropout_p == 0 and call.backward == "unrolled":
        return Choice("streamed", f"one slice has n_q*n_k = {scores} > 2^24 scores: never an n_q x n_k tile{not_flash}")
    return Choice("tiled", f"Sinkhorn on cached tiles, O(n) saved per slice{not_flash}")


def causal_cost(call: Call) -> str:
    """The cost class of causal Sinkhorn with ``call.n_iters`` normalisations (:mod:`sinkformer.sinkhorn.prefix`)."""
    if call.n_iters <= 3:
        return "O(n^2) time like SoftMax (2-3 iterations with at most key padding: row blocks, never an n x n matrix)"
    return (f"n_iters={call.n_iters} >= 4 costs O(n^3) time: each normalisation beyond the third is an n x n x n "
            "log-sum-exp matrix product per slice, with O(n^2 * n_iters) memory (n_iters <= 3 is O(n^2))")


def _dense_fallback(call: Call, why: str) -> Choice:
    if call.backward == "implicit" and not call.softmax:
        raise ValueError(
            f"backward='implicit' needs engine 'tiled', but {why} (engine 'dense'); use backward='unrolled'"
        )
    if call.chunk_size is not None:
        raise ValueError(f"chunk_size={call.chunk_size} needs engine 'streamed', but {why} (engine 'dense')")
    return Choice("dense", f"{why} (O(n_q*n_k*n_iters) memory when differentiated)")
