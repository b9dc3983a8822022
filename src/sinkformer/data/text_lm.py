r"""Language-modelling text at character (byte) or subword level (Sparse Sinkhorn Attention §5.2).

Items are windows of ``seq_len + 1`` token ids; a batch feeds the first ``seq_len`` to the model
and predicts the last ``seq_len`` (kind ``"lm"``: inputs ``{"tokens": (B, L)}``, targets
``(B, L)``). Metrics: bits per character (``level="char"``, one token per UTF-8 byte, as
Tensor2Tensor's byte-level LM1B) or perplexity per subword token (``level="word"``, a BPE
vocabulary learned on the training text, as the paper's word pieces).

Sources of text:

* embedded (no path): the Python standard library's own sources and docstrings (the ``*.py``
  files at the top of ``sysconfig.get_paths()["stdlib"]``, in name order) — text that ships
  with Python itself; the last ``test_fraction`` is the test split;
* a text file, or a folder of ``*.txt`` files (the last ``test_fraction`` is the test split);
* an LM1B release folder (``1-billion-word-language-modeling-benchmark-r13output``): training
  shards ``training-monolingual.tokenized.shuffled/news.en-000NN-of-00100`` and held-out shards
  ``heldout-monolingual.tokenized.shuffled/news.en.heldout-000NN-of-00050``, one sentence per
  line (``max_files`` shards of each are read).

Byte ids are ``4 + byte`` so that ids 0–3 stay the special tokens of :mod:`sinkformer.data.text`.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor
from torch.utils.data import Dataset

from .base import DataBundle, require_path
from .text import EOS_ID, train_tokenizer

__all__ = [
    "load_text_corpus","BYTE_OFFSET", "BYTE_VOCAB", "LEVELS", "encode_bytes", "python_stdlib_text", "read_text_corpus",
           "LMDataset", "LMCollate", "load_text_lm"]

BYTE_OFFSET = 4
BYTE_VOCAB = BYTE_OFFSET + 256
LEVELS = ("char", "word")

LM1B_TRAIN = "training-monolingual.tokenized.shuffled"
LM1B_HELDOUT = "heldout-monolingual.tokenized.shuffled"
INSTRUCTIONS = (
    "Pass a UTF-8 text file, a folder of .txt files, or the LM1B release folder "
    "(http://www.statmt.org/lm-benchmark/1-billion-word-language-modeling-benchmark-r13output.tar.gz, extracted)."
)


def encode_bytes(text: str, max_len: int | None = None) -> Tensor:
    """UTF-8 bytes of ``text`` as ids ``4 + byte`` (truncated to ``max_len``)."""
    data = text.encode("utf-8")[:max_len]
    return torch.tensor(list(data), dtype=torch.long) + BYTE_OFFSET


def python_stdlib_text(max_chars: int = 2_000_000) -> str:
    """Up to ``max_chars`` characters of the standard library's top-level ``*.py`` files, in name order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for file in sorted(root.glob("*.py")):
        try:
            text = file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    if not parts:
        raise FileNotFoundError(f"no Python sources found in {root}")
    return "\n".join(parts)[:max_chars]


def _split(text: str, test_fraction: float) -> tuple[str, str]:
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    cut = int(len(text) * (1 - test_fraction))
    return text[:cut], text[cut:]


def read_text_corpus(path: str | Path | None, *, max_chars: int = 2_000_000, max_files: int = 1,
                     test_fraction: float = 0.1) -> tuple[str, str]:
    """``(train_text, test_text)`` from the embedded source (``path=None``) or ``path`` (see module doc)."""
    if path is None:
        return _split(python_stdlib_text(max_chars), test_fraction)
    root = require_path(path, "text", INSTRUCTIONS)
    if root.is_file():
        return _split(root.read_text(encoding="utf-8", errors="replace")[:max_chars], test_fraction)
    if (root / LM1B_TRAIN).is_dir():
        train_files = sorted((root / LM1B_TRAIN).glob("news.en-*"))[:max_files]
        test_files = sorted((root / LM1B_HELDOUT).glob("news.en.heldout-*"))[:max_files]
        if not train_files or not test_files:
            raise FileNotFoundError(f"LM1B folder {root}: no news.en-* / news.en.heldout-* shards. {INSTRUCTIONS}")
        read = lambda files: "".join(f.read_text(encoding="utf-8", errors="replace") for f in files)[:max_chars]  # noqa: E731
        return read(train_files), read(test_files)
    files = sorted(root.glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no .txt files (nor an LM1B layout) in {root}. {INSTRUCTIONS}")
    return _split("\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)[:max_chars], test_fraction)


class LMDataset(Dataset):
    """Non-overlapping windows ``ids[i L : i L + L + 1]`` of one long id sequence, or fixed rows.

    ``ids``: 1-D (a corpus, cut into windows of ``seq_len + 1``) or 2-D ``(N, seq_len + 1)``
    (one sequence per row, e.g. an image).
    """

    def __init__(self, ids: Tensor, seq_len: int | None = None) -> None:
        if ids.dim() == 1:
            if seq_len is None or seq_len < 1:
                raise ValueError(f"seq_len must be >= 1 for a 1-D corpus, got {seq_len}")
            n = (len(ids) - 1) // seq_len
            if n < 1:
                raise ValueError(f"the corpus has {len(ids)} tokens, fewer than one window of {seq_len + 1}")
            ids = torch.stack([ids[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)])
        elif ids.dim() != 2:
            raise ValueError(f"ids must be 1-D or 2-D, got shape {tuple(ids.shape)}")
        self.rows = ids

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Tensor:
        return self.rows[index]


class LMCollate:
    """Windows ``(B, L + 1)`` -> ``({"tokens": (B, L)}, targets (B, L))``, targets shifted by one."""

    def __call__(self, items: Sequence[Tensor]) -> tuple[dict[str, Tensor], Tensor]:
        x = torch.stack(list(items))
        return {"tokens": x[:, :-1]}, x[:, 1:]


def _subword_ids(tokenizer, text: str) -> Tensor:
    lines = [line for line in text.splitlines() if line.strip()]
    ids: list[int] = []
    for enc in tokenizer.encode_batch(lines):
        ids += enc.ids + [EOS_ID]
    return torch.tensor(ids, dtype=torch.long)


def load_text_corpus(path: str | Path, *, level: str = "char", seq_len: int = 128, vocab_size: int = 2000,
                     max_chars: int = 2_000_000, max_files: int = 1, test_fraction: float = 0.1) -> DataBundle:
    """:func:`load_text_lm` on a real corpus at ``path`` (the registry's ``text_corpus``)."""
    return load_text_lm(path, level=level, seq_len=seq_len, vocab_size=vocab_size, max_chars=max_chars,
                        max_files=max_files, test_fraction=test_fraction)


def load_text_lm(path: str | Path | None = None, *, level: str = "char", seq_len: int = 128, vocab_size: int = 2000,
                 max_chars: int = 2_000_000, max_files: int = 1, test_fraction: float = 0.1) -> DataBundle:
    """Language-modelling windows (``kind="lm"``) at ``level`` ``"char"`` (bytes) or ``"word"`` (BPE).

    ``info``: ``vocab_size``, ``max_len`` (= ``seq_len``), ``level``, ``unit`` (what one target
    is: ``"byte"`` or ``"subword"``) and ``chars_per_token`` on the test split.
    """
    if level not in LEVELS:
        raise ValueError(f"level must be one of {list(LEVELS)}, got {level!r}")
    train_text, test_text = read_text_corpus(path, max_chars=max_chars, max_files=max_files, test_fraction=test_fraction)
    tokenizer = None
    if level == "char":
        train_ids, test_ids, vocab = encode_bytes(train_text), encode_bytes(test_text), BYTE_VOCAB
    else:
        tokenizer = train_tokenizer(train_text.splitlines(), vocab_size, lowercase=False)
        train_ids, test_ids = _subword_ids(tokenizer, train_text), _subword_ids(tokenizer, test_text)
        vocab = tokenizer.get_vocab_size()
    info = {"kind": "lm", "vocab_size": vocab, "max_len": seq_len, "level": level,
            "unit": "byte" if level == "char" else "subword",
            "chars_per_token": len(test_text) / max(len(test_ids), 1)}
    return DataBundle(LMDataset(train_ids, seq_len), LMDataset(test_ids, seq_len), info, LMCollate(), tokenizer=tokenizer)
