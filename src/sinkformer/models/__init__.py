"""The architectures of the papers, each switchable between its attentions by ``attention=``.

Every model takes ``attention=`` and ``n_iters=`` in one vocabulary
(:mod:`sinkformer.models.attention_spec`): ``"softmax"`` (the Transformer) or ``"sinkhorn"`` (the
Sinkformer, ``n_iters`` normalisations), and for the Sparse Sinkhorn models also ``"local:B"``,
``"fixed:B"``, ``"sparse:B"`` (Sparse Sinkhorn Attention), ``"sortcut:KxB"`` and ``"mixture:B"``.
Both variants of a Transformer/Sinkformer configuration have the same parameters. Models declare
the ``input_kind`` of data they read (see :mod:`sinkformer.data`), and :func:`build_model` fills
their size arguments (``n_classes``, ``image_size``, ``vocab_size``, ...) from a dataset's ``info``::

    data = sinkformer.data.load_dataset("digits")
    model = build_model("vit", data.info, patch_size=2, dim=32, depth=2, attention="softmax")

============================ ================================= =========== =====================
name                         class                             input kind  ``attention``
============================ ================================= =========== =====================
``set_transformer``          :class:`SetTransformerClassifier` points      dense kinds
``point_cloud_transformer``  :class:`PointCloudTransformer`    points      dense kinds
``text_classifier``          :class:`TextClassifier`           tokens      dense kinds
``vit``                      :class:`ViT`                      images      dense kinds
``vit_attention_only``       :class:`AttentionOnlyViT`         images      dense kinds
``seq2seq``                  :class:`Seq2SeqTransformer`       translation dense kinds
``sinkhorn_classifier``      :class:`SinkhornClassifier`       tokens      every kind but pointwise
``sinkhorn_seq2seq``         :class:`SinkhornSeq2Seq`          translation every kind but pointwise
``sinkhorn_lm``              :class:`SinkhornTransformerLM`    lm          every kind but pointwise
============================ ================================= =========== =====================

The last three are Sparse Sinkhorn Attention's models (Tay et al. 2020); "dense kinds" are
:data:`~sinkformer.models.attention_spec.DENSE_KINDS` (``softmax``, ``sinkhorn`` and the pointwise
normalisations of :func:`sinkformer.attention`). The old spellings (``normalization=``,
``"vanilla"``, ``"sinkhorn:32"`` for Sparse Sinkhorn Attention, ``"sinkformer:3"``) still work, with
a ``FutureWarning`` that gives the new one.

:class:`~sinkformer.models.causal_lm.CausalLM`, the byte-level language model of ``sinkformer run
causal-lm`` (causal SoftMax or causal Sinkhorn self-attention, switched by ``n_iters``), is built for a
dataset's ``info`` by :func:`~sinkformer.models.causal_lm.build_lm`; it is not one of ``sinkformer
train``'s models.
"""

from __future__ import annotations

from typing import Any

import torch

from .._options import REQUIRED, check_options, did_you_mean, signature_options
from .attention_spec import RENAMED_OPTIONS, AttentionConfig, renamed_options
from .causal_lm import CausalLM
from .decoding import beam_search, greedy_decode
from .point_cloud_transformer import PointCloudTransformer
from .seq2seq import Seq2SeqTransformer
from .set_transformer import SetTransformerClassifier
from .sinkhorn_transformer import SinkhornClassifier, SinkhornSeq2Seq, SinkhornTransformerLM
from .text_classifier import TextClassifier
from .vit import AttentionOnlyViT, ViT

__all__ = [
    "MODELS",
    "get_model_class",
    "model_options",
    "build_model",
    "SetTransformerClassifier",
    "PointCloudTransformer",
    "TextClassifier",
    "ViT",
    "AttentionOnlyViT",
    "Seq2SeqTransformer",
    "SinkhornClassifier",
    "SinkhornSeq2Seq",
    "SinkhornTransformerLM",
    "CausalLM",
    "AttentionConfig",
    "greedy_decode",
    "beam_search",
]

MODELS: dict[str, type[torch.nn.Module]] = {
    "set_transformer": SetTransformerClassifier,
    "point_cloud_transformer": PointCloudTransformer,
    "text_classifier": TextClassifier,
    "vit": ViT,
    "vit_attention_only": AttentionOnlyViT,
    "seq2seq": Seq2SeqTransformer,
    "sinkhorn_classifier": SinkhornClassifier,
    "sinkhorn_seq2seq": SinkhornSeq2Seq,
    "sinkhorn_lm": SinkhornTransformerLM,
}


def get_model_class(name: str) -> type[torch.nn.Module]:
    """The class registered as ``name``; an unknown name suggests the closest and lists the valid ones."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; {did_you_mean(name, MODELS)}valid models: {', '.join(MODELS)}")
    return MODELS[name]


def model_options(name: str) -> dict[str, Any]:
    """Constructor options of model ``name`` with their defaults (``REQUIRED`` if none), without the old
    spellings of :data:`~sinkformer.models.attention_spec.RENAMED_OPTIONS`."""
    return {key: default for key, default in signature_options(get_model_class(name).__init__).items()
            if key not in RENAMED_OPTIONS}


def build_model(name: str, info: dict[str, Any] | None = None, **options: Any) -> torch.nn.Module:
    """Build model ``name``; arguments come from ``options``, then from the dataset ``info``.

    Raises ``ValueError`` for an unknown model or option, a dataset of the wrong kind, or a
    required size that neither ``options`` nor ``info`` gives; ``TypeError`` for a value of the
    wrong type. Old option names (``normalization=``...) are renamed with a ``FutureWarning``.
    Seed torch before calling for reproducible weights.
    """
    cls = get_model_class(name)
    options = renamed_options(options, f"model {name!r}")
    info = info or {}
    if "kind" in info and info["kind"] != cls.input_kind:
        compatible = [n for n, c in MODELS.items() if c.input_kind == info["kind"]]
        raise ValueError(
            f"model {name!r} reads {cls.input_kind} but the dataset gives {info['kind']}; "
            f"models for {info['kind']}: {', '.join(compatible)}"
        )
    params = model_options(name)
    kwargs = {key: info[key] for key in params if key in info}
    kwargs.update(check_options(f"model {name!r}", options, params))
    missing = [key for key, default in params.items() if default is REQUIRED and key not in kwargs]
    if missing:
        raise ValueError(
            f"model {name!r} needs {', '.join(missing)}: give it as an option or use a dataset that provides it"
        )
    return cls(**kwargs)
