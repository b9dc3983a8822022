"""nn/heads.py: the multi-head body every multi-head module goes through."""

import torch

from sinkformer.nn.heads import fused_self_attention, merge_heads, split_heads, split_qkv


def test_split_and_merge_are_inverse_and_keep_each_heads_channels_together():
    x = torch.arange(2 * 5 * 12, dtype=torch.float32).reshape(2, 5, 12)
    heads = split_heads(x, 3)
    assert heads.shape == (2, 3, 5, 4)
    assert torch.equal(heads[:, 1], x[..., 4:8])  # head 1 = channels 4..7
    assert torch.equal(merge_heads(heads), x)


def test_split_qkv_reads_q_then_k_then_v():
    x = torch.randn(2, 5, 3 * 12)
    q, k, v = split_qkv(x, 3)
    assert torch.equal(merge_heads(q), x[..., :12]) and torch.equal(merge_heads(v), x[..., 24:])
    assert torch.equal(merge_heads(k), x[..., 12:24])


def test_fused_self_attention_is_the_textbook_multi_head_body():
    torch.manual_seed(0)
    x, proj, out = torch.randn(2, 7, 12), torch.nn.Linear(12, 36), torch.nn.Linear(12, 12)
    got = fused_self_attention(x, proj, out, 3, torch.nn.functional.scaled_dot_product_attention)
    q, k, v = proj(x).split(12, -1)
    heads = [torch.softmax(q[..., i:i + 4] @ k[..., i:i + 4].mT / 2, -1) @ v[..., i:i + 4] for i in (0, 4, 8)]
    torch.testing.assert_close(got, out(torch.cat(heads, -1)), rtol=1e-5, atol=1e-6)
