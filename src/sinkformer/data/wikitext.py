r"""WikiText-103 (raw) at byte level, for causal language modelling (``sinkformer run causal-lm --full``).

:func:`load_wikitext103` reads ``wiki.train.raw`` and a held-out ``wiki.{test,valid}.raw`` from the
release folder; :func:`byte_windows` cuts any two texts into an ``lm`` bundle of byte windows (ids
``4 + byte``, as :func:`sinkformer.data.text_lm.encode_bytes`), and also serves the embedded corpus.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from .base import DataBundle, require_path
from .text_lm import BYTE_OFFSET, BYTE_VOCAB, LMCollate, LMDataset

__all__ = ["WIKITEXT_FILES", "WIKITEXT_URL", "WIKITEXT103_TRAIN_BYTES", "load_wikitext103", "byte_ids",
           "byte_windows"]

WIKITEXT_FILES = {"train": "wiki.train.raw", "valid": "wiki.valid.raw", "test": "wiki.test.raw"}
WIKITEXT_URL = "https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-103-raw-v1.zip"
WIKITEXT_INSTRUCTIONS = (
    f"Download WikiText-103 (raw, character level) from {WIKITEXT_URL} (or the `wikitext-103-raw-v1` configuration "
    "of https://huggingface.co/datasets/Salesforce/wikitext), unzip it and pass the folder that holds "
    f"{', '.join(WIKITEXT_FILES.values())} as --data (e.g. --data data/wikitext-103-raw)."
)
#: Bytes of ``wiki.train.raw`` (about 540 MB; for the cost estimate, which does not read the file).
WIKITEXT103_TRAIN_BYTES = 540_000_000


def load_wikitext103(path: str | Path | None, *, seq_len: int, max_chars: int = 0,
                     eval_split: str = "test") -> tuple[DataBundle, float]:
    """WikiText-103 (raw) at byte level: windows of ``seq_len`` from ``wiki.train.raw`` and from the
    held-out ``wiki.{eval_split}.raw`` (``"test"`` or ``"valid"``), the first ``max_chars``
    characters of each (0: all). Returns the bundle and the held-out split's bytes per character.

    Raises ``FileNotFoundError`` (saying what to download and where to put it) when ``path`` or
    one of the three files is missing."""
    if eval_split not in ("test", "valid"):
        raise ValueError(f"eval_split must be 'test' or 'valid', got {eval_split!r}")
    root = require_path(path, "wikitext-103", WIKITEXT_INSTRUCTIONS)
    missing = [name for name in WIKITEXT_FILES.values() if not (root / name).is_file()]
    if missing:
        raise FileNotFoundError(f"dataset 'wikitext-103': {root} lacks {', '.join(missing)}. {WIKITEXT_INSTRUCTIONS}")

    def read(split: str) -> str:
        with (root / WIKITEXT_FILES[split]).open(encoding="utf-8", errors="replace") as fh:
            return fh.read(max_chars) if max_chars else fh.read()

    return byte_windows(read("train"), read(eval_split), seq_len)


def byte_ids(text: str) -> Tensor:
    """The ids of :func:`sinkformer.data.text_lm.encode_bytes` (``4 + byte``), without a Python list:
    WikiText-103's 540 MB would take about 20 GB as one."""
    data = text.encode("utf-8")
    if not data:
        return torch.zeros(0, dtype=torch.long)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.long) + BYTE_OFFSET


def byte_windows(train_text: str, test_text: str, seq_len: int) -> tuple[DataBundle, float]:
    """A byte-level ``lm`` bundle (windows of ``seq_len``) and the test text's bytes per character."""
    test_ids = byte_ids(test_text)
    info = {"kind": "lm", "vocab_size": BYTE_VOCAB, "max_len": seq_len, "level": "char", "unit": "byte"}
    bundle = DataBundle(LMDataset(byte_ids(train_text), seq_len), LMDataset(test_ids, seq_len), info, LMCollate())
    return bundle, len(test_ids) / max(len(test_text), 1)
