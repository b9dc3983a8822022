"""Parallel text for translation (IWSLT'14 De→En and the like), subword ids, and BLEU.

On disk: one folder with ``{split}.{lang}`` files holding one sentence per line, aligned line
by line (``train.de`` / ``train.en``, ``valid.*``, ``test.*`` — the layout of fairseq's
``prepare-iwslt14.sh``). subword-nmt's ``@@ `` continuation markers, if present, are removed so
that text is plain again. A joint BPE tokenizer is trained on both sides of the training split.
The bundle's ``info["eval_split"]`` names the split its ``test`` dataset holds (``"valid"`` or
``"test"`` for IWSLT'14), so that reports can say which one they scored.

Two BLEU scores of the same translations:

* :func:`bleu` — sacreBLEU's corpus BLEU with its own (``13a``) tokenisation, case-sensitive:
  the standard, comparable figure for detokenised output;
* :func:`tokenized_bleu` — "tokenised BLEU", BLEU on whitespace-separated tokens of lower-cased,
  Moses-like tokenised text: an approximation of what ``fairseq-generate --scoring bleu``
  prints on IWSLT'14 prepared by ``prepare-iwslt14.sh`` (Moses-tokenised, lower-cased), i.e. the
  kind of number papers such as the Sinkformers paper report for IWSLT'14.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor
from torch.utils.data import Dataset

from .._optional import require
from .base import DataBundle, TranslationCollate, require_path
from .text import BOS_ID, EOS_ID, PAD_ID, encode, train_tokenizer

__all__ = [
    "ParallelTextDataset", "parallel_text_bundle", "read_parallel", "load_parallel_text", "bleu", "moses_like_tokenize",
    "tokenized_bleu",
]

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
    eval_split: str = "test",
) -> DataBundle:
    """Train a joint tokenizer on the ``(sources, targets)`` of ``train`` and encode both splits.

    Sentences are cut to ``max_len - 1`` subwords so that, with ``<bos>``/``<eos>``, every
    sequence fed to the model has at most ``max_len`` positions. ``eval_split`` names the split
    ``test`` comes from (``info["eval_split"]``, for reports).
    """
    tokenizer = train_tokenizer(list(train[0]) + list(train[1]), vocab_size, lowercase=lowercase)

    def dataset(src: Sequence[str], tgt: Sequence[str]) -> ParallelTextDataset:
        src_ids = _with_specials(encode(tokenizer, src, max_len - 1), bos=False)
        tgt_ids = _with_specials(encode(tokenizer, tgt, max_len - 1), bos=True)
        return ParallelTextDataset(src_ids, tgt_ids, list(tgt))

    info = {"kind": "translation", "vocab_size": tokenizer.get_vocab_size(), "pad_id": PAD_ID, "bos_id": BOS_ID,
            "eos_id": EOS_ID, "max_len": max_len, "eval_split": eval_split}
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
    """IWSLT'14-style parallel text: ``train`` for training, ``eval_split`` (``valid``/``test``) for evaluation.

    The bundle's ``test`` dataset holds the ``eval_split`` sentences and ``info["eval_split"]``
    says which split that is (papers report ``test``; ``valid`` is for choosing settings).
    """
    root = require_path(path, "iwslt14", INSTRUCTIONS)
    return parallel_text_bundle(
        read_parallel(root, "train", src_lang, tgt_lang), read_parallel(root, eval_split, src_lang, tgt_lang),
        vocab_size=vocab_size, max_len=max_len, lowercase=lowercase, eval_split=eval_split,
    )


def bleu(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    """sacreBLEU corpus BLEU (0–100) of detokenised ``hypotheses`` against one reference each."""
    sacrebleu = require("sacrebleu", "BLEU")

    if len(hypotheses) != len(references):
        raise ValueError(f"got {len(hypotheses)} hypotheses but {len(references)} references")
    return float(sacrebleu.corpus_bleu(list(hypotheses), [list(references)]).score)


def _spaced(text: str, i: int) -> str:
    """Character ``i`` of ``text`` with the spaces the tokenisation of :func:`moses_like_tokenize` puts around it."""
    ch = text[i]
    if ch.isalnum() or ch.isspace() or ch == "-":
        return ch
    before, after = text[i - 1] if i else " ", text[i + 1] if i + 1 < len(text) else " "
    if ch == "'":
        return (" " if not before.isspace() else "") + ch + ("" if after.isalpha() else " ")
    if (ch == "." and before.isalnum() and after.isalnum()) or (ch == "," and before.isdigit() and after.isdigit()):
        return ch
    return f" {ch} "


def moses_like_tokenize(text: str) -> str:
    """A simple approximation of the Moses tokeniser (``tokenizer.perl -l en``, as ``prepare-iwslt14.sh`` runs it).

    1. HTML entities are unescaped (Moses writes ``'`` as ``&apos;``, ``"`` as ``&quot;``, ...);
    2. an apostrophe starts a new token and stays attached to the letters after it (``it's`` ->
       ``it 's``, ``don't`` -> ``don 't``; ``dogs'`` -> ``dogs '``; an opening quote ``'hello`` stays
       whole, where Moses splits it);
    3. a period between two letters or digits (``3.5``, ``u.s``, ``ted.com``) and a comma between
       two digits (``1,000``) stay inside their word;
    4. hyphens stay where they are (``well-known``: Moses without ``-a``);
    5. every other character that is neither a letter, a digit nor white space becomes a token of
       its own (``hello, world!`` -> ``hello , world !``);

    then runs of white space become one space. Already-tokenised IWSLT'14 text comes out with the
    same tokens (apart from rule 3 on abbreviations: Moses keeps ``u.s.`` whole, here ``u.s .``).
    No lower-casing here (:func:`tokenized_bleu` does it).
    """
    text = html.unescape(text)
    return " ".join("".join(_spaced(text, i) for i in range(len(text))).split())


def tokenized_bleu(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    """Tokenised BLEU (0–100): corpus BLEU of lower-cased, :func:`moses_like_tokenize`-d text, one reference each.

    Exactly: ``sacrebleu.corpus_bleu(H, [R], tokenize="none", lowercase=True, force=True)`` with
    ``H``/``R`` the hypotheses/references passed through :func:`moses_like_tokenize` — BLEU-4,
    uniform weights, brevity penalty, no smoothing, n-grams of whitespace-separated tokens. This
    approximates the BLEU ``fairseq-generate --scoring bleu`` prints on IWSLT'14 as prepared by
    ``prepare-iwslt14.sh`` (which is BLEU-4 on the whitespace tokens of Moses-tokenised,
    lower-cased text with BPE removed): on such references and hypotheses made of the same kind of
    tokens the two agree up to tokenisation details (abbreviations, HTML escapes; fairseq scores
    token ids, so ``<unk>`` matches differ). Unlike :func:`bleu` (sacreBLEU's own tokenisation,
    case-sensitive), its numbers are not comparable across tokenisations — report it beside
    sacreBLEU, as a bridge to fairseq-era papers.
    """
    sacrebleu = require("sacrebleu", "BLEU")

    if len(hypotheses) != len(references):
        raise ValueError(f"got {len(hypotheses)} hypotheses but {len(references)} references")
    hyps = [moses_like_tokenize(h) for h in hypotheses]
    refs = [moses_like_tokenize(r) for r in references]
    return float(sacrebleu.corpus_bleu(hyps, [refs], tokenize="none", lowercase=True, force=True).score)
