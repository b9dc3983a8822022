import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file

from sinkformer.cli import main
from sinkformer.configs import find_config, names
from sinkformer.data import load_dataset
from sinkformer.models import build_model
from sinkformer.training import Callback, train
from sinkformer.training.runner import DATASET_MODEL_DEFAULTS, check_config, resolve_config

TINY_VIT = ["--set", "model.patch_size=4", "--set", "model.dim=16", "--set", "model.depth=1",
            "--set", "model.num_heads=2", "--set", "model.dim_feedforward=32"]
TIMING = ("epoch_seconds", "samples_per_second", "eval_seconds")


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}


def _rows(path):
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in path.read_text().splitlines()]


def test_train_writes_metrics_checkpoints_weights_and_attention(tmp_path):
    data = load_dataset("digits")
    torch.manual_seed(0)
    model = build_model("vit", data.info, patch_size=4, dim=16, depth=1, num_heads=2, dim_feedforward=32)

    class Steps(Callback):
        seen: list = []

        def on_step_end(self, epoch, step, loss):
            self.seen.append((epoch, step))

    result = train(model, data, dict(epochs=2, batch_size=128, max_train_batches=3, max_eval_batches=2,
                                     record_attention=True, progress=False), out_dir=tmp_path, callbacks=[Steps()])
    assert Steps.seen == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert [row["epoch"] for row in result.history] == [1, 2]
    for key in ("train_loss", "train_acc", "test_loss", "test_acc", "epoch_seconds", "samples_per_second",
                "attn_colsum_cv"):
        assert key in result.final
    assert result.final["samples_per_second"] > 0 and 0 <= result.final["test_acc"] <= 1
    assert (tmp_path / "metrics.csv").read_text().splitlines()[0].startswith("epoch,lr,train_loss")
    assert len(_rows(tmp_path / "metrics.jsonl")) == 2
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["epoch_0002"]
    weights = load_file(tmp_path / "model.safetensors")
    torch.testing.assert_close(weights["classifier.weight"], model.classifier.weight)
    attention = load_file(tmp_path / "attention" / "epoch_0002.safetensors")
    # first training batch only: 128 images x 2 heads x 5 tokens (class token + 4 patches)
    assert attention["encoder.layers.0.self_attn"].shape == (128 * 2 * 5,)


def test_a_model_that_cannot_read_the_data_fails_before_training():
    data = load_dataset("digits")
    model = build_model("vit", {"n_classes": 10, "image_size": 16, "channels": 1}, patch_size=4, dim=8, depth=1,
                        num_heads=2)
    message = r"ViT cannot read a batch of this images dataset \(inputs images \(2, 1, 8, 8\)\)"
    with pytest.raises(ValueError, match=message):
        train(model, data, dict(epochs=1, progress=False))


RESUME_SCRIPT = textwrap.dedent(
    """
    import logging, os, signal, sys
    import torch
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    from sinkformer.training import Callback
    from sinkformer.training.runner import resolve_config, run_training

    out, mode = sys.argv[1], sys.argv[2]

    class KillMidEpoch(Callback):
        def on_step_end(self, epoch, step, loss):
            if epoch == 1 and step == 4:
                os.kill(os.getpid(), signal.SIGKILL)

    sets = ["model.patch_size=4", "model.dim=16", "model.depth=1", "model.num_heads=2", "model.dim_feedforward=32",
            "model.dropout=0.1", "train.epochs=3", "train.batch_size=64", "train.max_train_batches=8",
            "train.milestones=[2]", "train.progress=false"]
    config = resolve_config(model="vit", data="digits", sets=sets)
    run_training(config, out_dir=out, resume=mode == "resume", callbacks=[KillMidEpoch()] if mode == "kill" else [])
    """
)


@pytest.mark.slow  # the default suite stays under 15 minutes on 2 cores
def test_resume_after_sigkill_matches_an_uninterrupted_run(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(RESUME_SCRIPT)

    def run(out, mode):
        return subprocess.run([sys.executable, str(script), str(tmp_path / out), mode], env=_env(),
                              capture_output=True, text=True, timeout=300)

    reference = run("reference", "plain")
    assert reference.returncode == 0, reference.stderr
    killed = run("interrupted", "kill")
    assert killed.returncode == -signal.SIGKILL
    assert len(_rows(tmp_path / "interrupted" / "metrics.jsonl")) == 1  # killed during epoch 2
    assert [p.name for p in (tmp_path / "interrupted" / "checkpoints").iterdir()] == ["epoch_0001"]
    resumed = run("interrupted", "resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "sinkformer.training.loop: resuming from" in resumed.stderr  # logged at INFO
    assert _rows(tmp_path / "interrupted" / "metrics.jsonl") == _rows(tmp_path / "reference" / "metrics.jsonl")
    final, expected = (load_file(tmp_path / d / "model.safetensors") for d in ("interrupted", "reference"))
    assert all(torch.equal(final[k], expected[k]) for k in expected)


def test_ddp_on_two_processes_matches_one_process_on_the_global_batch(tmp_path):
    common = ["--model", "vit", "--data", "digits", *TINY_VIT, "--set", "model.dropout=0.0",
              "--set", "train.epochs=2", "--set", "train.batch_size=64", "--set", "train.max_train_batches=4",
              "--set", "train.max_eval_batches=2", "--set", "train.progress=false",
              "--set", "train.optimizer=sgd", "--set", "train.lr=0.1"]  # SGD: updates linear in the gradients
    ddp = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "-m", "sinkformer.cli", "train", *common, "--out", str(tmp_path / "ddp")],
        env=_env(), capture_output=True, text=True, timeout=300,
    )
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    assert main(["train", *common, "--out", str(tmp_path / "single")]) == 0
    assert "2 process(es)" in ddp.stderr  # logged (stderr) by the main process
    two, one = (load_file(tmp_path / d / "model.safetensors") for d in ("ddp", "single"))
    for key in one:
        torch.testing.assert_close(two[key], one[key], atol=1e-5, rtol=1e-4, msg=key)
    rows_two, rows_one = _rows(tmp_path / "ddp" / "metrics.jsonl"), _rows(tmp_path / "single" / "metrics.jsonl")
    for a, b in zip(rows_two, rows_one):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)
        assert a["test_acc"] == pytest.approx(b["test_acc"])


def test_cli_train_help_and_errors(capsys, tmp_path):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    for expected in ("--attention", "--n-iters", "--config", "set_transformer [points]", "n_iters=5",
                     "modelnet40_off [points, needs --data PATH]", "milestones=[]", "record_attention=False"):
        assert expected in text
    assert main(["train", "--model", "vit", "--data", "shapes3d"]) == 2
    assert "model 'vit' reads images but dataset 'shapes3d' gives points" in capsys.readouterr().err
    assert main(["train", "--model", "vit", "--data", "digits", "--set", "train.epochs=many"]) == 2
    assert "option epochs must be int" in capsys.readouterr().err
    assert main(["train", "--model", "vit", "--data", "digits", "--set", "lr=1"]) == 2
    assert "--set expects section.key=value" in capsys.readouterr().err
    assert main(["train", "--resume"]) == 2
    assert "--resume needs --out" in capsys.readouterr().err


def test_config_files_yaml_and_toml(tmp_path):
    (tmp_path / "a.yaml").write_text("model:\n  name: vit\n  dim: 16\ndata:\n  name: digits\ntrain:\n  lr: 1e-4\n")
    (tmp_path / "a.toml").write_text('[model]\nname = "vit"\ndim = 16\n[data]\nname = "digits"\n[train]\nlr = 1e-4\n')
    for file in ("a.yaml", "a.toml"):
        config = resolve_config(tmp_path / file, attention="softmax", sets=["model.dim=32"])
        plan = check_config(config)
        # what the file and the flags do not set comes from the defaults for the dataset
        assert plan.model_options == {**DATASET_MODEL_DEFAULTS["digits"], "dim": 32, "attention": "softmax"}
        assert set(plan.from_dataset) == set(DATASET_MODEL_DEFAULTS["digits"]) - {"dim"} and plan.train.lr == 1e-4
    (tmp_path / "bad.yaml").write_text("modle:\n  name: vit\n")
    with pytest.raises(ValueError, match="unknown section 'modle'; valid sections: model, data, train"):
        resolve_config(tmp_path / "bad.yaml")


def test_shipped_configs_are_valid():
    configs = [find_config(name) for name in names()]
    assert len(configs) >= 6
    for file in configs:
        check_config(resolve_config(file))


@pytest.mark.parametrize("model, data, attention", [
    ("sinkhorn_classifier", "sentiment", "sortcut:2x4"),
    ("sinkhorn_lm", "stdlib_text", "sparse:8"),
])
def test_cli_trains_the_sparse_sinkhorn_models(tmp_path, capsys, model, data, attention):
    """The Sparse Sinkhorn models are in the model registry: `sinkformer train` builds them by attention=."""
    common = ["--model", model, "--data", data, "--set", f"model.attention={attention}", "--set", "model.dim=16",
              "--set", "model.depth=1", "--set", "model.heads=2", "--set", "train.epochs=1",
              "--set", "train.max_train_batches=2", "--set", "train.max_eval_batches=1", "--set", "train.progress=false"]
    if data == "stdlib_text":
        common += ["--set", "data.seq_len=32", "--set", "data.max_chars=20000"]
    assert main(["train", *common, "--out", str(tmp_path / "run")]) == 0
    rows = _rows(tmp_path / "run" / "metrics.jsonl")
    assert len(rows) == 1 and rows[0]["train_loss"] > 0
    assert main(["train", *common, "--attention", "softmax", "--normalization", "sinkhorn"]) == 2
    assert "--normalization is the old name of --attention: give one of them" in capsys.readouterr().err


def test_cli_refuses_a_sparse_kind_for_a_dense_model(capsys):
    assert main(["train", "--model", "vit", "--dataset", "digits", "--attention", "sparse:8"]) == 2
    assert "attention must be one of ['softmax', 'sinkhorn'" in capsys.readouterr().err


def test_configs_are_found_by_name_or_path(tmp_path):
    shipped = find_config("pct_modelnet40")
    assert shipped.name == "pct_modelnet40.yaml" and shipped.is_file()
    assert find_config("pct_modelnet40.yaml") == shipped == find_config("configs/pct_modelnet40.yaml")
    own = tmp_path / "pct_modelnet40.yaml"
    own.write_text("model: {name: pct}\n")
    assert find_config(own) == own  # an existing path wins over the shipped name
    with pytest.raises(FileNotFoundError, match="did you mean 'pct_modelnet40'.*shipped: .*vit_cats_dogs"):
        find_config("pct_modelnet")


def _embedded_pairs():
    from sinkformer.data import DATASETS
    from sinkformer.models import MODELS

    return [(m, d) for d, spec in DATASETS.items() if spec.embedded for m, cls in MODELS.items()
            if cls.input_kind == spec.kind]


def test_every_model_runs_with_its_defaults_on_every_embedded_dataset_of_its_kind():
    """Before: `sinkformer train --model vit --dataset digits` failed (patch_size=16 on 8x8 images), as did
    vit_attention_only on digits and the Point Cloud Transformer on shapes3d (512 samples of 256 points)."""
    from sinkformer.data import load_dataset
    from sinkformer.training.distributed import setup_distributed
    from sinkformer.training.loop import _check_batch
    from sinkformer.training.runner import _build

    pairs, loaded, ctx = _embedded_pairs(), {}, setup_distributed("cpu")
    assert ("vit", "digits") in pairs and len(pairs) >= 10
    for model, dataset in pairs:
        plan = check_config({"model": {"name": model}, "data": {"name": dataset}})
        data = loaded.setdefault(dataset, load_dataset(dataset))
        net = _build(plan, data)
        _check_batch(net, data, ctx)  # one batch through the model
        assert sum(p.numel() for p in net.parameters()) < 600_000, (model, dataset)  # small models for small data
