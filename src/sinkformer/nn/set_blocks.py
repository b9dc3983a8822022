r"""Set Transformer blocks (Lee et al. 2019): MAB, SAB, ISAB and PMA, with switchable attention.

The multihead attention block between a query set :math:`X` (``n`` elements) and a key set
:math:`Y` (``m`` elements) is

.. math::

    H = \mathrm{LN}(X + \mathrm{Multihead}(X, Y, Y)),\qquad
    \mathrm{MAB}(X, Y) = \mathrm{LN}(H + \mathrm{rFF}(H)),\quad \mathrm{rFF}(h) = \mathrm{ReLU}(W h + b),

and the set operations built on it are

* :math:`\mathrm{SAB}(X) = \mathrm{MAB}(X, X)` — self-attention, an ``n × n`` matrix;
* :math:`\mathrm{ISAB}_m(X) = \mathrm{MAB}(X, H)`, :math:`H = \mathrm{MAB}(I, X)` with ``m``
  learned inducing points :math:`I` — two rectangular cross-attentions (``m × n`` then
  ``n × m``), linear in ``n``. With Sinkhorn, the ``m × n`` matrix has rows summing to 1 and
  columns to ``m / n`` (every point sends the same mass to the inducing points);
* :math:`\mathrm{PMA}_k(Z) = \mathrm{MAB}(S, \mathrm{rFF}(Z))` with ``k`` learned seeds — pooling
  (``rff=False``: :math:`\mathrm{MAB}(S, Z)`, as in Lee et al.'s and the Sinkformers authors' ModelNet
  code). With a single seed and Sinkhorn (``n_iters >= 2``) every element gets weight ``1/n``: the
  doubly stochastic ``1 × n`` matrix is the mean; ``normalization="softmax"`` on the PMA alone keeps a
  learned pooling.

``official=True`` computes the attention as the Sinkformers authors' ``MABSINK``/``MAB`` do (their
code, not the paper's text): scores :math:`QK^\top/\sqrt{d}` with :math:`d` the *model* width (not
the head width), no output projection, and Sinkhorn weights whose rows sum to :math:`1/n_q` (their
Sinkhorn uses the marginals :math:`1/n_q, 1/n_k` and does not rescale), a quirk that shrinks the
cross-attention outputs of ISAB by the number of queries.

Shapes: sets are ``(batch, n, dim)``; ``padding_mask (batch, n)`` bool, True = padding element.
The attention is :class:`sinkformer.nn.MultiheadAttention`; ``normalization`` and ``n_iters``
are passed to it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..attention import attention
from .heads import merge_heads, split_heads
from .multihead import MultiheadAttention

__all__ = ["MAB", "SAB", "ISAB", "PMA"]


class MAB(torch.nn.Module):
    """Multihead attention block ``MAB(X, Y)`` from ``dim_q``/``dim_k`` features to ``dim``.

    Queries are first mapped to ``dim`` by a linear layer when ``dim_q != dim`` (for the
    residual connection); keys/values of width ``dim_k`` are projected inside the attention.
    ``layer_norm=False`` drops both LayerNorms (as in Lee et al.'s ``ln=False``); ``official=True``
    the authors' attention (see the module docstring).
    """

    def __init__(
        self,
        dim_q: int,
        dim_k: int,
        dim: int,
        num_heads: int,
        *,
        layer_norm: bool = True,
        normalization: str = "sinkhorn",
        n_iters: int = 5,
        official: bool = False,
    ) -> None:
        super().__init__()
        self.official = official
        if official:  # the authors' MAB: fc_q/fc_k/fc_v, no output projection
            self.fc_q, self.fc_k, self.fc_v = (torch.nn.Linear(d, dim) for d in (dim_q, dim_k, dim_k))
            self.num_heads, self.normalization, self.n_iters = num_heads, normalization, n_iters
        else:
            self.fc_q = torch.nn.Linear(dim_q, dim) if dim_q != dim else torch.nn.Identity()
            self.attn = MultiheadAttention(
                dim, num_heads, kdim=dim_k, vdim=dim_k, batch_first=True, normalization=normalization, n_iters=n_iters
            )
        self.fc_o = torch.nn.Linear(dim, dim)
        self.ln0 = torch.nn.LayerNorm(dim) if layer_norm else torch.nn.Identity()
        self.ln1 = torch.nn.LayerNorm(dim) if layer_norm else torch.nn.Identity()

    def forward(
        self, x: Tensor, y: Tensor, key_padding_mask: Tensor | None = None, query_padding_mask: Tensor | None = None
    ) -> Tensor:
        """``x (batch, n, dim_q)`` attends to ``y (batch, m, dim_k)``; masks are ``(batch, m)`` / ``(batch, n)``.

        Padded queries are masked out of the whole attention matrix (their rows), so that they
        take no part in Sinkhorn's column normalisation either.
        """
        q = self.fc_q(x)
        if self.official:
            out = self._official_attention(q, y, key_padding_mask, query_padding_mask)
        else:
            attn_mask = None
            if query_padding_mask is not None:  # torch convention: True = not allowed, (batch*heads, n, m)
                n, m, heads = x.shape[1], y.shape[1], self.attn.num_heads
                attn_mask = query_padding_mask[:, None, :, None].expand(-1, heads, n, m).reshape(-1, n, m)
            out = self.attn(q, y, y, key_padding_mask=key_padding_mask, attn_mask=attn_mask, need_weights=False)[0]
        h = self.ln0(q + out)
        return self.ln1(h + torch.relu(self.fc_o(h)))

    def _official_attention(self, q: Tensor, y: Tensor, key_padding_mask, query_padding_mask) -> Tensor:
        """The authors' attention output ``A V`` (heads concatenated), ``(batch, n, dim)``."""
        k, v = split_heads(self.fc_k(y), self.num_heads), split_heads(self.fc_v(y), self.num_heads)
        out = attention(split_heads(q, self.num_heads), k, v, normalization=self.normalization, n_iters=self.n_iters,
                        scale=q.shape[-1] ** -0.5, key_padding_mask=key_padding_mask,
                        query_padding_mask=query_padding_mask)
        if self.normalization == "sinkhorn":  # their Sinkhorn's rows sum to 1 / n_q
            out = out / q.shape[1]
        return merge_heads(out)


class SAB(torch.nn.Module):
    """Set attention block ``SAB(X) = MAB(X, X)``: ``(batch, n, dim_in) -> (batch, n, dim)``."""

    def __init__(self, dim_in: int, dim: int, num_heads: int, **options) -> None:
        super().__init__()
        self.mab = MAB(dim_in, dim_in, dim, num_heads, **options)

    def forward(self, x: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        return self.mab(x, x, padding_mask, padding_mask)


class ISAB(torch.nn.Module):
    """Induced set attention block with ``num_inducing`` points: ``(batch, n, dim_in) -> (batch, n, dim)``."""

    def __init__(self, dim_in: int, dim: int, num_heads: int, num_inducing: int, **options) -> None:
        super().__init__()
        self.inducing = torch.nn.Parameter(torch.empty(1, num_inducing, dim))
        torch.nn.init.xavier_uniform_(self.inducing)
        self.mab0 = MAB(dim, dim_in, dim, num_heads, **options)  # inducing points attend to the set
        self.mab1 = MAB(dim_in, dim, dim, num_heads, **options)  # the set attends to the summary

    def forward(self, x: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        h = self.mab0(self.inducing.expand(x.shape[0], -1, -1), x, padding_mask)
        return self.mab1(x, h, query_padding_mask=padding_mask)


class PMA(torch.nn.Module):
    """Pooling by multihead attention with ``num_seeds`` seeds: ``(batch, n, dim) -> (batch, num_seeds, dim)``.

    ``rff=False`` pools the set itself rather than ``rFF(Z)`` (the authors' ModelNet code)."""

    def __init__(self, dim: int, num_heads: int, num_seeds: int = 1, *, rff: bool = True, **options) -> None:
        super().__init__()
        self.seeds = torch.nn.Parameter(torch.empty(1, num_seeds, dim))
        torch.nn.init.xavier_uniform_(self.seeds)
        self.rff = torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.ReLU()) if rff else torch.nn.Identity()
        self.mab = MAB(dim, dim, dim, num_heads, **options)

    def forward(self, z: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        return self.mab(self.seeds.expand(z.shape[0], -1, -1), self.rff(z), padding_mask)
