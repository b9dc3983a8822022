"""Argument checks for the public entry points.

Every public function validates its inputs here, once, at the boundary; the code
behind it trusts its own types. Messages name the argument, what was expected and
what was given, so that a user can act on them without reading the source.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from ._capture import capturing, exact_path, patched

__all__ = [
    "check_tensor",
    "check_finite",
    "check_choice",
    "check_positive_int",
    "broadcastable",
    "broadcast_shapes",
    "compute_dtype",
    "check_qkv",
    "check_qkv_values",
    "check_scores_fit",
    "check_values_and_scores",
    "capturing",
    "data_checks_run",
    "require",
]


def _skip_data_checks(t: torch.Tensor | None = None) -> bool:
    """Whether a choice that depends on the data (e.g. "is any entry masked?") is left out: under
    graph capture it cannot be read, and on a GPU reading it would synchronise with the host. The
    caller then takes the form that is right either way (e.g. always applies the mask). Checks that
    refuse bad input use :func:`data_checks_run` and :func:`require` instead."""
    if capturing():
        return True
    return t is not None and t.device.type not in ("cpu", "meta")


def data_checks_run(t: torch.Tensor | None, *, on_gpus: bool = False) -> bool:
    """Whether a check of the values of ``t`` runs.

    On CPU tensors always: eagerly, and under graph capture as an assert in the graph
    (:func:`require`). On other devices only when ``on_gpus`` (the leak checks): reading a GPU
    tensor would synchronise with the host, so NaN and overflow scans are skipped there, as in
    PyTorch's own kernels (non-finite values then propagate)."""
    if t is None or (t.device.type == "meta" and not capturing()):
        return False
    return on_gpus or t.device.type == "cpu"


def require(ok: torch.Tensor, message: str, *, named: Callable[[], str] | None = None,
            exc: type[Exception] = ValueError) -> None:
    """Raise ``exc(message)`` unless the one-element bool tensor ``ok`` is True.

    Eagerly the tensor is read, and ``named`` (if given) is called on failure for a message that
    names values. Under graph capture the check is ``torch._assert_async(ok, message)`` in the
    graph, which ``torch.compile`` (every backend) and ``torch.export`` keep: the call then raises
    ``RuntimeError`` with ``message`` (on CUDA tensors: a device-side assert)."""
    if capturing():
        torch._assert_async(ok, message)
    elif not bool(ok):
        raise exc(named() if named is not None else message)


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

    Runs where :func:`data_checks_run` says (CPU tensors, eagerly and compiled); under graph
    capture each check is an assert in the graph (``RuntimeError`` with the same message)."""
    if not data_checks_run(x):
        return
    if not capturing() and x.numel() and _finite_at_a_glance(x, allow_neg_inf):  # the common case
        return
    require(~torch.isnan(x).any(), f"{name} contains NaN; expected finite values")
    kind = "+inf" if allow_neg_inf else "inf"
    bad = torch.isposinf(x) if allow_neg_inf else torch.isinf(x)
    require(~bad.any(), f"{name} contains {kind}; expected finite values")


def _finite_at_a_glance(x: torch.Tensor, allow_neg_inf: bool) -> bool:
    """Whether one reduction of non-empty ``x`` shows it free of NaN and +inf (and of -inf unless
    ``allow_neg_inf``): its sum is finite, or, with -inf allowed, its maximum is below +inf (a NaN
    propagates through both). A bool tensor's scan would cost more: on CPUs ``isnan(x).any()`` and
    ``isposinf(x).any()`` took 3.7 ms at (128, 96, 96), the maximum 0.2 ms (informal). False: look closer
    (a sum may also overflow)."""
    if allow_neg_inf:
        return bool(x.amax() < math.inf)
    return bool(torch.isfinite(x.sum()))


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


def broadcast_shapes(*shapes: Sequence[int]) -> torch.Size:
    """``torch.broadcast_shapes(*shapes)``, at once when the shapes are equal (the common case: q, k and v of
    one batch). torch's runs a Python reference implementation, tens of microseconds a call, paid on every
    attention call. Raises ``RuntimeError`` as torch's does when they do not broadcast."""
    first = tuple(shapes[0])
    if all(tuple(shape) == first for shape in shapes[1:]):
        return torch.Size(first)
    return torch.broadcast_shapes(*shapes)


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


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, values: bool = True) -> None:
    """Queries ``(..., n_q, d)``, keys ``(..., n_k, d)``, values ``(..., n_k, d_v)``: floating, one
    dtype, batch dimensions that broadcast, and (``values``) finite values (:func:`check_qkv_values`)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(t, name, min_dim=2, floating=True)
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same last dimension d, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k and v must have the same length n_k (dim -2), got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must have the same dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    try:
        broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    except RuntimeError:
        raise ValueError(
            f"q, k and v batch dimensions must broadcast, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        ) from None
    if values:
        check_qkv_values(q, k, v)


def check_qkv_values(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """``ValueError`` naming ``q``, ``k`` or ``v`` if it holds NaN or inf (where :func:`data_checks_run`)."""
    if not capturing() and all(map(data_checks_run, (q, k, v))) and bool(torch.isfinite(q.sum() + k.sum() + v.sum())):
        return  # one pass and one read for the common case (a sum that overflows: the checks below)
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_finite(t, name)


def check_values_and_scores(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                            bias: torch.Tensor | None = None) -> None:
    r""":func:`check_qkv_values` and then :func:`check_scores_fit` (``q``, ``k``: the compute dtype).

    Eagerly on the CPU without a bias, both in one read: the squared norms of the whole of ``q`` and ``k``
    (:func:`_squares`) are finite only where ``q`` and ``k`` are (NaN and inf propagate), and their roots
    bound every row norm, hence the scores (:math:`|S_{ij}| \le \mathrm{scale}\,\|q_i\|\|k_j\| \le
    \mathrm{scale}\,\|q\|_F\|k\|_F`), and ``v``'s sum is finite only where ``v`` is. One reduction over
    each whole tensor instead of row norms and their maximum: fewer operations
    (``benchmarks/results/ab_issue26_validation.md``: six fewer aten calls per call, no change in time
    resolved). Any doubt (a non-finite number, a bound over the limit, an empty operand) runs the two
    checks, which name what is wrong; :func:`check_scores_fit` bounds by the row
    norms, then by the scores themselves."""
    if bias is None and not capturing() and all(map(data_checks_run, (q, k, v))) and q.numel() and k.numel():
        q_squares, k_squares, total = torch.stack([_squares(q), _squares(k), v.detach().sum().to(q.dtype)]).tolist()
        limit = torch.finfo(q.dtype).max / SCORE_HEADROOM
        if (all(map(math.isfinite, (q_squares, k_squares, total)))
                and max(scale, 1.0) * math.sqrt(q_squares) * math.sqrt(k_squares) <= limit):
            return
    check_qkv_values(q, k, v)
    check_scores_fit(q, k, scale, bias)


def _squares(x: torch.Tensor) -> torch.Tensor:
    r""":math:`\|x\|_F^2`, one element (NaN or inf where ``x`` holds one): as a dot product where ``x`` is
    contiguous (BLAS, on every thread), else a norm."""
    x = x.detach()
    if x.is_contiguous():
        flat = x.view(-1)
        return torch.dot(flat, flat)
    return torch.linalg.vector_norm(x).square()


#: Scores (and their differences after the engines' shifts) must stay below ``finfo.max / SCORE_HEADROOM``.
SCORE_HEADROOM = 4.0
_SCORE_BLOCK = 1 << 22  # scores per block of the exact maximum


def check_scores_fit(q: torch.Tensor, k: torch.Tensor, scale: float, bias: torch.Tensor | None = None) -> None:
    r"""Raise ``ValueError`` when the scores :math:`S_{ij} = \mathrm{scale}\, q_i\cdot k_j + \mathrm{bias}_{ij}`
    of finite ``q (..., n_q, d)`` and ``k (..., n_k, d)`` (compute dtype) could overflow it.

    The engines shift scores by row and column maxima, so :math:`|S|` must stay below
    ``finfo.max / SCORE_HEADROOM``. The bound :math:`|S_{ij}| \le \max(\mathrm{scale}, 1)\,\|q_i\|\,\|k_j\|
    + |\mathrm{bias}_{ij}|` (Cauchy-Schwarz; the 1 covers ``q @ k`` formed before scaling) costs
    :math:`O(n d)`; only when it exceeds the limit are the scores formed (in blocks) and their true
    maximum checked. Runs where :func:`data_checks_run` says."""
    if not data_checks_run(q) or q.numel() == 0 or k.numel() == 0:
        return
    limit = torch.finfo(q.dtype).max / SCORE_HEADROOM
    # the largest norms in the compute dtype (one that overflows only sends the call to the exact check)
    q_norm, k_norm = (torch.linalg.vector_norm(x.detach(), dim=-1).amax().double() for x in (q, k))
    bound = max(scale, 1.0) * q_norm * k_norm
    if bias is not None and bias.numel():
        bound = bound + bias.detach().abs().amax().double()
    fits = bound <= limit
    operands = (q, k) if bias is None else (q, k, bias)
    if capturing() or not bool(fits):  # the true maximum only when the bound may overflow (under capture: in the graph)
        fits = patched(fits, ~fits, _scores_fit, *(x.detach() for x in operands), scale=scale, limit=limit)
    what = "scale * q.k" if bias is None else "scale * q.k + attn_mask"
    hint = "scale the queries or keys down, or pass a smaller scale"
    require(fits, f"the attention scores overflow {q.dtype}: |{what}| may exceed finfo.max / {SCORE_HEADROOM:g} = "
                  f"{limit:.3g}; {hint}",
            named=lambda: (f"the attention scores overflow {q.dtype}: |{what}| reaches "
                           f"{_largest_score(*operands, scale=scale).item():.3g} > finfo.max / {SCORE_HEADROOM:g} = "
                           f"{limit:.3g} (scale={scale:g}, largest |q_i| = {_largest_norm(q):.3g}, largest |k_j| = "
                           f"{_largest_norm(k):.3g}); {hint}"))


@exact_path
def _scores_fit(q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor | None = None, *, scale: float,
                limit: float) -> torch.Tensor:
    """Whether ``max |scale * (q @ k^T) + bias| <= limit`` (a 0-dim bool tensor)."""
    return _largest_score(q, k, bias, scale=scale) <= limit


def _largest_norm(x: torch.Tensor) -> float:
    return torch.linalg.vector_norm(x.detach().double(), dim=-1).max().item()


def _largest_score(q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor | None = None, *, scale: float) -> torch.Tensor:
    """``max |scale * (q @ k^T) + bias|`` in the dtype of ``q`` (inf when it overflows), in blocks of query rows."""
    batch = broadcast_shapes(q.shape[:-2], k.shape[:-2])
    n_q, n_k = q.shape[-2], k.shape[-2]
    rows = max(1, _SCORE_BLOCK // max(1, n_k * max(1, math.prod(batch))))
    largest = q.new_zeros(())
    for start in range(0, n_q, rows):
        block = scale * (q.detach()[..., start:start + rows, :] @ k.detach().transpose(-1, -2))
        if bias is not None:
            block = block + (bias.detach() if bias.shape[-2] == 1 else bias.detach()[..., start:start + rows, :])
        largest = torch.maximum(largest, block.abs().amax())
    return torch.nan_to_num(largest, nan=float("inf"), posinf=float("inf"))  # inf - inf in a product: an overflow too
