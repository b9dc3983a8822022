"""``torch.nn`` modules built on :mod:`sinkformer.attention`."""

from .convert import convert
from .multihead import MultiheadAttention

__all__ = ["MultiheadAttention", "convert"]
