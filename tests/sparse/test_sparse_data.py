"""Data of the Sparse Sinkhorn experiments: sorting, LM text, pixel sequences, NLI — embedded and real formats."""

import json

import numpy as np
import pytest
import torch

from sinkformer.data.cifar10 import load_cifar10_pixels, load_digit_pixels, read_cifar10_batch
from sinkformer.data.nli import LABELS, SUBJECTS, generate_nli, load_generated_nli, load_nli
from sinkformer.data.sorting import OFFSET, edit_distance, load_sorting, load_sorting_tsv, sequence_metrics
from sinkformer.data.text import EOS_ID
from sinkformer.data.text_lm import BYTE_OFFSET, LMCollate, LMDataset, load_text_lm, python_stdlib_text

# --- sorting ---------------------------------------------------------------------------------------


def test_generated_sorting_trains_up_to_l_and_tests_up_to_2l():
    data = load_sorting(length=8, n_train=200, n_test=100, n_symbols=10)
    train_lengths = {len(data.train[i][0]) for i in range(200)}
    test_lengths = {len(data.test[i][0]) for i in range(100)}
    assert min(train_lengths) == 1 and max(train_lengths) == 8 and max(test_lengths) == 16 and len(test_lengths) > 10
    fixed = load_sorting(length=8, n_train=5, n_test=5, variable_length=False)
    assert {len(fixed.test[i][0]) for i in range(5)} == {16}
    src, tgt = data.train[3]
    assert tgt[0] == data.info["bos_id"] and tgt[-1] == data.info["eos_id"]
    assert tgt[1:-1].tolist() == sorted(src.tolist()) and int(src.min()) >= OFFSET
    inputs, targets = fixed.collate([fixed.train[0], fixed.train[1]])
    assert inputs["tgt"].shape == targets.shape == (2, 9)


def test_sorting_tsv_round_trip_and_errors(tmp_path):
    (tmp_path / "train.tsv").write_text("3 1 2\t1 2 3\n5 0\t0 5\n")
    (tmp_path / "test.tsv").write_text("9 8 7 6\t6 7 8 9\n")
    data = load_sorting_tsv(tmp_path)
    assert len(data.train) == 2 and data.info["n_symbols"] == 10 and data.info["max_len"] == 6
    assert data.test[0][1].tolist() == [1] + [OFFSET + s for s in (6, 7, 8, 9)] + [2]
    (tmp_path / "test.tsv").write_text("1 2 3\n")
    with pytest.raises(ValueError, match="test.tsv:1: expected 'integers<TAB>integers'"):
        load_sorting_tsv(tmp_path)
    with pytest.raises(FileNotFoundError, match="train.tsv and test.tsv"):
        load_sorting_tsv(tmp_path / "nowhere")


def test_edit_distance_and_sequence_metrics():
    assert edit_distance("kitten", "sitting") == 3 and edit_distance([], [1, 2]) == 2
    metrics = sequence_metrics([[1, 2, 3], [1, 2]], [[1, 2, 3], [1, 2, 4, 5]])
    assert metrics == {"exact_match": 50.0, "edit_distance": 2 / 7}


# --- language-model text -------------------------------------------------------------------------


def test_lm_windows_and_shifted_targets():
    ds = LMDataset(torch.arange(11), seq_len=3)
    assert len(ds) == 3 and ds[1].tolist() == [3, 4, 5, 6]
    inputs, targets = LMCollate()([ds[0], ds[1]])
    assert inputs["tokens"].tolist() == [[0, 1, 2], [3, 4, 5]] and targets.tolist() == [[1, 2, 3], [4, 5, 6]]
    with pytest.raises(ValueError, match="fewer than one window"):
        LMDataset(torch.arange(3), seq_len=5)


def test_char_level_reads_a_text_file_as_bytes(tmp_path):
    file = tmp_path / "corpus.txt"
    file.write_text("héllo world " * 50, encoding="utf-8")
    data = load_text_lm(file, level="char", seq_len=16, test_fraction=0.2)
    assert data.info["vocab_size"] == 256 + BYTE_OFFSET and data.info["unit"] == "byte"
    first = data.train[0]
    assert bytes((first - BYTE_OFFSET).tolist()).startswith("héllo".encode())


def test_lm1b_layout_uses_training_and_heldout_shards(tmp_path):
    (tmp_path / "training-monolingual.tokenized.shuffled").mkdir()
    (tmp_path / "heldout-monolingual.tokenized.shuffled").mkdir()
    (tmp_path / "training-monolingual.tokenized.shuffled" / "news.en-00001-of-00100").write_text("the cat sat .\na dog ran .\n" * 100)
    (tmp_path / "heldout-monolingual.tokenized.shuffled" / "news.en.heldout-00000-of-00050").write_text("the dog sat .\n" * 50)
    data = load_text_lm(tmp_path, level="word", seq_len=8, vocab_size=40)
    assert data.info["unit"] == "subword" and data.tokenizer is not None
    decoded = data.tokenizer.decode(data.test[0].tolist())
    assert "dog sat" in decoded and "cat" not in decoded
    assert EOS_ID in data.train[0].tolist()  # sentences end with <eos>


def test_embedded_text_is_the_standard_library_and_missing_paths_explain(tmp_path):
    text = python_stdlib_text(20_000)
    assert len(text) == 20_000 and ("import" in text or "def " in text)
    assert python_stdlib_text(20_000) == text
    with pytest.raises(FileNotFoundError, match="LM1B"):
        load_text_lm(tmp_path / "missing")
    with pytest.raises(ValueError, match="level must be one of"):
        load_text_lm(level="sentence")


# --- pixels ----------------------------------------------------------------------------------------


def _cifar_record(label, r, g, b):
    return bytes([label]) + bytes([r] * 1024) + bytes([g] * 1024) + bytes([b] * 1024)


def test_cifar10_binary_release_as_pixel_sequences(tmp_path):
    for i in range(1, 6):
        (tmp_path / f"data_batch_{i}.bin").write_bytes(_cifar_record(i, 10 * i, 7, 255) * 2)
    (tmp_path / "test_batch.bin").write_bytes(_cifar_record(3, 1, 2, 3))
    images, labels = read_cifar10_batch(tmp_path / "data_batch_2.bin")
    assert images.shape == (2, 32, 32, 3) and labels.tolist() == [2, 2]
    assert images[0, 5, 7].tolist() == [20, 7, 255]
    data = load_cifar10_pixels(tmp_path, max_train=3)
    assert len(data.train) == 3 and len(data.test) == 1
    seq = data.test[0]
    assert seq.shape == (3073,) and seq[:7].tolist() == [256, 1, 2, 3, 1, 2, 3]  # start, then R G B per pixel
    assert data.info["vocab_size"] == 257 and data.info["max_len"] == 3072
    (tmp_path / "test_batch.bin").write_bytes(b"\x00" * 100)
    with pytest.raises(ValueError, match="not a whole number of 3073-byte"):
        read_cifar10_batch(tmp_path / "test_batch.bin")
    with pytest.raises(FileNotFoundError, match="cifar-10-binary.tar.gz"):
        load_cifar10_pixels(tmp_path / "none")


def test_digit_pixels_are_17_levels_after_a_start_token():
    data = load_digit_pixels()
    rows = data.train.rows
    assert rows.shape[1] == 65 and torch.all(rows[:, 0] == 17)
    assert int(rows[:, 1:].min()) == 0 and int(rows[:, 1:].max()) == 16
    assert np.isclose(rows[:, 1:].float().mean().item(), 4.88, atol=0.1)  # the digits' known mean intensity


# --- NLI ---------------------------------------------------------------------------------------------


def test_generated_nli_is_balanced_and_joins_premise_and_hypothesis():
    _, _, labels = generate_nli(600, seed=0)
    assert np.bincount(labels, minlength=3).min() > 160
    data = load_generated_nli(n_train=200, n_test=20)
    ids, _ = data.train[0]
    assert (ids == EOS_ID).sum() == 1 and data.info["n_classes"] == 3


def test_generated_nli_labels_follow_the_premise():
    premises, hypotheses, labels = generate_nli(300, seed=1)
    for p, h, y in zip(premises, hypotheses, labels):
        facts = [f.split() for f in p.split(" , and ")]
        words = h.split()
        subject = next(w for w in words if w in SUBJECTS)
        about_subject = [f for f in facts if subject in f]
        restated = any(all(w in f for w in words) for f in about_subject)
        if LABELS[y] == "neutral":
            assert not about_subject
        else:
            assert len(about_subject) == 1 and restated == (LABELS[y] == "entailment"), (p, h, LABELS[y])


def test_snli_and_multinli_jsonl(tmp_path):
    rows = [
        {"sentence1": "A man plays a guitar.", "sentence2": "A man makes music.", "gold_label": "entailment"},
        {"sentence1": "A dog runs.", "sentence2": "A cat sleeps.", "gold_label": "contradiction"},
        {"sentence1": "Kids play.", "sentence2": "Kids play outside.", "gold_label": "-"},
        {"sentence1": "A woman reads.", "sentence2": "The book is long.", "gold_label": "neutral"},
    ]
    text = "\n".join(json.dumps(r) for r in rows)
    (tmp_path / "snli_1.0_train.jsonl").write_text(text)
    (tmp_path / "snli_1.0_test.jsonl").write_text(text)
    data = load_nli(tmp_path, vocab_size=60, max_len=12)
    assert len(data.train) == 3 and [data.train[i][1] for i in range(3)] == [0, 2, 1]
    assert all(len(data.train[i][0]) <= 12 and EOS_ID in data.train[i][0].tolist() for i in range(3))
    (tmp_path / "snli_1.0_train.jsonl").write_text('{"sentence1": "x"}\n')
    with pytest.raises(ValueError, match="snli_1.0_train.jsonl:1: expected a JSON object"):
        load_nli(tmp_path)
    mnli = tmp_path / "mnli"
    mnli.mkdir()
    (mnli / "multinli_1.0_train.jsonl").write_text(text)
    (mnli / "multinli_1.0_dev_matched.jsonl").write_text(text)
    assert len(load_nli(mnli, vocab_size=60).test) == 3
    with pytest.raises(FileNotFoundError, match="snli_1.0.zip"):
        load_nli(tmp_path / "empty")
