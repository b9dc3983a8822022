r"""Point Cloud Transformer (Guo et al. 2021) with offset-attention switchable to Sinkhorn (§6.1).

Architecture (widths for the default ``dim=64``):

1. point embedding: two 1×1 convolutions ``3 -> 64 -> 64`` (BatchNorm, ReLU);
2. two neighbour-embedding stages: farthest point sampling to ``n_samples[s]`` centres, their
   ``k_neighbors`` nearest neighbours, features :math:`[f_j - f_c, f_c]` through two 1×1
   convolutions and a max over the neighbours (``128`` then ``256`` channels);
3. ``n_attention_layers`` offset-attention layers (:class:`sinkformer.nn.OffsetAttention`)
   on 256 channels, their outputs concatenated (``1024``) with the stage-2 features
   (``1280``), fused by a 1×1 convolution to 1024 and max-pooled over points;
4. classifier ``1024 -> 512 -> 256 -> n_classes`` with BatchNorm, LeakyReLU(0.2) and dropout.

``normalization="softmax"`` is PCT as published (row SoftMax then column L1 normalisation),
``"sinkhorn"`` the Point Cloud Sinkformer. Paper: 1024 points, SGD lr 1e-4 divided by 10 after
250 of 300 epochs, batch 32; 93.2 % / 93.1 % best test accuracy.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..nn.offset_attention import OffsetAttention
from .attention_spec import dense_attention

__all__ = ["PointCloudTransformer", "farthest_point_sample", "sample_and_group"]


def farthest_point_sample(xyz: Tensor, n_samples: int) -> Tensor:
    """Indices ``(batch, n_samples)`` of farthest point sampling on ``xyz (batch, n, 3)``.

    Starts from point 0 (deterministic) and repeatedly adds the point farthest from the chosen set.
    """
    batch, n, _ = xyz.shape
    chosen = torch.zeros(batch, n_samples, dtype=torch.long, device=xyz.device)
    dist = torch.full((batch, n), float("inf"), device=xyz.device, dtype=xyz.dtype)
    farthest = torch.zeros(batch, dtype=torch.long, device=xyz.device)
    rows = torch.arange(batch, device=xyz.device)
    for i in range(n_samples):
        chosen[:, i] = farthest
        centre = xyz[rows, farthest].unsqueeze(1)  # (batch, 1, 3)
        dist = torch.minimum(dist, (xyz - centre).square().sum(-1))
        farthest = dist.argmax(-1)
    return chosen


def _gather(x: Tensor, idx: Tensor) -> Tensor:
    """``x (batch, n, c)`` at ``idx (batch, ...)`` -> ``(batch, ..., c)``."""
    rows = torch.arange(x.shape[0], device=x.device).view(-1, *([1] * (idx.dim() - 1)))
    return x[rows, idx]


def sample_and_group(xyz: Tensor, features: Tensor, n_samples: int, k: int) -> tuple[Tensor, Tensor]:
    """PCT's neighbour grouping.

    Args:
        xyz: ``(batch, n, 3)`` coordinates. features: ``(batch, n, c)``.
    Returns:
        ``(centres (batch, n_samples, 3), grouped (batch, n_samples, k, 2c))`` where ``grouped``
        holds :math:`[f_j - f_c, f_c]` for the ``k`` nearest neighbours ``j`` of each centre ``c``.
    """
    idx = farthest_point_sample(xyz, n_samples)
    centres, centre_features = _gather(xyz, idx), _gather(features, idx)
    neighbours = torch.cdist(centres, xyz).topk(k, dim=-1, largest=False).indices  # (batch, s, k)
    grouped = _gather(features, neighbours) - centre_features.unsqueeze(2)
    return centres, torch.cat([grouped, centre_features.unsqueeze(2).expand_as(grouped)], dim=-1)


class _NeighbourEmbedding(torch.nn.Module):
    """PCT's ``Local_op``: two 1×1 convolutions on each neighbourhood, then a max over it."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Conv1d(in_channels, out_channels, 1, bias=False),
            torch.nn.BatchNorm1d(out_channels),
            torch.nn.ReLU(),
            torch.nn.Conv1d(out_channels, out_channels, 1, bias=False),
            torch.nn.BatchNorm1d(out_channels),
            torch.nn.ReLU(),
        )

    def forward(self, grouped: Tensor) -> Tensor:
        """``(batch, s, k, c_in) -> (batch, c_out, s)``."""
        b, s, k, c = grouped.shape
        x = self.net(grouped.reshape(b * s, k, c).transpose(1, 2))  # (b*s, c_out, k)
        return x.amax(-1).reshape(b, s, -1).transpose(1, 2)


def _conv_bn_relu(c_in: int, c_out: int) -> torch.nn.Sequential:
    return torch.nn.Sequential(
        torch.nn.Conv1d(c_in, c_out, 1, bias=False), torch.nn.BatchNorm1d(c_out), torch.nn.ReLU()
    )


class PointCloudTransformer(torch.nn.Module):
    """Classify point clouds ``(batch, n, in_features)``; logits ``(batch, n_classes)``.

    Args:
        n_classes: number of classes. in_features: coordinates per point (3).
        dim: base width (64 in PCT); every other width is a multiple of it.
        n_samples: centres of the two neighbour-embedding stages (PCT: 512, 256); need
            ``n >= n_samples[0] >= n_samples[1]``.
        k_neighbors: neighbours per centre (32).
        n_attention_layers: offset-attention layers (4).
        dropout: classifier dropout (0.5).
        attention: ``"softmax"`` (PCT) or ``"sinkhorn"`` (:mod:`~sinkformer.models.attention_spec`;
            ``normalization``: its old spelling). n_iters: Sinkhorn iterations; even by default (4),
            ending on a column normalisation like PCT's own (row SoftMax, then column L1), since
            offset-attention aggregates along columns.
    """

    input_kind = "points"

    def __init__(
        self,
        n_classes: int,
        in_features: int = 3,
        *,
        dim: int = 64,
        n_samples: tuple[int, int] | list[int] = (512, 256),
        k_neighbors: int = 32,
        n_attention_layers: int = 4,
        dropout: float = 0.5,
        attention: str = "sinkhorn",
        n_iters: int = 4,
        normalization: str | None = None,
    ) -> None:
        super().__init__()
        normalization, n_iters = dense_attention(attention, n_iters, old=normalization)
        if len(n_samples) != 2 or n_samples[1] > n_samples[0]:
            raise ValueError(f"n_samples must be two decreasing sizes like (512, 256), got {tuple(n_samples)}")
        if k_neighbors > n_samples[1]:
            raise ValueError(f"k_neighbors ({k_neighbors}) must be <= n_samples[1] ({n_samples[1]})")
        self.n_samples, self.k_neighbors = tuple(n_samples), k_neighbors
        width = 4 * dim
        self.embed = torch.nn.Sequential(_conv_bn_relu(in_features, dim), _conv_bn_relu(dim, dim))
        self.local0 = _NeighbourEmbedding(2 * dim, 2 * dim)
        self.local1 = _NeighbourEmbedding(4 * dim, width)
        self.pre_attention = torch.nn.Sequential(_conv_bn_relu(width, width), _conv_bn_relu(width, width))
        self.attention = torch.nn.ModuleList(
            OffsetAttention(width, normalization=normalization, n_iters=n_iters) for _ in range(n_attention_layers)
        )
        fused = 16 * dim
        self.fuse = torch.nn.Sequential(
            torch.nn.Conv1d(width * (n_attention_layers + 1), fused, 1, bias=False),
            torch.nn.BatchNorm1d(fused),
            torch.nn.LeakyReLU(0.2),
        )
        self.head = torch.nn.Sequential(
            torch.nn.Linear(fused, 8 * dim, bias=False),
            torch.nn.BatchNorm1d(8 * dim),
            torch.nn.LeakyReLU(0.2),
            torch.nn.Dropout(dropout),
            torch.nn.Linear(8 * dim, 4 * dim),
            torch.nn.BatchNorm1d(4 * dim),
            torch.nn.LeakyReLU(0.2),
            torch.nn.Dropout(dropout),
            torch.nn.Linear(4 * dim, n_classes),
        )

    def forward(self, points: Tensor) -> Tensor:
        if points.shape[1] < self.n_samples[0]:
            raise ValueError(
                f"point clouds have {points.shape[1]} points but n_samples[0] is {self.n_samples[0]}; "
                "lower n_samples or load more points"
            )
        xyz = points[..., :3]
        x = self.embed(points.transpose(1, 2)).transpose(1, 2)  # (batch, n, dim)
        xyz, grouped = sample_and_group(xyz, x, self.n_samples[0], self.k_neighbors)
        x = self.local0(grouped).transpose(1, 2)  # (batch, s0, 2 dim)
        _, grouped = sample_and_group(xyz, x, self.n_samples[1], self.k_neighbors)
        features = self.local1(grouped)  # (batch, 4 dim, s1)
        x = self.pre_attention(features)
        outputs = []
        for layer in self.attention:
            x = layer(x)[0]
            outputs.append(x)
        x = self.fuse(torch.cat(outputs + [features], dim=1)).amax(-1)
        return self.head(x)
