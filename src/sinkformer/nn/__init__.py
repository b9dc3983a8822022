"""``torch.nn`` modules built on :mod:`sinkformer.attention`."""

from .convert import convert
from .multihead import MultiheadAttention
from .layers import TransformerDecoder, TransformerDecoderLayer, TransformerEncoder, TransformerEncoderLayer
from .offset_attention import OffsetAttention
from .set_blocks import ISAB, MAB, PMA, SAB
from .sparse import (
    BaselineSelfAttention, DenseSinkhornSelfAttention, SortNet, SparseSinkhornAttention, SparseSinkhornCache,
)

__all__ = ["MultiheadAttention", "convert"]
__all__ += ["TransformerEncoderLayer", "TransformerDecoderLayer", "TransformerEncoder", "TransformerDecoder"]
__all__ += ["OffsetAttention", "MAB", "SAB", "ISAB", "PMA"]
__all__ += ["SortNet", "SparseSinkhornAttention", "SparseSinkhornCache", "BaselineSelfAttention",
            "DenseSinkhornSelfAttention"]
