import math

import pytest
import torch

from sinkformer.nn import MultiheadAttention
from sinkformer.nn.layers import (
    TransformerDecoder,
    TransformerDecoderLayer,
    TransformerEncoder,
    TransformerEncoderLayer,
    sinusoidal_positions,
)
from sinkformer.nn.offset_attention import OffsetAttention
from sinkformer.nn.set_blocks import ISAB, PMA, SAB
from sinkformer.sinkhorn import sinkhorn


@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_layer_with_softmax_is_torchs_layer(norm_first):
    ours = TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True, norm_first=norm_first,
                                   normalization="softmax")
    theirs = torch.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True, norm_first=norm_first)
    theirs.load_state_dict(ours.state_dict())  # same parameter names and shapes
    assert isinstance(ours.self_attn, MultiheadAttention)
    x = torch.randn(3, 7, 16)
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[1, 5:] = True
    ours.eval(), theirs.eval()
    out, ref = ours(x, src_key_padding_mask=pad), theirs(x, src_key_padding_mask=pad)
    valid = ~pad
    torch.testing.assert_close(out[valid], ref[valid], atol=1e-5, rtol=1e-5)


def test_decoder_layer_is_causal_softmax_like_torchs():
    ours = TransformerDecoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    theirs = torch.nn.TransformerDecoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    theirs.load_state_dict(ours.state_dict())
    tgt, memory = torch.randn(2, 5, 16), torch.randn(2, 6, 16)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(5)
    torch.testing.assert_close(
        ours(tgt, memory, tgt_is_causal=True), theirs(tgt, memory, tgt_mask=causal), atol=1e-5, rtol=1e-5
    )


def test_decoder_stack_does_not_look_ahead():
    decoder = TransformerDecoder(16, 2, 2, dim_feedforward=32, dropout=0.0).eval()
    tgt, memory = torch.randn(1, 6, 16), torch.randn(1, 4, 16)
    changed = tgt.clone()
    changed[:, 4:] = torch.randn(1, 2, 16)
    torch.testing.assert_close(decoder(tgt, memory)[:, :4], decoder(changed, memory)[:, :4])


def test_encoder_stack_layers_start_from_different_weights():
    encoder = TransformerEncoder(8, 2, 2, dim_feedforward=16)
    w0, w1 = (layer.self_attn.in_proj_weight for layer in encoder.layers)
    assert not torch.equal(w0, w1)


def test_sinkhorn_encoder_ignores_padding():
    torch.manual_seed(1)
    encoder = TransformerEncoder(8, 2, 2, dim_feedforward=16, dropout=0.0, normalization="sinkhorn", n_iters=5).eval()
    x = torch.randn(1, 4, 8)
    padded = torch.cat([x, torch.randn(1, 3, 8)], dim=1)
    pad = torch.tensor([[False] * 4 + [True] * 3])
    torch.testing.assert_close(encoder(padded, pad)[:, :4], encoder(x), atol=1e-5, rtol=1e-5)


def test_sinusoidal_positions_formula():
    table = sinusoidal_positions(50, 8)
    p, i = 17, 3
    assert table[p, 2 * i].item() == pytest.approx(math.sin(p / 10000 ** (2 * i / 8)), abs=1e-6)
    assert table[p, 2 * i + 1].item() == pytest.approx(math.cos(p / 10000 ** (2 * i / 8)), abs=1e-6)


def test_isab_inducing_attention_is_rectangular_sinkhorn():
    torch.manual_seed(0)
    block = ISAB(3, 8, 2, num_inducing=4, normalization="sinkhorn", n_iters=51)
    x = torch.randn(2, 10, 3)
    inducing = block.inducing.expand(2, -1, -1)
    _, weights = block.mab0.attn(inducing, x, x, average_attn_weights=False)
    assert weights.shape == (2, 2, 4, 10)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 2, 4), atol=1e-5, rtol=0)
    torch.testing.assert_close(weights.sum(-2), torch.full((2, 2, 10), 4 / 10), atol=1e-4, rtol=0)


def test_pma_with_one_seed_and_sinkhorn_is_mean_pooling():
    block = PMA(8, 2, 1, normalization="sinkhorn", n_iters=2)
    z = block.rff(torch.randn(3, 6, 8))
    _, weights = block.mab.attn(block.seeds.expand(3, -1, -1), z, z)
    torch.testing.assert_close(weights, torch.full((3, 1, 6), 1 / 6))


def test_sab_is_permutation_equivariant_and_ignores_padding():
    torch.manual_seed(0)
    block = SAB(3, 8, 2, normalization="sinkhorn", n_iters=7)
    x = torch.randn(1, 5, 3)
    perm = torch.randperm(5)
    torch.testing.assert_close(block(x)[:, perm], block(x[:, perm]), atol=1e-5, rtol=1e-5)
    padded = torch.cat([x, torch.zeros(1, 2, 3)], dim=1)
    pad = torch.tensor([[False] * 5 + [True] * 2])
    torch.testing.assert_close(block(padded, pad)[:, :5], block(x), atol=1e-5, rtol=1e-5)


def test_offset_attention_softmax_is_two_sinkhorn_normalisations():
    torch.manual_seed(0)
    layer = OffsetAttention(8, normalization="softmax")
    x = torch.randn(2, 8, 6)
    energy = layer.q_conv(x).transpose(1, 2) @ layer.k_conv(x)
    torch.testing.assert_close(layer.attention_matrix(x), sinkhorn(energy, 2), atol=1e-6, rtol=1e-5)
    assert layer.k_conv.weight is layer.q_conv.weight


def test_offset_attention_sinkhorn_is_doubly_stochastic():
    layer = OffsetAttention(8, normalization="sinkhorn", n_iters=41)
    weights = layer.attention_matrix(torch.randn(2, 8, 6))
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 6), atol=1e-5, rtol=0)
    torch.testing.assert_close(weights.sum(-2), torch.ones(2, 6), atol=1e-4, rtol=0)
    out, returned = layer(torch.randn(2, 8, 6), need_weights=True)
    assert out.shape == (2, 8, 6) and returned.shape == (2, 6, 6)


def test_isab_ignores_padding():
    torch.manual_seed(0)
    block = ISAB(3, 8, 2, num_inducing=3, normalization="sinkhorn", n_iters=7)
    x = torch.randn(2, 5, 3)
    padded = torch.cat([x, torch.randn(2, 4, 3)], dim=1)
    pad = torch.zeros(2, 9, dtype=torch.bool)
    pad[:, 5:] = True
    torch.testing.assert_close(block(padded, pad)[:, :5], block(x), atol=1e-5, rtol=1e-5)
