r"""The Set Transformer point-cloud classifier of the Sinkformers paper (§6.1, Appendix C.1).

.. math::

    Z = \mathrm{ISAB}_m(\mathrm{ISAB}_m(X)),\qquad
    \text{logits} = W\,\mathrm{SAB}(\mathrm{PMA}_1(Z)) + b

(encoder: two induced set attention blocks; decoder: pooling by multihead attention, a set
attention block and a linear layer, with dropout before PMA and before the classifier as in Lee
et al.'s ModelNet code). Paper: 5000 points, Adam, lr 1e-3 divided by 10 after 200 of 300
epochs, batch 64; the Set Sinkformer reaches 89.1 % (21 iterations) vs 87.8 %.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..nn.set_blocks import ISAB, PMA, SAB

__all__ = ["SetTransformerClassifier"]


class SetTransformerClassifier(torch.nn.Module):
    """Classify point clouds ``(batch, n, in_features)`` into ``n_classes`` (logits ``(batch, n_classes)``).

    Args:
        n_classes: number of classes.
        in_features: coordinates per point (3).
        dim: hidden width. num_heads: attention heads (divides ``dim``).
        num_inducing: inducing points per ISAB.
        layer_norm: LayerNorms inside the blocks (off in Lee et al.'s ModelNet model; it also
            trains faster without them here).
        dropout: dropout before PMA and before the classifier.
        normalization: attention normalisation of every block (``"softmax"`` = Set Transformer,
            ``"sinkhorn"`` = Set Sinkformer). n_iters: Sinkhorn iterations (paper: 21).
    """

    input_kind = "points"

    def __init__(
        self,
        n_classes: int,
        in_features: int = 3,
        *,
        dim: int = 256,
        num_heads: int = 4,
        num_inducing: int = 16,
        layer_norm: bool = False,
        dropout: float = 0.5,
        normalization: str = "sinkhorn",
        n_iters: int = 5,
    ) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim must be divisible by num_heads, got dim={dim}, num_heads={num_heads}")
        opts = dict(layer_norm=layer_norm, normalization=normalization, n_iters=n_iters)
        self.encoder = torch.nn.ModuleList(
            [ISAB(in_features, dim, num_heads, num_inducing, **opts), ISAB(dim, dim, num_heads, num_inducing, **opts)]
        )
        self.pool = PMA(dim, num_heads, 1, **opts)
        self.sab = SAB(dim, dim, num_heads, **opts)
        self.dropout = torch.nn.Dropout(dropout)
        self.classifier = torch.nn.Linear(dim, n_classes)

    def forward(self, points: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        z = points
        for block in self.encoder:
            z = block(z, padding_mask)
        pooled = self.pool(self.dropout(z), padding_mask)  # (batch, 1, dim)
        return self.classifier(self.dropout(self.sab(pooled))).squeeze(1)
