"""IMDb movie reviews (Maas et al. 2011) from the ``aclImdb`` folder.

Layout: ``aclImdb/{train,test}/{pos,neg}/*.txt``, one review per file (label 1 = positive).
HTML line breaks (``<br />``) become spaces and runs of white space one space; a BPE tokenizer
is trained on the training reviews (:func:`sinkformer.data.text.train_tokenizer`) and reviews
are truncated to ``max_len`` tokens.
"""

from __future__ import annotations

from pathlib import Path

from .base import DataBundle, require_path
from .text import text_classification_bundle

__all__ = ["read_imdb_split", "load_imdb"]

INSTRUCTIONS = (
    "Download https://ai.stanford.edu/~amaas/data/sentiment/aclImdb_v1.tar.gz, extract it "
    "(`tar xzf aclImdb_v1.tar.gz`) and pass the aclImdb folder."
)

CLASS_NAMES = ["neg", "pos"]


def read_imdb_split(root: Path, split: str) -> tuple[list[str], list[int]]:
    """Reviews and labels of ``root/split/{neg,pos}/*.txt`` (sorted by file name within a class)."""
    texts, labels = [], []
    for label, name in enumerate(CLASS_NAMES):
        folder = root / split / name
        if not folder.is_dir():
            raise FileNotFoundError(f"dataset 'imdb': missing folder {folder}. {INSTRUCTIONS}")
        for file in sorted(folder.glob("*.txt")):
            try:
                text = file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as err:
                raise ValueError(f"cannot read review {file}: {err}") from None
            texts.append(" ".join(text.replace("<br />", " ").split()))
            labels.append(label)
    if not texts:
        raise FileNotFoundError(f"dataset 'imdb': no reviews in {root / split}. {INSTRUCTIONS}")
    return texts, labels


def load_imdb(path: str | Path | None = None, *, vocab_size: int = 16000, max_len: int = 512) -> DataBundle:
    """IMDb as token ids (``kind="tokens"``, 2 classes)."""
    root = require_path(path, "imdb", INSTRUCTIONS)
    return text_classification_bundle(
        read_imdb_split(root, "train"), read_imdb_split(root, "test"),
        class_names=CLASS_NAMES, vocab_size=vocab_size, max_len=max_len,
    )
