"""The architectures of the papers, each switchable between Transformer and Sinkformer.

Every model takes ``normalization=`` (``"softmax"``: Transformer, ``"sinkhorn"``: Sinkformer)
and ``n_iters=``; both variants of one configuration have the same parameters. Models declare
the ``input_kind`` of data they read (see :mod:`sinkformer.data`), and :func:`build_model`
fills their size arguments (``n_classes``, ``image_size``, ``vocab_size``, ...) from a dataset's
``info``::

    data = sinkformer.data.load_dataset("digits")
    model = build_model("vit", data.info, patch_size=2, dim=32, depth=2, normalization="softmax")

============================ ================================= ===========
name                         class                             input kind
============================ ================================= ===========
``set_transformer``          :class:`SetTransformerClassifier` points
``point_cloud_transformer``  :class:`PointCloudTransformer`    points
``text_classifier``          :class:`TextClassifier`           tokens
``vit``                      :class:`ViT`                      images
``vit_attention_only``       :class:`AttentionOnlyViT`         images
``seq2seq``                  :class:`Seq2SeqTransformer`       translation
``sinkhorn_classifier``      :class:`SinkhornClassifier`       tokens
``sinkhorn_seq2seq``         :class:`SinkhornSeq2Seq`          translation
``sinkhorn_lm``              :class:`SinkhornTransformerLM`    lm
============================ ================================= ===========

The last three are Sparse Sinkhorn Attention's models (Tay et al. 2020): they are switched by
``attention=`` (``"vanilla"``, ``"local:32"``, ``"sinkhorn:32"``, ``"sortcut:2x8"``, ``"mixture:32"``,
see :class:`~sinkformer.models.sinkhorn_transformer.AttentionConfig`), not by ``normalization=``;
:func:`switched_by` tells which.

:class:`~sinkformer.models.causal_lm.CausalLM`, the byte-level language model of ``sinkformer run
causal-lm`` (causal SoftMax or causal Sinkhorn self-attention, switched by ``n_iters``), is built for a
dataset's ``info`` by :func:`~sinkformer.models.causal_lm.build_lm`; it is not one of ``sinkformer
train``'s models.
"""

from __future__ import annotations

from typing import Any

import torch

from .._options import REQUIRED, check_options, did_you_mean, signature_options
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
    "switched_by",
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


def switched_by(name: str) -> str:
    """``"normalization"`` for the Transformer/Sinkformer models (``normalization=``, ``n_iters=``,
    identical parameters in both variants), ``"attention"`` for the Sparse Sinkhorn ones."""
    return "normalization" if "normalization" in model_options(name) else "attention"


def model_options(name: str) -> dict[str, Any]:
    """Constructor options of model ``name`` with their defaults (``REQUIRED`` if none)."""
    return signature_options(get_model_class(name).__init__)


def build_model(name: str, info: dict[str, Any] | None = None, **options: Any) -> torch.nn.Module:
    """Build model ``name``; arguments come from ``options``, then from the dataset ``info``.

    Raises ``ValueError`` for an unknown model or option, a dataset of the wrong kind, or a
    required size that neither ``options`` nor ``info`` gives; ``TypeError`` for a value of the
    wrong type. Seed torch before calling for reproducible weights.
    """
    cls = get_model_class(name)
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
