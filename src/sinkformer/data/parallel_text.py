"""Parallel text for translation (IWSLT'14 De→En and the like), subword ids, and BLEU.

On disk: one folder with ``{split}.{lang}`` files holding one sentence per line, aligned line
by line (``train.de`` / ``train.en``, ``valid.*``, ``test.*`` — the layout of fairseq's
``prepare-iwslt14.sh``). subword-nmt's ``@@ `` continuation markers, if present, are removed so
that text is plain again. A joint BPE tokenizer is trained on both sides of the training split.

BLEU is sacreBLEU's corpus BLEU on detokenised text (:func:`bleu`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor
from torch.utils.data import Dataset

from .base import DataBundle, TranslationCollate, require_path
from .text import BOS_ID, EOS_ID, PAD_ID, encode, train_tokenizer

__all__ = ["ParallelTextDataset", "parallel_text_bundle", "read_parallel", "load_parallel_text", "bleu"]

INSTRUCTIONS = (
    "Prepare IWSLT'14 German-English with fairseq's examples/translation/prepare-iwslt14.sh "
    "(https://github.com/facebookresearch/fairseq/tree/main/examples/translation) and pass the folder "
    "holding train.de, train.en, valid.de, valid.en, test.de, test.en (one sentence per line)."
)


class ParallelTextDataset(Dataset):
    """``(src ids + <eos>, <bos> + tgt ids + <eos>)`` items; ``references`` are the raw target sentences."""

    def __init__(self, src: list[Tensor], tgt: list[Tensor], references: list[str]) -> None:
        self.src, self.tgt, self.references = src, tgt, references

    def __len__(self) -> int:
        return len(self.src)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        return self.src[index], self.tgt[index]


def _with_specials(ids: list[Tensor], bos: bool) -> list[Tensor]:
    eos = torch.tensor([EOS_ID])
    return [torch.cat([torch.tensor([BOS_ID]), x, eos]) if bos else torch.cat([x, eos]) for x in ids]


def parallel_text_bundle(
    train: tuple[Sequence[str], Sequence[str]],
    test: tuple[Sequence[str], Sequence[str]],
    *,
    vocab_size: int,
    max_len: int,
    lowercase: bool = False,
) -> DataBundle:
    """Train a joint tokenizer on the ``(sources, targets)`` of ``train`` and encode both splits.

    Sentences are cut to ``max_len - 1`` subwords so that, with ``<bos>``/``<eos>``, every
    sequence fed to the model has at most ``max_len`` positions.
    """
    tokenizer = train_tokenizer(list(train[0]) + list(train[1]), vocab_size, lowercase=lowercase)

    def dataset(src: Sequence[str], tgt: Sequence[str]) -> ParallelTextDataset:
        src_ids = _with_specials(encode(tokenizer, src, max_len - 1), bos=False)
        tgt_ids = _with_specials(encode(tokenizer, tgt, max_len - 1), bos=True)
        return ParallelTextDataset(src_ids, tgt_ids, list(tgt))

    info = {"kind": "translation", "vocab_size": tokenizer.get_vocab_size(), "pad_id": PAD_ID, "bos_id": BOS_ID,
            "eos_id": EOS_ID, "max_len": max_len}
    return DataBundle(dataset(*train), dataset(*test), info, TranslationCollate(PAD_ID), tokenizer=tokenizer)


def read_parallel(root: Path, split: str, src_lang: str, tgt_lang: str) -> tuple[list[str], list[str]]:
    """The aligned sentences of ``root/{split}.{src_lang}`` and ``root/{split}.{tgt_lang}``."""
    sides = []
    for lang in (src_lang, tgt_lang):
        file = root / f"{split}.{lang}"
        if not file.exists():
            raise FileNotFoundError(f"dataset 'iwslt14': missing {file}. {INSTRUCTIONS}")
        try:
            lines = file.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"cannot read {file}: {err}") from None
        sides.append([line.replace("@@ ", "").strip() for line in lines])
    if len(sides[0]) != len(sides[1]):
        raise ValueError(
            f"{root / f'{split}.{src_lang}'} has {len(sides[0])} lines but {root / f'{split}.{tgt_lang}'} has "
            f"{len(sides[1])}; parallel files must be aligned line by line"
        )
    keep = [i for i in range(len(sides[0])) if sides[0][i] and sides[1][i]]
    return [sides[0][i] for i in keep], [sides[1][i] for i in keep]


def load_parallel_text(
    path: str | Path | None = None,
    *,
    src_lang: str = "de",
    tgt_lang: str = "en",
    eval_split: str = "valid",
    vocab_size: int = 10000,
    max_len: int = 128,
    lowercase: bool = True,
) -> DataBundle:
    """IWSLT'14-style parallel text: ``train`` for training, ``eval_split`` (``valid``/``test``) for evaluation."""
    root = require_path(path, "iwslt14", INSTRUCTIONS)
    return parallel_text_bundle(
        read_parallel(root, "train", src_lang, tgt_lang), read_parallel(root, eval_split, src_lang, tgt_lang),
        vocab_size=vocab_size, max_len=max_len, lowercase=lowercase,
    )


def bleu(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    """sacreBLEU corpus BLEU (0–100) of detokenised ``hypotheses`` against one reference each."""
    import sacrebleu

    if len(hypotheses) != len(references):
        raise ValueError(f"got {len(hypotheses)} hypotheses but {len(references)} references")
    return float(sacrebleu.corpus_bleu(list(hypotheses), [list(references)]).score)
