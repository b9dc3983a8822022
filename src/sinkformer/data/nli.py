r"""Natural language inference as one sequence: premise ``<eos>`` hypothesis (§5.4, Table 7).

As in the paper's Tensor2Tensor setup, premise and hypothesis are concatenated into a single
input and classified into ``entailment`` / ``neutral`` / ``contradiction`` by an encoder — so
the model must relate words far apart in one long sequence. Token ids come from a BPE
vocabulary learned on the training sentences (:func:`sinkformer.data.text.train_tokenizer`);
``<eos>`` (id 2) separates the two parts; the premise is cut first when a pair exceeds
``max_len``.

* **Embedded**: a generated task. A premise lists ``n_facts`` facts about distinct subjects
  (``"the big dog ran in the park"``). The hypothesis restates one fact, possibly without its
  adjective (**entailment**); changes the verb, place or adjective of one subject
  (**contradiction**: each subject does one thing); or speaks of a subject the premise does not
  mention (**neutral**). Classes are balanced; no single word gives the label away.
* **Real**: the SNLI 1.0 (``snli_1.0_{train,test}.jsonl``) or MultiNLI 1.0
  (``multinli_1.0_{train,dev_matched}.jsonl``, tested on matched dev) JSONL releases, fields
  ``sentence1``, ``sentence2``, ``gold_label``; pairs without a gold label (``"-"``) are skipped.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

import torch

from .base import DataBundle, TokenCollate, require_path
from .text import EOS_ID, PAD_ID, TextClassificationDataset, train_tokenizer

__all__ = ["LABELS", "generate_nli_pair", "generate_nli", "read_nli_jsonl", "nli_bundle", "load_generated_nli", "load_nli"]

LABELS = ("entailment", "neutral", "contradiction")

SUBJECTS = ["cat", "dog", "bird", "man", "woman", "child", "horse", "boy", "girl", "teacher", "farmer", "doctor",
            "baker", "singer", "pilot", "student"]
ADJECTIVES = ["red", "big", "small", "old", "young", "happy", "tall", "black", "quiet", "brave"]
VERBS = ["sat", "ran", "slept", "played", "waited", "ate", "sang", "read"]
PLACES = ["on the mat", "in the park", "near the river", "at home", "under the tree", "in the kitchen", "by the door",
          "on the hill", "in the garden", "at school"]

INSTRUCTIONS = (
    "Pass the extracted snli_1.0 folder (https://nlp.stanford.edu/projects/snli/snli_1.0.zip) or multinli_1.0 "
    "folder (https://cims.nyu.edu/~sbowman/multinli/multinli_1.0.zip) holding the .jsonl files."
)
RELEASES = {"snli": ("snli_1.0_train.jsonl", "snli_1.0_test.jsonl"),
            "multinli": ("multinli_1.0_train.jsonl", "multinli_1.0_dev_matched.jsonl")}


def _fact(adjective: str | None, subject: str, verb: str, place: str) -> str:
    return " ".join(w for w in ("the", adjective, subject, verb, place) if w)


def generate_nli_pair(rng: random.Random, n_facts: tuple[int, int] = (3, 6)) -> tuple[str, str, int]:
    """One ``(premise, hypothesis, label)`` of the generated task (label indexes :data:`LABELS`)."""
    subjects = rng.sample(SUBJECTS, rng.randint(*n_facts) + 1)
    absent = subjects.pop()
    facts = [(rng.choice(ADJECTIVES), s, rng.choice(VERBS), rng.choice(PLACES)) for s in subjects]
    premise = " , and ".join(_fact(*f) for f in facts)
    label = rng.randrange(3)
    adjective, subject, verb, place = rng.choice(facts)
    keep_adjective = rng.random() < 0.5
    if label == 0:  # entailment: one fact, perhaps less specific
        hypothesis = _fact(adjective if keep_adjective else None, subject, verb, place)
    elif label == 1:  # neutral: a subject the premise does not mention
        hypothesis = _fact(rng.choice([None, rng.choice(ADJECTIVES)]), absent, rng.choice(VERBS), rng.choice(PLACES))
    else:  # contradiction: the same subject doing something else
        what = rng.choice(["verb", "place", "adjective"])
        keep_adjective = rng.random() < 0.25  # with the adjective changes below: adjectives in half the hypotheses
        if what == "verb":
            verb = rng.choice([v for v in VERBS if v != verb])
        elif what == "place":
            place = rng.choice([p for p in PLACES if p != place])
        else:
            adjective, keep_adjective = rng.choice([a for a in ADJECTIVES if a != adjective]), True
        hypothesis = _fact(adjective if keep_adjective else None, subject, verb, place)
    return premise, hypothesis, label


def generate_nli(n: int, seed: int, n_facts: tuple[int, int] = (3, 6)) -> tuple[list[str], list[str], list[int]]:
    rng = random.Random(seed)
    triples = [generate_nli_pair(rng, n_facts) for _ in range(n)]
    return [t[0] for t in triples], [t[1] for t in triples], [t[2] for t in triples]


def read_nli_jsonl(file: str | Path, max_examples: int = 0) -> tuple[list[str], list[str], list[int]]:
    """Premises, hypotheses and labels of an SNLI/MultiNLI ``.jsonl`` file (gold label ``-`` skipped)."""
    premises, hypotheses, labels = [], [], []
    with open(file, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                gold, s1, s2 = row["gold_label"], row["sentence1"], row["sentence2"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise ValueError(f"{file}:{number}: expected a JSON object with sentence1, sentence2, gold_label ({err})") from None
            if gold not in LABELS:
                continue
            premises.append(s1)
            hypotheses.append(s2)
            labels.append(LABELS.index(gold))
            if max_examples and len(labels) >= max_examples:
                break
    if not labels:
        raise ValueError(f"{file}: no labelled pairs")
    return premises, hypotheses, labels


def _encode_pairs(tokenizer, premises: Sequence[str], hypotheses: Sequence[str], max_len: int) -> list[torch.Tensor]:
    out = []
    for p, h in zip(tokenizer.encode_batch(list(premises)), tokenizer.encode_batch(list(hypotheses))):
        hyp = h.ids[: max_len - 1]
        out.append(torch.tensor(p.ids[: max_len - 1 - len(hyp)] + [EOS_ID] + hyp, dtype=torch.long))
    return out


def nli_bundle(train: tuple[list[str], list[str], list[int]], test: tuple[list[str], list[str], list[int]], *,
               vocab_size: int, max_len: int) -> DataBundle:
    """Tokenize ``(premises, hypotheses, labels)`` splits into ``premise <eos> hypothesis`` items (kind ``tokens``)."""
    tokenizer = train_tokenizer(train[0] + train[1], vocab_size)
    info = {"kind": "tokens", "n_classes": 3, "vocab_size": tokenizer.get_vocab_size(), "pad_id": PAD_ID,
            "max_len": max_len, "class_names": list(LABELS)}
    return DataBundle(
        TextClassificationDataset(_encode_pairs(tokenizer, train[0], train[1], max_len), train[2]),
        TextClassificationDataset(_encode_pairs(tokenizer, test[0], test[1], max_len), test[2]),
        info, TokenCollate(PAD_ID), tokenizer=tokenizer,
    )


def load_generated_nli(*, n_train: int = 3000, n_test: int = 300, min_facts: int = 3, max_facts: int = 6,
                       vocab_size: int = 200, max_len: int = 128, seed: int = 0) -> DataBundle:
    """The embedded generated entailment task."""
    if not 1 <= min_facts <= max_facts <= len(SUBJECTS) - 1:
        raise ValueError(f"need 1 <= min_facts <= max_facts <= {len(SUBJECTS) - 1}, got {min_facts}, {max_facts}")
    facts = (min_facts, max_facts)
    return nli_bundle(generate_nli(n_train, seed, facts), generate_nli(n_test, seed + 1, facts),
                      vocab_size=vocab_size, max_len=max_len)


def load_nli(path: str | Path | None = None, *, vocab_size: int = 16000, max_len: int = 128, max_train: int = 0,
             max_test: int = 0) -> DataBundle:
    """SNLI or MultiNLI from its release folder (whichever files are present)."""
    root = require_path(path, "nli", INSTRUCTIONS)
    for train_name, test_name in RELEASES.values():
        if (root / train_name).is_file() and (root / test_name).is_file():
            return nli_bundle(read_nli_jsonl(root / train_name, max_train), read_nli_jsonl(root / test_name, max_test),
                              vocab_size=vocab_size, max_len=max_len)
    expected = " or ".join(" + ".join(pair) for pair in RELEASES.values())
    raise FileNotFoundError(f"dataset 'nli': {root} holds neither {expected}. {INSTRUCTIONS}")
