"""Argument checks for the public entry points.

Every public function validates its inputs here, once, at the boundary; the code
behind it trusts its own types. Messages name the argument, what was expected and
what was given, so that a user can act on them without reading the source.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "check_tensor",
    "check_finite",
    "check_choice",
    "check_positive_int",
    "broadcastable",
    "compute_dtype",
    "check_qkv",
]


def _skip_data_checks(t: torch.Tensor | None = None) -> bool:
    """Data-dependent checks (NaN scans) would break graph capture, and on a GPU they would
    synchronise with the host: skip them there (non-finite values then propagate, as in
    PyTorch's own kernels)."""
    if torch.jit.is_tracing() or torch.compiler.is_compiling():
        return True
    return t is not None and t.device.type not in ("cpu", "meta")


def check_tensor(
    x: object,
    name: str,
    *,
    min_dim: int | None = None,
    ndim: int | None = None,
    floating: bool = False,
    dtype_bool: bool = False,
) -> torch.Tensor:
    """Raise ``TypeError``/``ValueError`` unless ``x`` is a tensor of the required kind."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if floating and not x.is_floating_point():
        raise TypeError(f"{name} must have a floating dtype (float16/bfloat16/float32/float64), got {x.dtype}")
    if dtype_bool and x.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor, got {x.dtype}")
    if min_dim is not None and x.dim() < min_dim:
        raise ValueError(
            f"{name} must have at least {min_dim} dimensions, got shape {tuple(x.shape)} ({x.dim()} dimensions)"
        )
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name} must have exactly {ndim} dimensions, got shape {tuple(x.shape)}")
    return x


def check_finite(x: torch.Tensor, name: str, *, allow_neg_inf: bool = False) -> None:
    """Raise ``ValueError`` if ``x`` holds NaN (or +inf; -inf too unless ``allow_neg_inf``).

    Skipped under graph capture and for GPU tensors (see :func:`_skip_data_checks`)."""
    if _skip_data_checks(x):
        return
    if not allow_neg_inf and bool(torch.isfinite(x.sum())):  # one cheap pass in the common case
        return
    if torch.isnan(x).any():
        raise ValueError(f"{name} contains NaN; expected finite values")
    bad = torch.isposinf(x) if allow_neg_inf else torch.isinf(x)
    if bad.any():
        kind = "+inf" if allow_neg_inf else "inf"
        raise ValueError(f"{name} contains {kind}; expected finite values")


def check_choice(value: object, name: str, choices: Sequence[str]) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
    return value  # type: ignore[return-value]


def check_positive_int(value: object, name: str, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= {minimum}, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value}")
    return value


def broadcastable(shape: Sequence[int], target: Sequence[int]) -> bool:
    """Whether ``shape`` broadcasts to ``target`` (without changing ``target``)."""
    if len(shape) > len(target):
        return False
    for s, t in zip(reversed(shape), reversed(target)):
        if s != 1 and s != t:
            return False
    return True


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Internal arithmetic precision: float32 at least, float64 when given."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Queries ``(..., n_q, d)``, keys ``(..., n_k, d)``, values ``(..., n_k, d_v)``: floating, one
    dtype, batch dimensions that broadcast, finite values."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(t, name, min_dim=2, floating=True)
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same last dimension d, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k and v must have the same length n_k (dim -2), got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must have the same dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    try:
        torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    except RuntimeError:
        raise ValueError(
            f"q, k and v batch dimensions must broadcast, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        ) from None
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_finite(t, name)
