r"""The models' one attention vocabulary: which self-attention a model uses, as a spec string.

Every model takes ``attention=`` (a spec) and ``n_iters=`` (the Sinkhorn normalisations of
``"sinkhorn"``); :meth:`AttentionConfig.parse` is the one parser.

================  ======================================================================
spec              self-attention
================  ======================================================================
``softmax``       dense SoftMax attention (the Transformer)
``sinkhorn``      dense Sinkhorn attention with ``n_iters`` normalisations (the Sinkformer);
                  causal models use causal Sinkhorn (row :math:`t` balanced on the prefix
                  :math:`0..t` alone); ``n_iters=1`` is SoftMax
``linear``,       dense attention with a pointwise normalisation
``sigmoid``,      (:func:`sinkformer.attention`'s, Transformer/Sinkformer models only)
``relu``
``local:B``       block-local SoftMax attention, blocks of ``B``
``fixed:B``       Sparse Transformer fixed pattern (Child et al.), block ``B``
``sparse:B``      Sparse Sinkhorn Attention (Tay et al.), blocks of ``B``
``sortcut:KxB``   SortCut Sinkhorn: the first ``K`` sorted blocks of ``B`` (encoders only)
``mixture:B``     Sparse Sinkhorn plus SoftMax attention
================  ======================================================================

The Transformer/Sinkformer models of the Sinkformers paper serve the dense kinds
(:data:`DENSE_KINDS`); the Sparse Sinkhorn models (``sinkhorn_classifier``,
``sinkhorn_seq2seq``, ``sinkhorn_lm``) every kind but the pointwise ones.

Old spellings still work, with a ``FutureWarning`` that gives the new one: the Sparse
Sinkhorn models' ``"vanilla"`` (now ``"softmax"``), ``"sinkformer:N"`` (``"sinkhorn"`` with
``n_iters=N``) and ``"sinkhorn:B"`` (``"sparse:B"``: in the old vocabulary ``sinkhorn`` meant
Sparse Sinkhorn Attention, now it means Sinkhorn normalisation, as everywhere else in the
library); and the options ``normalization=``, ``decoder_normalization=`` and
``pool_normalization=`` (now ``attention=``, ``decoder_attention=``, ``pool_attention=``,
:data:`RENAMED_OPTIONS`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from .._validation import check_positive_int
from ..attention.functional import NORMALIZATIONS
from ..attention.sparse import SparseOptions
from ..nn.sparse import BaselineSelfAttention, DenseSinkhornSelfAttention, SparseSinkhornAttention

__all__ = ["AttentionConfig", "ATTENTION_KINDS", "DENSE_KINDS", "SPARSE_MODEL_KINDS", "RENAMED_OPTIONS",
           "dense_attention", "model_attention", "old_option", "renamed_options"]

#: The kinds that take no size: :func:`sinkformer.attention`'s normalisations.
DENSE_KINDS: tuple[str, ...] = NORMALIZATIONS
#: The kinds with blocks (``KIND:B``; SortCut ``sortcut:KxB``).
BLOCK_KINDS = ("local", "fixed", "sparse", "sortcut", "mixture")
ATTENTION_KINDS = DENSE_KINDS + BLOCK_KINDS
#: What the Sparse Sinkhorn models build.
SPARSE_MODEL_KINDS = ("softmax", "sinkhorn") + BLOCK_KINDS
#: Model options renamed to the one vocabulary: old name -> new name.
RENAMED_OPTIONS = {"normalization": "attention", "decoder_normalization": "decoder_attention",
                   "pool_normalization": "pool_attention"}
_OLD_KINDS = {"vanilla": "softmax", "sinkformer": "sinkhorn"}
_FORMS = "'softmax', 'sinkhorn', 'local:32', 'fixed:32', 'sparse:32', 'sortcut:2x8' or 'mixture:32'"


def deprecated(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn (``FutureWarning``) that ``old`` is an old spelling of ``new``."""
    warnings.warn(f"{old} is an old spelling, write {new} (sinkformer.models.attention_spec: the models' one "
                  "attention vocabulary)", FutureWarning, stacklevel=stacklevel)


@dataclass
class AttentionConfig:
    """Which self-attention a model uses, with its options (see the module table).

    ``kind``: one of :data:`ATTENTION_KINDS`. ``block_size``: local/Sparse Sinkhorn block :math:`b`
    (Child et al.'s :math:`l` for ``fixed``); ``sort_iters``, ``temperature``:
    :class:`~sinkformer.attention.sparse.SparseOptions` (their defaults and checks); ``sort_net``,
    ``share_kv``: :class:`~sinkformer.nn.SparseSinkhornAttention`'s; ``sortcut_budget``: blocks kept
    by SortCut; ``stride``: summary positions per block of the fixed pattern (the paper's :math:`c = 8`);
    ``n_iters``: Sinkhorn normalisations of ``sinkhorn`` attention (1 = SoftMax).
    """

    kind: str = "sparse"
    block_size: int = 16
    sort_iters: int = SparseOptions.sort_iters
    temperature: float = SparseOptions.temperature
    sort_net: str = "linear"
    share_kv: bool = False
    sortcut_budget: int = 2
    stride: int = 8
    n_iters: int = 5

    def __post_init__(self) -> None:
        if self.kind in _OLD_KINDS:
            deprecated(f"attention kind {self.kind!r}", repr(_OLD_KINDS[self.kind]), stacklevel=4)
            self.kind = _OLD_KINDS[self.kind]
        if self.kind not in ATTENTION_KINDS:
            raise ValueError(f"attention kind must be one of {list(ATTENTION_KINDS)}, got {self.kind!r}")
        check_positive_int(self.block_size, "block_size")
        check_positive_int(self.n_iters, "n_iters")

    @classmethod
    def parse(cls, value: "AttentionConfig | str | dict | None" = None, **options: Any) -> "AttentionConfig":
        """An ``AttentionConfig`` from itself, a dict of its fields, ``None`` (the default), or a spec
        string ``KIND`` / ``KIND:B`` / ``sortcut:KxB`` (``"softmax"``, ``"sparse:32"``, ``"sortcut:2x8"``);
        ``options`` set further fields (e.g. ``n_iters=3``, ``temperature=0.5``)."""
        if isinstance(value, cls):
            return replace(value, **options) if options else value
        if value is None or isinstance(value, dict):
            return cls(**{**(value or {}), **options})
        if not isinstance(value, str):
            raise TypeError(f"attention must be an AttentionConfig, a dict, a spec string or None, "
                            f"got {type(value).__name__}")
        kind, sep, size = value.partition(":")
        if kind == "sinkhorn" and size.isdigit():
            deprecated(f"attention={value!r} (Sparse Sinkhorn Attention)", repr(f"sparse:{size}"))
            kind = "sparse"
        elif kind in _OLD_KINDS and (kind == "sinkformer" or not sep):  # "sinkformer:N": N iterations
            deprecated(f"attention={value!r}", repr(_OLD_KINDS[kind]) + (f" with n_iters={size}" if sep else ""))
            options = {**options, **({"n_iters": _int(size, value)} if sep else {})}
            kind, sep, size = _OLD_KINDS[kind], "", ""
        if kind not in ATTENTION_KINDS or sep and kind not in BLOCK_KINDS or sep and not size:
            raise ValueError(f"attention must be one of {_FORMS} (or {', '.join(map(repr, DENSE_KINDS[2:]))}), "
                             f"got {value!r}")
        if kind == "sortcut" and "x" in size:
            budget, _, size = size.partition("x")
            options["sortcut_budget"] = _int(budget, value)
        if size:
            options["block_size"] = _int(size, value)
        return cls(kind, **options)

    @property
    def spec(self) -> str:
        """The spec string of this kind and size (``"sparse:32"``, ``"sortcut:2x8"``, ``"sinkhorn"``)."""
        if self.kind not in BLOCK_KINDS:
            return self.kind
        budget = f"{self.sortcut_budget}x" if self.kind == "sortcut" else ""
        return f"{self.kind}:{budget}{self.block_size}"

    @property
    def label(self) -> str:
        """The paper's name for this model, e.g. ``"Sinkhorn Transformer (32)"``, ``"SortCut Sinkhorn (2x8)"``."""
        b = self.block_size
        return {
            "softmax": "Transformer",
            "local": f"Local Attention ({b})",
            "fixed": f"Sparse Transformer ({b})",
            "sparse": f"Sinkhorn Transformer ({b})",
            "sortcut": f"SortCut Sinkhorn ({self.sortcut_budget}x{b})",
            "mixture": f"Sinkhorn Mixture ({b})",
            "sinkhorn": f"Sinkformer (n_iters={self.n_iters})",
        }.get(self.kind, f"{self.kind} attention")

    def build(self, dim: int, heads: int, *, max_len: int, causal: bool, dropout: float = 0.0) -> nn.Module:
        """The self-attention module: ``forward(x (B, n, dim), key_padding_mask (B, n)) -> (B, n, dim)``."""
        if self.kind not in SPARSE_MODEL_KINDS:
            raise ValueError(f"attention {self.kind!r} is not served by the Sparse Sinkhorn models: they build "
                             f"{list(SPARSE_MODEL_KINDS)}")
        if self.kind in ("softmax", "local", "fixed"):
            pattern = {"softmax": "full", "local": "local", "fixed": "fixed"}[self.kind]
            stride = min(self.stride, self.block_size)
            return BaselineSelfAttention(dim, heads, pattern=pattern, block_size=self.block_size, stride=stride,
                                         causal=causal, dropout=dropout)
        if self.kind == "sinkhorn":
            return DenseSinkhornSelfAttention(dim, heads, n_iters=self.n_iters, causal=causal, dropout=dropout)
        if self.kind == "sortcut" and causal:
            raise ValueError("attention 'sortcut' cannot be causal: SortCut is an encoder-only scheme (§3.4)")
        return SparseSinkhornAttention(
            dim, heads, block_size=self.block_size, max_len=max_len, sort_iters=self.sort_iters,
            temperature=self.temperature, sort_net=self.sort_net, causal=causal,
            sortcut_budget=self.sortcut_budget if self.kind == "sortcut" else None,
            mixture=self.kind == "mixture", share_kv=self.share_kv, dropout=dropout,
        )


def _int(text: str, value: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"attention must be one of {_FORMS}, got {value!r}") from None


def dense_attention(attention: str, n_iters: int, *, argument: str = "attention",
                    old: str | None = None) -> tuple[str, int]:
    """``(normalization, n_iters)`` of a Transformer/Sinkformer model's ``attention`` spec, one of
    :data:`DENSE_KINDS` (an old spelling gives its new one, with a warning). ``old``: the value of the
    model's old option (``normalization=``...), which, when given, is used with a warning.

    Raises ``ValueError`` naming ``argument`` for a sparse kind (the Sparse Sinkhorn models serve those).
    """
    attention = old_option(attention, old, argument, stacklevel=5)
    spec = AttentionConfig.parse(attention, n_iters=n_iters)
    if spec.kind not in DENSE_KINDS:
        raise ValueError(f"{argument} must be one of {list(DENSE_KINDS)} for this model, got {attention!r}; "
                         "the sparse kinds are the Sparse Sinkhorn models' (sinkhorn_classifier, sinkhorn_seq2seq, "
                         "sinkhorn_lm)")
    return spec.kind, spec.n_iters


def old_option(value: Any, old: Any, name: str, *, stacklevel: int = 4) -> Any:
    """A model constructor's option ``name`` (``attention``, ``pool_attention``...): ``value``, or the value
    ``old`` of its old spelling (:data:`RENAMED_OPTIONS`) when given, with a ``FutureWarning`` pointing at
    the constructor's caller (``stacklevel`` counts from the warning: 4 when the constructor calls this)."""
    if old is None:
        return value
    old_name = next(o for o, new in RENAMED_OPTIONS.items() if new == name)
    deprecated(f"{old_name}={old!r}", f"{name}={old!r}", stacklevel=stacklevel)
    return old


def model_attention(attention: "AttentionConfig | str | dict | None", n_iters: int) -> AttentionConfig:
    """The :class:`AttentionConfig` of a Sparse Sinkhorn model's ``attention`` (``None``: ``"sparse"``, blocks
    of 16) and ``n_iters``: ``n_iters`` fills in where ``attention`` does not say (a spec string, ``None``, a
    dict without ``n_iters``); an ``AttentionConfig`` is used as it is."""
    if isinstance(attention, AttentionConfig):
        return attention
    if isinstance(attention, dict):
        return AttentionConfig.parse({"n_iters": n_iters, **attention})
    return AttentionConfig.parse(attention, n_iters=n_iters)


def renamed_options(options: dict[str, Any], where: str) -> dict[str, Any]:
    """``options`` with the old option names of :data:`RENAMED_OPTIONS` replaced by the new ones (a
    ``FutureWarning`` for each); ``where`` names them in messages (``"model 'vit'"``). Giving both
    spellings of one option is a ``ValueError``."""
    out = dict(options)
    for old, new in RENAMED_OPTIONS.items():
        if old in out:
            if new in out:
                raise ValueError(f"{where}: give {new} only ({old} is its old spelling), got both "
                                 f"{new}={out[new]!r} and {old}={out[old]!r}")
            deprecated(f"{where}: option {old}", new, stacklevel=4)
            out[new] = out.pop(old)
    return out
