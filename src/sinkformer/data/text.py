"""Text: a subword tokenizer trained on the training split, and text-classification datasets.

The tokenizer is a byte-pair encoding from the ``tokenizers`` library: NFKC + lower-casing,
words split on spaces (SentencePiece's ``▁`` marker, so decoding restores the spaces) and on
punctuation, BPE merges learned on the training texts only. Ids 0–3 are reserved for
``<pad>``, ``<bos>``, ``<eos>`` and ``<unk>``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.utils.data import Dataset

from .._optional import require
from .base import DataBundle, TokenCollate

__all__ = [
    "SPECIAL_TOKENS",
    "PAD_ID",
    "BOS_ID",
    "EOS_ID",
    "UNK_ID",
    "train_tokenizer",
    "encode",
    "TextClassificationDataset",
    "text_classification_bundle",
]

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)


def train_tokenizer(texts: Sequence[str], vocab_size: int, *, min_frequency: int = 2, lowercase: bool = True):
    """A BPE ``tokenizers.Tokenizer`` with at most ``vocab_size`` tokens, learned on ``texts``."""
    tok = require("tokenizers", "the text datasets' tokenizer")
    Tokenizer, decoders, models = tok.Tokenizer, tok.decoders, tok.models
    normalizers, pre_tokenizers, trainers = tok.normalizers, tok.pre_tokenizers, tok.trainers

    if vocab_size < len(SPECIAL_TOKENS) + 1:
        raise ValueError(f"vocab_size must be > {len(SPECIAL_TOKENS)}, got {vocab_size}")
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    norms = [normalizers.NFKC()] + ([normalizers.Lowercase()] if lowercase else [])
    tokenizer.normalizer = normalizers.Sequence(norms)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Metaspace(), pre_tokenizers.Punctuation()])
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=list(SPECIAL_TOKENS), show_progress=False
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tokenizer


def encode(tokenizer, texts: Sequence[str], max_len: int) -> list[Tensor]:
    """Token ids of each text, truncated to ``max_len`` (an empty text becomes ``[<unk>]``)."""
    return [torch.tensor(e.ids[:max_len] or [UNK_ID], dtype=torch.long) for e in tokenizer.encode_batch(list(texts))]


class TextClassificationDataset(Dataset):
    """``(ids (L,), label)`` items."""

    def __init__(self, ids: list[Tensor], labels: Sequence[int]) -> None:
        if len(ids) != len(labels):
            raise ValueError(f"got {len(ids)} texts but {len(labels)} labels")
        self.ids, self.labels = ids, list(labels)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        return self.ids[index], self.labels[index]


def text_classification_bundle(
    train: tuple[Sequence[str], Sequence[int]],
    test: tuple[Sequence[str], Sequence[int]],
    *,
    class_names: list[str],
    vocab_size: int,
    max_len: int,
) -> DataBundle:
    """Train a tokenizer on ``train`` texts and encode both splits (``(texts, labels)`` each)."""
    tokenizer = train_tokenizer(train[0], vocab_size)
    info = {"kind": "tokens", "n_classes": len(class_names), "vocab_size": tokenizer.get_vocab_size(),
            "pad_id": PAD_ID, "max_len": max_len, "class_names": class_names}
    return DataBundle(
        TextClassificationDataset(encode(tokenizer, train[0], max_len), train[1]),
        TextClassificationDataset(encode(tokenizer, test[0], max_len), test[1]),
        info,
        TokenCollate(PAD_ID),
        tokenizer=tokenizer,
    )
