"""The Set Sinkformer as the authors' code builds it, with the pooling ablation and their attention quirks."""

import math

import pytest
import torch

from sinkformer.models import build_model
from sinkformer.nn.set_blocks import MAB, PMA


def model(**options):
    torch.manual_seed(0)
    base = dict(n_classes=5, dim=16, num_heads=2, num_inducing=4, dropout=0.0, n_iters=5)
    return build_model("set_transformer", None, **{**base, **options}).eval()


def test_the_default_is_the_authors_modelnet_model():
    net = model()
    assert isinstance(net.pool.rff, torch.nn.Identity)  # PMA pools the set itself
    assert isinstance(net.encoder[0].mab0.ln0, torch.nn.LayerNorm)  # layer norms on
    assert not hasattr(net, "sab")  # head: dropout, PMA, dropout, linear
    assert net(torch.randn(3, 20, 3)).shape == (3, 5)


def test_sinkhorn_pooling_is_the_mean_and_the_softmax_pooling_option_is_not():
    """One seed: a doubly stochastic 1 x n matrix is uniform, so the Sinkhorn PMA outputs the mean."""
    torch.manual_seed(1)
    pma = PMA(8, 2, 1, rff=False, normalization="sinkhorn", n_iters=2, layer_norm=False)
    z = torch.randn(2, 7, 8)
    weights = pma.mab.attn(pma.mab.fc_q(pma.seeds.expand(2, -1, -1)), z, z, average_attn_weights=False)[1]
    torch.testing.assert_close(weights, torch.full_like(weights, 1 / 7))
    net_same, net_soft = model(pool_attention="same"), model(pool_attention="softmax")
    assert net_same.pool.mab.attn.normalization == "sinkhorn"
    assert net_soft.pool.mab.attn.normalization == "softmax" and net_soft.encoder[0].mab0.attn.normalization == "sinkhorn"
    with pytest.raises(ValueError, match="pool_attention must be one of"):
        model(pool_attention="mean")


@pytest.mark.parametrize("normalization", ["softmax", "sinkhorn"])
def test_official_attention_is_the_authors_mab(normalization):
    """Scores over sqrt(model width), no output projection, Sinkhorn rows summing to 1/n_q."""
    torch.manual_seed(2)
    mab = MAB(8, 8, 8, 2, layer_norm=False, normalization=normalization, n_iters=3, official=True)
    x, y = torch.randn(2, 4, 8), torch.randn(2, 6, 8)
    q, k, v = mab.fc_q(x), mab.fc_k(y), mab.fc_v(y)
    split = lambda t: torch.cat(t.split(4, 2), 0)  # noqa: E731  (their head split)
    scores = split(q) @ split(k).transpose(1, 2) / math.sqrt(8)
    if normalization == "softmax":
        A = torch.softmax(scores, -1)
    else:
        A = torch.exp(scores)
        for it in range(3):  # their marginals: rows 1/n_q, columns 1/n_k
            A = A / A.sum(-1, keepdim=True) / 4 if it % 2 == 0 else A / A.sum(-2, keepdim=True) / 6
    out = torch.cat((split(q) + A @ split(v)).split(2, 0), 2)
    want = out + torch.relu(mab.fc_o(out))
    torch.testing.assert_close(mab(x, y), want, atol=1e-5, rtol=0)
    net = model(official_attention=True)
    assert net(torch.randn(2, 10, 3)).shape == (2, 5)


def test_vit_with_the_authors_head_width():
    """dim 32 with 2 heads of 24: the inner width 48 is decoupled from dim; both variants share parameters."""
    models = []
    for attention in ("softmax", "sinkhorn"):
        torch.manual_seed(0)
        models.append(build_model("vit", {"n_classes": 3, "image_size": 8, "channels": 1}, patch_size=4, dim=32,
                                  depth=2, num_heads=2, head_dim=24, dim_feedforward=16, attention=attention,
                                  n_iters=3))
    assert models[0].encoder[0].to_qkv.weight.shape == (3 * 48, 32)
    assert all(torch.equal(a, b) for a, b in zip(models[0].state_dict().values(), models[1].state_dict().values()))
    images = torch.randn(5, 1, 8, 8)
    assert models[1](images).shape == (5, 3)
    assert not torch.allclose(models[0](images), models[1](images))  # the attention normalisation differs
