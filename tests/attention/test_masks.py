"""The mask layer (sinkformer.attention.masks): every convention an entry point accepts, read in one module."""

import pytest
import torch

from sinkformer.attention import masks
from sinkformer.attention.masks import (
    MASKING,
    additive_attn_mask,
    causal_key_padding,
    combine_masks,
    self_attention_mask,
    split_key_padding,
)


def test_combine_masks_reads_bool_and_additive_masks_and_padding():
    scores = (2, 3, 4)
    bias = torch.tensor([[0.5, -torch.inf, 0.0, -1e9]]).expand(3, 4)  # -1e9: masking under Sinkhorn
    keep, add = combine_masks(scores, attn_mask=bias, key_padding_mask=torch.tensor([[False] * 3 + [True]] * 2),
                              query_padding_mask=torch.tensor([[False, True, False]] * 2), dtype=torch.float32,
                              masked_from=MASKING)
    expected = torch.tensor([True, False, True, False]).expand(2, 3, 4) & torch.tensor([True, False, True])[:, None]
    assert torch.equal(keep.expand(scores), expected)
    assert add.expand(scores)[0, 0].tolist() == [0.5, 0.0, 0.0, 0.0]  # finite part only
    keep, add = combine_masks(scores, attn_mask=bias, key_padding_mask=None, query_padding_mask=None,
                              dtype=torch.float32)  # SoftMax reading: -1e9 is a bias, -inf masks
    assert keep.expand(scores)[0, 0].tolist() == [True, False, True, True]
    assert add.expand(scores)[0, 0, 3] == -1e9
    with pytest.raises(ValueError, match="attn_mask must broadcast to the score shape"):
        combine_masks(scores, attn_mask=torch.ones(5, dtype=torch.bool), key_padding_mask=None,
                      query_padding_mask=None, dtype=torch.float32)
    with pytest.raises(TypeError, match="attn_mask must be a bool or floating tensor"):
        combine_masks(scores, attn_mask=torch.ones(4, dtype=torch.int64), key_padding_mask=None,
                      query_padding_mask=None, dtype=torch.float32)


def test_torch_multihead_key_padding_as_padding_and_bias():
    pad = torch.tensor([[False, True, False]])
    assert split_key_padding(pad, 1, 3) == (pad, None)
    assert split_key_padding(None, 1, 3) == (None, None)
    additive = torch.tensor([[0.0, -torch.inf, 0.25]])
    padding, bias = split_key_padding(additive, 1, 3)
    assert padding.tolist() == [[False, True, False]]
    assert bias.shape == (1, 1, 1, 3) and bias.flatten().tolist() == [0.0, 0.0, 0.25]
    assert split_key_padding(torch.tensor([[0.0, -1e4, 0.0]]), 1, 3, MASKING)[0].tolist() == [[False, True, False]]
    assert split_key_padding(torch.tensor([[0.0, -torch.inf, 0.0]]), 1, 3)[1] is None  # no finite part left
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(batch, source_length\) = \(2, 3\)"):
        split_key_padding(pad, 2, 3)
    with pytest.raises(TypeError, match="key_padding_mask must be bool or float"):
        split_key_padding(pad.long(), 1, 3)


def test_torch_multihead_attn_mask_as_additive():
    forbid = torch.tensor([[False, True], [False, False], [True, False]])  # torch: True = not allowed
    mask = additive_attn_mask(forbid, 2, 4, 3, 2, torch.float64)
    assert mask.dtype == torch.float64 and torch.equal(torch.isneginf(mask), forbid)
    per_head = torch.randn(2 * 4, 3, 2)
    assert torch.equal(additive_attn_mask(per_head, 2, 4, 3, 2, torch.float32), per_head.reshape(2, 4, 3, 2))
    with pytest.raises(ValueError, match=r"2-D attn_mask must have shape \(3, 2\)"):
        additive_attn_mask(forbid.T, 2, 4, 3, 2, torch.float32)
    with pytest.raises(ValueError, match=r"3-D attn_mask must have shape \(8, 3, 2\)"):
        additive_attn_mask(per_head[:4], 2, 4, 3, 2, torch.float32)


def test_four_d_masks_of_transformers():
    keep = torch.ones(2, 1, 4, 4, dtype=torch.bool).tril()
    keep[0, ..., 0] = False  # sequence 0 is left-padded by one token
    assert causal_key_padding(keep, 4, 4).tolist() == [[True, False, False, False], [False] * 4]
    float_mask = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    assert torch.equal(causal_key_padding(float_mask, 4, 4), causal_key_padding(keep, 4, 4))
    full = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    full[..., 2] = False  # key 2 is padding: it is no query either
    assert self_attention_mask(full)[0, 0].tolist() == [[True, True, False]] * 2 + [[False] * 3]


def test_entry_points_read_their_masks_from_the_mask_layer():
    from sinkformer.nn import multihead

    assert multihead.split_key_padding is masks.split_key_padding
    assert multihead.additive_attn_mask is masks.additive_attn_mask
    hf = pytest.importorskip("sinkformer.integrations.huggingface")
    assert hf.self_attention_mask is masks.self_attention_mask and hf.causal_key_padding is masks.causal_key_padding
