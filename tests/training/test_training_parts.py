import math
import random

import numpy as np
import pytest
import torch

from sinkformer.models import build_model
from sinkformer.nn import MultiheadAttention
from sinkformer.training import AttentionRecorder, TrainConfig
from sinkformer.training.batches import epoch_batches, shard
from sinkformer.training.checkpoint import (
    capture_rng,
    latest_checkpoint,
    load_checkpoint,
    load_weights,
    restore_rng,
    save_checkpoint,
    save_weights,
)
from sinkformer.training.schedules import build_optimizer, learning_rate, set_learning_rate, steps_per_epoch


def test_step_decay_as_in_the_paper():
    config = TrainConfig(lr=1e-3, milestones=(35, 41), gamma=0.1)  # the MNIST patch-size study
    assert learning_rate(config, 0, 0) == pytest.approx(1e-3)
    assert learning_rate(config, 34, 10_000) == pytest.approx(1e-3)
    assert learning_rate(config, 35, 0) == pytest.approx(1e-4)
    assert learning_rate(config, 44, 0) == pytest.approx(1e-5)


def test_inverse_sqrt_with_warmup():
    config = TrainConfig(lr=5e-4, schedule="inverse_sqrt", warmup_steps=4000)
    assert learning_rate(config, 0, 0) == pytest.approx(5e-4 / 4000)
    assert learning_rate(config, 0, 1999) == pytest.approx(5e-4 / 2)
    assert learning_rate(config, 0, 3999) == pytest.approx(5e-4)
    assert learning_rate(config, 3, 15_999) == pytest.approx(5e-4 * math.sqrt(4000 / 16_000))


def test_schedule_offset_continues_the_inverse_sqrt_schedule_at_lr_over_10():
    train = TrainConfig(lr=5e-4, schedule="inverse_sqrt", warmup_steps=4000)
    assert train.schedule_offset == 0  # the default: the schedule starts at step 1
    t0 = 12_000  # fine-tuning after 12,000 steps of training, at lr / 10
    tune = TrainConfig(lr=5e-5, schedule="inverse_sqrt", warmup_steps=4000, schedule_offset=t0)
    for k in (1, 2, 3, 1000):  # the k-th fine-tuning step (0-based step k - 1)
        assert learning_rate(tune, 0, k - 1) == pytest.approx(5e-5 * math.sqrt(4000 / (t0 + k)))
        assert learning_rate(tune, 5, k - 1) == pytest.approx(learning_rate(train, 0, t0 + k - 1) / 10)
    early = TrainConfig(lr=5e-4, schedule="inverse_sqrt", warmup_steps=4000, schedule_offset=1000)
    assert learning_rate(early, 0, 0) == pytest.approx(learning_rate(train, 0, 1000))  # still warming up
    step = TrainConfig(lr=1e-3, milestones=(3,), warmup_steps=10, schedule_offset=20)
    assert learning_rate(step, 2, 0) == pytest.approx(1e-3) and learning_rate(step, 3, 0) == pytest.approx(1e-4)
    with pytest.raises(ValueError, match="schedule_offset must be >= 0, got -1"):
        TrainConfig.from_dict({"schedule_offset": -1})


def test_a_run_with_schedule_offset_takes_the_lr_of_the_shifted_steps(monkeypatch):
    from sinkformer.data import load_dataset
    from sinkformer.training import loop, train

    lrs = []

    def recording(optimizer, lr):  # the optimizer's lr for each step of the run
        set_learning_rate(optimizer, lr)
        lrs.append(optimizer.param_groups[0]["lr"])

    monkeypatch.setattr(loop, "set_learning_rate", recording)
    data = load_dataset("digits")
    config = TrainConfig(epochs=2, batch_size=64, max_train_batches=3, max_eval_batches=1, lr=1e-4,
                         schedule="inverse_sqrt", warmup_steps=4, schedule_offset=10, progress=False)
    assert steps_per_epoch(len(data.train), config) == 3
    assert steps_per_epoch(130, TrainConfig(batch_size=64)) == 3
    assert steps_per_epoch(129, TrainConfig(batch_size=64), world_size=2) == 2  # a batch of 1 for 2 processes: skipped
    torch.manual_seed(0)
    model = build_model("vit", data.info, patch_size=4, dim=8, depth=1, num_heads=2, dim_feedforward=8)
    result = train(model, data, config)
    expected = [1e-4 * math.sqrt(4 / (10 + k)) for k in range(1, 7)]  # 2 epochs of 3 steps, after 10 steps
    assert lrs == pytest.approx(expected)
    assert [row["lr"] for row in result.history] == pytest.approx([expected[2], expected[5]])


def test_train_config_mistakes_name_the_option():
    with pytest.raises(ValueError, match="unknown option.*learning_rate.*valid options: epochs=10"):
        TrainConfig.from_dict({"learning_rate": 1e-3})
    with pytest.raises(TypeError, match="option epochs must be int"):
        TrainConfig.from_dict({"epochs": "ten"})
    with pytest.raises(ValueError, match="optimizer must be one of \\['adam', 'adamw', 'sgd'\\], got 'rmsprop'"):
        TrainConfig.from_dict({"optimizer": "rmsprop"})
    with pytest.raises(ValueError, match="milestones must be positive epoch numbers"):
        TrainConfig.from_dict({"milestones": [0.5]})
    config = TrainConfig.from_dict({"lr": "1e-4", "milestones": [200], "betas": [0.9, 0.98]})  # YAML's '1e-4'
    assert config.lr == 1e-4 and config.milestones == (200,) and config.betas == (0.9, 0.98)
    assert isinstance(build_optimizer([torch.nn.Parameter(torch.zeros(1))], TrainConfig(optimizer="sgd")),
                      torch.optim.SGD)


@pytest.mark.parametrize("name,cls", [("adam", torch.optim.Adam), ("adamw", torch.optim.AdamW)])
def test_adam_takes_the_fused_kernel_with_the_same_steps(name, cls):
    torch.manual_seed(0)
    weights = [torch.randn(40, 8), torch.randn(8)]
    config = TrainConfig(optimizer=name, lr=1e-2, weight_decay=0.01)
    fused = [torch.nn.Parameter(w.clone()) for w in weights]
    plain = [torch.nn.Parameter(w.clone()) for w in weights]
    optimizer = build_optimizer(fused, config)
    reference = cls(plain, lr=1e-2, betas=config.betas, weight_decay=0.01)
    assert isinstance(optimizer, cls) and optimizer.defaults["fused"] == (torch.__version__ >= "2.4")  # CPU kernels
    for _ in range(5):
        grads = [torch.randn_like(w) for w in weights]
        for params, opt in ((fused, optimizer), (plain, reference)):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
    for a, b, w in zip(fused, plain, weights):
        assert not torch.equal(a, w)
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_epoch_batches_are_a_seeded_permutation():
    batches = epoch_batches(10, 4, seed=1, epoch=2)
    assert [len(b) for b in batches] == [4, 4, 2] and sorted(sum(batches, [])) == list(range(10))
    assert batches == epoch_batches(10, 4, seed=1, epoch=2)
    assert batches != epoch_batches(10, 4, seed=1, epoch=3)
    assert epoch_batches(5, 2, seed=0, epoch=0, shuffle=False) == [[0, 1], [2, 3], [4]]


@pytest.mark.parametrize("size,world", [(8, 2), (7, 3), (3, 3), (5, 1)])
def test_shards_split_a_batch_exactly(size, world):
    batch = list(range(100, 100 + size))
    parts = [shard(batch, r, world) for r in range(world)]
    assert sum(parts, []) == batch and max(map(len, parts)) - min(map(len, parts)) <= 1


def test_rng_capture_and_restore():
    state = capture_rng()
    expected = (torch.rand(3), np.random.rand(3), random.random())
    torch.rand(5), np.random.rand(5), random.random()
    restore_rng(state)
    torch.testing.assert_close(torch.rand(3), expected[0])
    np.testing.assert_array_equal(np.random.rand(3), expected[1])
    assert random.random() == expected[2]


def _tiny_pct():
    info = {"kind": "points", "n_classes": 3, "in_features": 3}
    return build_model("point_cloud_transformer", info, dim=8, n_samples=(8, 4), k_neighbors=2, n_attention_layers=1)


def test_weights_round_trip_with_shared_tensors(tmp_path):
    torch.manual_seed(0)
    model, other = _tiny_pct(), _tiny_pct()
    save_weights(model, tmp_path / "w.safetensors")
    load_weights(other, tmp_path / "w.safetensors")
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), name
    layer = other.attention[0]
    assert layer.k_conv.weight is layer.q_conv.weight  # still one shared parameter
    (tmp_path / "bad.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="cannot load weights from .*bad.safetensors"):
        load_weights(other, tmp_path / "bad.safetensors")


def test_checkpoints_are_atomic_folders_and_keep_the_newest(tmp_path):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    folder = tmp_path / "checkpoints"
    for epoch in (1, 2):
        save_checkpoint(folder, epoch, model, optimizer, {"global_step": 10 * epoch, "history": [{"epoch": epoch}],
                                                          "rng": [capture_rng()]})
    (folder / ".tmp-epoch_0003-99").mkdir()  # what a run killed while writing leaves behind
    assert sorted(p.name for p in folder.iterdir()) == [".tmp-epoch_0003-99", "epoch_0002"]
    assert latest_checkpoint(folder) == folder / "epoch_0002"
    fresh = torch.nn.Linear(3, 2)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.1)
    state = load_checkpoint(folder / "epoch_0002", fresh, fresh_opt)
    assert state["epoch"] == 2 and state["global_step"] == 20 and state["history"] == [{"epoch": 2}]
    torch.testing.assert_close(fresh.weight, model.weight)
    moments = (opt.state_dict()["state"][0]["exp_avg"] for opt in (fresh_opt, optimizer))
    torch.testing.assert_close(*moments)
    assert latest_checkpoint(tmp_path / "none") is None


def test_checkpoint_state_is_loaded_without_arbitrary_unpickling(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("unpickled!",))

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    path = save_checkpoint(tmp_path, 1, model, optimizer, {"payload": Evil()})
    with pytest.raises(ValueError, match="cannot load training state from .*state.pt"):
        load_checkpoint(path, model, optimizer)


def test_attention_recorder_records_column_sums_and_leaves_no_hooks():
    torch.manual_seed(0)
    info = {"kind": "images", "n_classes": 3, "image_size": 8, "channels": 1}
    model = build_model("vit", info, patch_size=2, dim=8, depth=2, num_heads=2, dim_feedforward=16,
                        attention="softmax").eval()
    attention = [m for m in model.modules() if isinstance(m, MultiheadAttention)]
    own_hooks = [dict(m._forward_pre_hooks) for m in attention]
    x = torch.randn(3, 1, 8, 8)
    with AttentionRecorder(model) as recorder:
        out = model(x)
    torch.testing.assert_close(out, model(x))  # recording does not change the output
    sums = recorder.column_sums()
    assert list(sums) == ["encoder.layers.0.self_attn", "encoder.layers.1.self_attn"]
    h = model.patches(x)
    h = torch.cat([model.cls_token.expand(3, -1, -1), h], 1) + model.positions
    layer = model.encoder.layers[0]
    _, weights = layer.self_attn(layer.norm1(h), layer.norm1(h), layer.norm1(h), average_attn_weights=False)
    torch.testing.assert_close(sums["encoder.layers.0.self_attn"], weights.sum(-2).flatten())
    assert recorder.coefficient_of_variation() > 0.01  # SoftMax: columns do not all sum to 1
    assert all(not m._forward_hooks and dict(m._forward_pre_hooks).keys() == own.keys()
               for m, own in zip(attention, own_hooks))


def test_attention_recorder_sees_doubly_stochastic_sinkhorn_and_offset_attention():
    torch.manual_seed(0)
    info = {"kind": "images", "n_classes": 3, "image_size": 8, "channels": 1}
    model = build_model("vit_attention_only", info, patch_size=2, dim=8, attention="sinkhorn", n_iters=61)
    with AttentionRecorder(model) as recorder:
        model(torch.randn(2, 1, 8, 8))
    assert recorder.coefficient_of_variation() < 1e-3
    pct = _tiny_pct().eval()
    with AttentionRecorder(pct) as recorder:
        pct(torch.randn(2, 16, 3))
    assert list(recorder.column_sums()) == ["attention.0"] and recorder.column_sums()["attention.0"].shape == (8,)
