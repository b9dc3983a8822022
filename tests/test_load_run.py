"""A run folder holds everything needed to use its model: ``sinkformer.load_run`` and ``predict``."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import sinkformer
from sinkformer.data import load_dataset
from sinkformer.load import LoadedRun, logits
from sinkformer.training.runner import resolve_config, run_training

SENTENCES = ["the plot was not very good", "a superb film", "the music is truly charming",
             "honestly , the acting was never boring but the ending was awful", ""]
COMMON = ["train.epochs=1", "train.batch_size=32", "train.progress=false", "train.max_eval_batches=1"]


def _train(tmp_path, model, data, sets):
    config = resolve_config(model=model, data=data, sets=[*sets, *COMMON])
    result = run_training(config, out_dir=tmp_path / "run")
    return result, config


def _in_memory(result, config, data):
    """The model as training left it, with the dataset's own tokenizer and info (nothing read back)."""
    return LoadedRun(result.model.eval(), data.tokenizer, config, data.info)


RELOAD = textwrap.dedent(
    """
    import json, sys
    import sinkformer
    from sinkformer.load import logits

    run = sinkformer.load_run(sys.argv[1])
    texts = json.loads(sys.argv[2])
    assert not run.model.training
    print(json.dumps({"labels": sinkformer.predict(run, texts), "logits": logits(run, texts).tolist()}))
    """
)


def test_a_text_classifier_reloads_in_a_new_process_with_the_same_predictions(tmp_path):
    sets = ["model.dim=16", "model.depth=1", "model.num_heads=2", "model.dim_feedforward=32",
            "data.n_train=400", "data.n_test=100"]
    result, config = _train(tmp_path, "text_classifier", "sentiment", sets)
    run_dir = tmp_path / "run"
    assert {"config.yaml", "data_info.json", "tokenizer.json", "model.safetensors"} <= {p.name for p in run_dir.iterdir()}
    data = load_dataset("sentiment", n_train=400, n_test=100)
    here = _in_memory(result, config, data)
    expected_labels, expected_logits = sinkformer.predict(here, SENTENCES), logits(here, SENTENCES)
    assert set(expected_labels) <= {"negative", "positive"}

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", RELOAD, str(run_dir), json.dumps(SENTENCES)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reloaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert reloaded["labels"] == expected_labels
    torch.testing.assert_close(torch.tensor(reloaded["logits"]), expected_logits, atol=1e-5, rtol=1e-5)

    run = sinkformer.load_run(run_dir)
    assert run.predict(SENTENCES[0]) == expected_labels[0]  # one input, one label
    assert run.info["class_names"] == ["negative", "positive"] and run.tokenizer is not None
    assert "text_classifier on sentiment" in repr(run)
    # the checkpoint of epoch 1 holds the same weights
    assert sinkformer.predict(sinkformer.load_run(run_dir, epoch=1), SENTENCES) == expected_labels
    # a folder of an older version (no data_info.json / tokenizer.json): the dataset is loaded once instead
    (run_dir / "data_info.json").unlink()
    (run_dir / "tokenizer.json").unlink()
    with pytest.warns(UserWarning, match="has no data_info.json: loading dataset 'sentiment'"):
        old = sinkformer.load_run(run_dir)
    assert sinkformer.predict(old, SENTENCES) == expected_labels


def test_a_translation_model_reloads_and_translates_the_same(tmp_path):
    sets = ["model.dim=16", "model.encoder_layers=1", "model.decoder_layers=1", "model.num_heads=2",
            "model.dim_feedforward=32", "data.n_train=300", "data.n_test=20", "data.max_len=16",
            "train.max_train_batches=3", "train.bleu_samples=4"]
    result, config = _train(tmp_path, "seq2seq", "translation", sets)
    data = load_dataset("translation", n_train=300, n_test=20, max_len=16)
    sources = ["the small dog sees a red ball", "a cat likes the old tree near the house"]
    expected = sinkformer.predict(_in_memory(result, config, data), sources)
    assert all(isinstance(s, str) for s in expected)
    run = sinkformer.load_run(tmp_path / "run")
    assert sinkformer.predict(run, sources) == expected
    assert sinkformer.predict(run, sources[1]) == expected[1]


def test_an_image_model_reloads_and_names_the_same_classes(tmp_path):
    sets = ["model.patch_size=4", "model.dim=16", "model.depth=1", "model.num_heads=2", "model.dim_feedforward=32",
            "train.max_train_batches=4"]
    result, config = _train(tmp_path, "vit", "digits", sets)
    data = load_dataset("digits")
    images = torch.stack([data.test[i][0] for i in range(6)])  # (6, 1, 8, 8)
    expected = sinkformer.predict(_in_memory(result, config, data), images)
    run = sinkformer.load_run(tmp_path / "run")
    assert run.tokenizer is None
    assert sinkformer.predict(run, images) == expected and set(expected) <= {str(d) for d in range(10)}
    assert sinkformer.predict(run, images[0]) == expected[0]  # one (C, H, W) image, one label
    assert sinkformer.predict(run, list(images)) == expected
    with pytest.raises(ValueError, match=r"reads images of shape \(C, H, W\) = \(1, 8, 8\), got \(3, 8, 8\)"):
        sinkformer.predict(run, torch.zeros(3, 8, 8))


def test_load_run_errors_name_the_folder_and_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such run folder"):
        sinkformer.load_run(tmp_path / "missing")
    with pytest.raises(ValueError, match="is not a run folder: it has no config.yaml"):
        sinkformer.load_run(tmp_path)
    sets = ["model.patch_size=4", "model.dim=16", "model.depth=1", "model.num_heads=2", "model.dim_feedforward=32",
            "train.max_train_batches=1"]
    _train(tmp_path, "vit", "digits", sets)
    run_dir = tmp_path / "run"
    with pytest.raises(FileNotFoundError, match=r"no checkpoint of epoch 3 \(checkpoints kept: 1\)"):
        sinkformer.load_run(run_dir, epoch=3)
    weights = run_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match=f"cannot load weights from {weights}: the file is incomplete"):
        sinkformer.load_run(run_dir)
    weights.unlink()  # a run that has not finished: its newest checkpoint
    with pytest.warns(UserWarning, match="has not finished"):
        run = sinkformer.load_run(run_dir)
    assert run.weights == run_dir / "checkpoints" / "epoch_0001" / "model.safetensors"


def test_the_predict_command_classifies_sentences_and_refuses_other_runs(tmp_path, capsys):
    from sinkformer.cli import main

    sets = ["model.dim=16", "model.depth=1", "model.num_heads=2", "model.dim_feedforward=32",
            "data.n_train=200", "data.n_test=50"]
    _train(tmp_path, "text_classifier", "sentiment", sets)
    run = sinkformer.load_run(tmp_path / "run")
    texts = ["a superb film", "the plot was not very good"]
    capsys.readouterr()
    assert main(["predict", str(tmp_path / "run"), *texts]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"{t}\t{label}" for t, label in zip(texts, sinkformer.predict(run, texts))]
    config = resolve_config(model="vit", data="digits", sets=["model.patch_size=4", "model.dim=8", "model.depth=1",
                                                                "model.num_heads=2", "model.dim_feedforward=8", *COMMON])
    run_training(config, out_dir=tmp_path / "images")
    assert main(["predict", str(tmp_path / "images"), "a sentence"]) == 2
    err = capsys.readouterr().err
    assert "sinkformer predict: error:" in err and "'images' run" in err and "sinkformer.load_run" in err
