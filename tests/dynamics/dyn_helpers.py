"""Shared set-ups of the dynamics cross-validation tests (docs/theory.md §5 conventions)."""

import math

import torch

D64 = torch.float64


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rand_params(d=3, k=3, s=0.5, g=None):
    """Random (Q, K, V) with i.i.d. N(0, s^2) entries, as in docs/theory.md §5."""
    return tuple(s * torch.randn(*shape, dtype=D64, generator=g) for shape in ((k, d), (k, d), (d, d)))


def rand_gaussian(d=3, g=None, scale=0.6, floor=0.2):
    """A mean and a well-conditioned covariance."""
    mean = 0.5 * torch.randn(d, dtype=D64, generator=g)
    W = scale * torch.randn(d, d, dtype=D64, generator=g)
    return mean, W @ W.T + floor * torch.eye(d, dtype=D64)


def sample(mean, cov, shape, g):
    """``shape + (d,)`` samples of N(mean, cov)."""
    L = torch.linalg.cholesky(cov)
    return mean + torch.randn(*shape, mean.shape[0], dtype=D64, generator=g) @ L.T


def rel(a, b):
    return float((a - b).norm() / b.norm())


def slope(ns, errs):
    """Least-squares slope of log(err) against log(N)."""
    x = torch.tensor([math.log(n) for n in ns], dtype=D64)
    y = torch.tensor([math.log(e) for e in errs], dtype=D64)
    x = x - x.mean()
    return float((x * (y - y.mean())).sum() / (x * x).sum())
