"""A generated translation task: the embedded parallel-text dataset (no download).

The source language is English-like (subject–verb–object, adjectives before nouns, optional
prepositional phrase); the target language has its own words (a fixed dictionary), puts the
verb last (subject–object–verb) and adjectives after nouns::

    the small dog sees a red ball near the house
    lo kani piku ena bola roso nalo lo casa vidi

Translating needs both a word mapping and long-range reordering, so attention matters. Sentences
are drawn with a seeded ``random.Random``; they go through the same pipeline as IWSLT'14
(:func:`sinkformer.data.parallel_text.parallel_text_bundle`).
"""

from __future__ import annotations

import random

from .base import DataBundle
from .parallel_text import parallel_text_bundle

__all__ = ["DICTIONARY", "generate_pair", "load_translation"]

DETERMINERS = {"the": "lo", "a": "ena", "every": "tutu"}
NOUNS = {"dog": "kani", "cat": "mia", "ball": "bola", "house": "casa", "tree": "arbo", "bird": "pio",
         "child": "nino", "car": "oto", "river": "fluvo", "book": "libro", "garden": "hortu", "friend": "amiko"}
ADJECTIVES = {"small": "piku", "big": "granda", "red": "roso", "green": "verda", "old": "maljuna", "happy": "felica",
              "quiet": "kvieta", "fast": "rapida"}
VERBS = {"sees": "vidi", "likes": "ami", "follows": "sekvi", "finds": "trovi", "draws": "desegni", "helps": "helpi",
         "watches": "rigardi", "carries": "porti"}
PREPOSITIONS = {"near": "nalo", "behind": "malo", "under": "sulo"}
DICTIONARY = {**DETERMINERS, **NOUNS, **ADJECTIVES, **VERBS, **PREPOSITIONS}


def _noun_phrase(rng: random.Random) -> tuple[list[str], list[str]]:
    det, noun = rng.choice(list(DETERMINERS)), rng.choice(list(NOUNS))
    adj = [rng.choice(list(ADJECTIVES))] if rng.random() < 0.5 else []
    src = [det, *adj, noun]
    return src, [DICTIONARY[det], DICTIONARY[noun], *(DICTIONARY[a] for a in adj)]


def generate_pair(rng: random.Random) -> tuple[str, str]:
    """One ``(source, target)`` sentence pair."""
    subj_s, subj_t = _noun_phrase(rng)
    obj_s, obj_t = _noun_phrase(rng)
    verb = rng.choice(list(VERBS))
    src, tgt = subj_s + [verb] + obj_s, subj_t + obj_t
    if rng.random() < 0.4:
        prep = rng.choice(list(PREPOSITIONS))
        pp_s, pp_t = _noun_phrase(rng)
        src += [prep, *pp_s]
        tgt += [DICTIONARY[prep], *pp_t]
    return " ".join(src), " ".join(tgt + [DICTIONARY[verb]])


def load_translation(*, n_train: int = 4000, n_test: int = 200, vocab_size: int = 256, max_len: int = 32,
                     seed: int = 0) -> DataBundle:
    """Generated sentence pairs as a ``kind="translation"`` bundle."""
    def pairs(n: int, s: int) -> tuple[list[str], list[str]]:
        rng = random.Random(s)
        drawn = [generate_pair(rng) for _ in range(n)]
        return [p[0] for p in drawn], [p[1] for p in drawn]

    return parallel_text_bundle(pairs(n_train, seed), pairs(n_test, seed + 1), vocab_size=vocab_size, max_len=max_len)
