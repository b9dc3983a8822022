"""Functions of symmetric matrices, batched over leading dimensions (float64 in, float64 out)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

__all__ = ["f64", "sym_fn", "sym_sqrt", "sym_inv_sqrt", "sym_pinv_sqrt", "single_threaded"]


def f64(t) -> Tensor:
    """``t`` (tensor, array or number) as a float64 tensor."""
    return torch.as_tensor(t, dtype=torch.float64)


@contextmanager
def single_threaded() -> Iterator[None]:
    """Run torch single-threaded inside the block (restored after).

    Loops over tiny matrices (Gaussian moment ODEs) are dominated by waking the intra-op thread pool:
    on a shared 2-core machine a batched 2x2 ``linalg.solve`` took 8 ms threaded and 0.02 ms in one
    thread, which made a rank-histogram run 28 s instead of 2 s.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def sym_fn(S: Tensor, fn: Callable[[Tensor], Tensor]) -> Tensor:
    """:math:`U f(\\Lambda) U^\\top` for symmetric ``S = U \\Lambda U^T`` (symmetrised first)."""
    lam, U = torch.linalg.eigh((S + S.transpose(-1, -2)) / 2)
    return (U * fn(lam).unsqueeze(-2)) @ U.transpose(-1, -2)


def sym_sqrt(S: Tensor) -> Tensor:
    """Symmetric PSD square root :math:`S^{1/2}` (negative rounding eigenvalues clipped to 0)."""
    return sym_fn(S, lambda lam: lam.clamp_min(0).sqrt())


def sym_inv_sqrt(S: Tensor) -> Tensor:
    """:math:`S^{-1/2}` of a positive definite ``S``."""
    return sym_fn(S, torch.rsqrt)


def sym_pinv_sqrt(S: Tensor) -> Tensor:
    """:math:`(S^{1/2})^+`: inverse square root on the range of ``S``, 0 on its kernel."""

    def fn(lam: Tensor) -> Tensor:
        cut = 1e-13 * lam.abs().amax(-1, keepdim=True)
        return torch.where(lam > cut, lam.clamp_min(torch.finfo(lam.dtype).tiny).rsqrt(), torch.zeros_like(lam))

    return sym_fn(S, fn)
