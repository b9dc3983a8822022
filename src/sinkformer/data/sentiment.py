r"""A generated sentiment task whose labels depend on context: the embedded text dataset.

Each review is one to three clauses such as ``"the plot was not very good"`` joined by
``"and"`` or ``"but"``, with optional filler (``"honestly ,"``). Its label is the sign of

.. math::

    s = \sum_{\text{clauses } c} w_c \, \nu_c \, \iota_c \, \pi_c ,

where :math:`\pi_c = \pm 1` is the polarity of the adjective, :math:`\nu_c = -1` when it is
negated (``not``, ``never``, ``hardly``), :math:`\iota_c = 2` with an intensifier (``very``,
``really``, ``extremely``, ``truly``), and :math:`w_c = 3` for a clause following ``but``
(contrast), 1 otherwise. Reviews with :math:`s = 0` are redrawn. A bag of words cannot solve
it: the same words give either label depending on their order and scope.
"""

from __future__ import annotations

import random

from .base import DataBundle
from .text import text_classification_bundle

__all__ = ["generate_review", "generate_reviews", "load_sentiment"]

POSITIVE = ["good", "great", "excellent", "wonderful", "brilliant", "enjoyable", "charming", "superb"]
NEGATIVE = ["bad", "awful", "terrible", "boring", "dull", "poor", "horrible", "weak"]
NOUNS = ["movie", "film", "plot", "acting", "story", "cast", "script", "ending", "music", "direction"]
NEGATORS = ["not", "never", "hardly"]
INTENSIFIERS = ["very", "really", "extremely", "truly"]
FILLERS = ["honestly ,", "i think", "overall ,", "to be fair ,", "in the end ,"]


def generate_review(rng: random.Random) -> tuple[str, int]:
    """One review and its label (1 = positive), drawn with ``rng``."""
    while True:
        words, score, weight = [], 0, 1
        for i in range(rng.randint(1, 3)):
            if i:
                joiner = rng.choice(["and", "but"])
                words.append(joiner)
                weight = 3 if joiner == "but" else 1
            if rng.random() < 0.3:
                words += rng.choice(FILLERS).split()
            polarity = rng.choice([1, -1])
            clause = ["the", rng.choice(NOUNS), rng.choice(["was", "is"])]
            value = polarity
            if rng.random() < 0.4:
                clause.append(rng.choice(NEGATORS))
                value = -value
            if rng.random() < 0.4:
                clause.append(rng.choice(INTENSIFIERS))
                value *= 2
            clause.append(rng.choice(POSITIVE if polarity > 0 else NEGATIVE))
            words += clause
            score += weight * value
        if score != 0:
            return " ".join(words), int(score > 0)


def generate_reviews(n: int, seed: int) -> tuple[list[str], list[int]]:
    rng = random.Random(seed)
    pairs = [generate_review(rng) for _ in range(n)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def load_sentiment(*, n_train: int = 2000, n_test: int = 500, vocab_size: int = 200, max_len: int = 64,
                   seed: int = 0) -> DataBundle:
    """The generated reviews as token ids (``kind="tokens"``, 2 classes)."""
    return text_classification_bundle(
        generate_reviews(n_train, seed), generate_reviews(n_test, seed + 1),
        class_names=["negative", "positive"], vocab_size=vocab_size, max_len=max_len,
    )
