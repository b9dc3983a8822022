r"""Sinkhorn attention inside Hugging Face ``transformers`` models, in one line.

.. code-block:: python

    from sinkformer.integrations.huggingface import register

    register(n_iters=5)                                   # adds attn_implementation="sinkhorn"
    model = AutoModel.from_pretrained(path, attn_implementation="sinkhorn")

:func:`register` adds :func:`sinkhorn_attention_forward` to ``transformers.AttentionInterface``
and PyTorch-style boolean masks (``sdpa_mask``) to ``AttentionMaskInterface`` under the same
name — without the second, ``transformers`` hands a custom backend no mask and padding would
be ignored. Any model whose attention layers call the ``AttentionInterface`` (BERT, RoBERTa,
DistilBERT, ViT, the encoders of BART/T5, ...) then computes, in every bidirectional
self-attention layer,

.. math::

    \mathrm{out} = P V,\qquad P = \mathrm{Sinkhorn}_{n\_iters}\big(\mathrm{scaling}\cdot QK^\top
    + \mathrm{bias}\big)

through :func:`sinkformer.attention`, with the model's own ``scaling``, dropout and additive
biases (``position_bias``). ``n_iters=1`` is the model's SoftMax attention.

**Bidirectional self-attention becomes Sinkhorn; causal self-attention with** ``causal=True``.
By default causal (decoder) self-attention and cross-attention keep SoftMax (``transformers``'
own ``sdpa`` function), as in §6.3 of the Sinkformers paper ("we plug Sinkhorn's algorithm only
into the encoder part"). ``register(..., causal=True)`` makes every *causal self-attention*
layer a causal Sinkformer (:func:`sinkformer.attention` with ``is_causal=True``: row :math:`t`
is row :math:`t` of Sinkhorn on the prefix :math:`0..t` alone, so no output depends on a later
token), which turns a GPT-2-style model into a causal Sinkformer:

.. code-block:: python

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=register(3, "sinkhorn_lm", causal=True))
    model.generate(ids, max_new_tokens=50)          # incremental, equal to the full forward

Cross-attention always keeps SoftMax: its column normalisation would sum over all target
positions, a leak from the future. A ``UserWarning`` names each layer class that keeps SoftMax,
once, and ``output_attentions`` returns no weights for these layers (as with ``sdpa``). A layer
is cross-attention when its ``is_cross_attention`` attribute says so or its ``is_causal`` is
False in a decoder (``is_decoder`` or ``config.is_decoder``); it is causal when ``is_causal``
(the keyword or the attribute) is True — a layer without ``is_causal`` counts as causal, as in
``transformers``.

**Incremental decoding** (``generate()``, ``past_key_values``). A cached step gives the layer
the new queries (usually one) and the keys and values of the whole sequence; row :math:`t` of
causal Sinkhorn also needs the column sums of the earlier *queries*' attention, which the KV
cache does not hold. So each causal layer keeps a
:class:`~sinkformer.attention.CausalSinkhornCache` on the module (attribute
``_sinkformer_decoding``): a forward over the prompt (past length 0) without gradients — as
``generate()`` runs it — records the prompt's projections (references, kept until the next
forward); the first cached step replays them into the state (one more pass over the prompt:
:math:`O(n^2)` for ``n_iters <= 3``, :math:`O(n^3 n\_iters)` beyond), and every step then costs :math:`O(t)` per layer and
head (:math:`O(t^2 n\_iters)` for ``n_iters >= 4``), equal to the full forward. Each step checks
that the cached keys are those the state has seen (an :math:`O(t\,d)` comparison, a host sync
on GPUs) and raises ``ValueError`` otherwise: beam search and contrastive search, which reorder
or crop the cache, are refused (greedy decoding and sampling work), as are static caches. The
state keeps its own copy of the keys and values (twice the KV-cache memory). A new forward over
a prompt resets it. Attention masks must be the causal mask with key padding (left padding, as
``generate()`` uses); other patterns (sliding windows, packed sequences) are refused.

**Padding.** The 4-D mask built from the tokenizer's ``attention_mask`` excludes padded
*keys* only: a padded query still attends to every real token. In self-attention a token that
no query may attend to is padding, so it is removed as a query too: its row is zero and it
takes no part in the column normalisation — the masked-marginal semantics of the core, under
which the block of real tokens is doubly stochastic. Masks arrive as bool (True = attend) or
as float additive masks whose excluded entries hold ``torch.finfo(dtype).min`` or ``-inf``;
both are read, a float entry at or below :data:`sinkformer.attention.masks.MASKING` (-10⁴, so
also the older ``-10000`` and ``-1e9`` conventions) as excluded.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import Tensor

from .. import attention as sinkformer_attention
from .._validation import check_positive_int
from ..attention import CausalSinkhornCache
from ..attention.masks import causal_key_padding, self_attention_mask

try:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError as err:
    raise ImportError(
        "sinkformer.integrations.huggingface needs transformers>=5.4; install it with "
        "pip install 'sinkformer[hf]'"
    ) from err

__all__ = ["register", "sinkhorn_attention_forward", "self_attention_mask", "causal_key_padding"]

_UNSUPPORTED = ("softcap", "s_aux")  # score capping and attention sinks: no Sinkhorn analogue here


def register(n_iters: int = 5, name: str = "sinkhorn", *, causal: bool = False) -> str:
    """Make ``attn_implementation=name`` run Sinkhorn attention in ``transformers`` models.

    Args:
        n_iters: Sinkhorn normalisations (paper eq. (3)): 1 = SoftMax, odd counts end
            row-stochastic, more iterations get closer to doubly stochastic.
        name: the ``attn_implementation`` string; registering the same name again changes its
            ``n_iters`` and ``causal`` for every model using it (the lookup happens at each
            forward). Names ``transformers`` already uses (``"sdpa"``, ``"eager"``, ...) are refused.
        causal: also make causal self-attention layers (GPT-2, the decoders of BART/T5, ...)
            causal Sinkhorn, with incremental decoding (module docstring). Default ``False``:
            they keep SoftMax. Cross-attention keeps SoftMax either way.

    Returns:
        ``name``, so that ``from_pretrained(path, attn_implementation=register())`` reads well.
    """
    check_positive_int(n_iters, "n_iters")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__} {causal!r}")
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__} {name!r}")
    if not name:
        raise ValueError("name must be a non-empty string, got ''")
    existing = AttentionInterface().get(name)
    ours = isinstance(existing, functools.partial) and existing.func is sinkhorn_attention_forward
    if name == "eager" or (existing is not None and not ours):
        raise ValueError(f"name {name!r} is already an attention implementation of transformers; choose another name")
    AttentionInterface.register(name, functools.partial(sinkhorn_attention_forward, n_iters=n_iters, causal=causal))
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


def sinkhorn_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    *,
    n_iters: int = 5,
    causal: bool = False,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[Tensor, Tensor | None]:
    """The attention function :func:`register` installs (``transformers``' calling convention).

    Args:
        module: the calling attention layer (read for ``is_causal``, ``is_decoder``,
            ``is_cross_attention``, ``num_key_value_groups``; holds the decoding state of a
            causal layer).
        query: ``(B, H, n_q, d)``. key, value: ``(B, H_kv, n_k, d)``; ``H_kv`` divides ``H``. In
            a causal layer ``n_k - n_q`` is the past length (0 for a full forward).
        attention_mask: ``None`` or ``(B, 1 | H, n_q, n_k)``, bool (True = attend) or additive
            float.
        n_iters: Sinkhorn normalisations. causal: causal Sinkhorn in causal self-attention
            layers (else SoftMax there). dropout: on the weights. scaling: score factor
            (default ``d**-0.5``).
        kwargs: ``output_attentions`` (return the weights), ``position_bias`` (added to the
            scores; not in causal layers), ``is_causal``; others are passed on to ``sdpa`` in
            the layers that keep SoftMax.

    Returns:
        ``(B, n_q, H, d)`` output and the ``(B, H, n_q, n_k)`` weights when
        ``output_attentions`` is set (``None`` otherwise, and always in a cached decoding step).
    """
    kind = _layer_kind(module, query, key, kwargs.get("is_causal"))
    if kind == "cross" or (kind == "causal" and not causal):
        what = "cross-attention layers keep" if causal else "causal and cross-attention layers keep"
        how = ("its column normalisation would sum over all target positions" if causal else
               "Sinkhorn runs only in bidirectional self-attention, as in §6.3 of the Sinkformers paper; "
               "register(..., causal=True) makes causal self-attention causal Sinkhorn")
        warnings.warn(f"{type(module).__name__}: {what} SoftMax attention (sdpa); {how}.", UserWarning, stacklevel=2)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    for option in _UNSUPPORTED:
        if kwargs.get(option) is not None:
            raise ValueError(f"sinkhorn attention does not support {option}= (passed by {type(module).__name__})")
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:  # grouped-query attention: head h reads key/value head h // groups
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    want_weights = bool(kwargs.get("output_attentions", False))
    if kind == "causal":
        if kwargs.get("position_bias") is not None:
            raise ValueError(f"causal sinkhorn attention does not support position_bias= (passed by {type(module).__name__})")
        return _causal_sinkhorn(module, query, key, value, attention_mask, n_iters, dropout, scaling, want_weights)
    mask = self_attention_mask(attention_mask, kwargs.get("position_bias"))
    result = sinkformer_attention(query, key, value, n_iters=n_iters, scale=scaling, attn_mask=mask,
                                  dropout_p=dropout, return_weights=want_weights)
    out, weights = result if want_weights else (result, None)
    return out.transpose(1, 2).contiguous(), weights


def _causal_sinkhorn(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                     n_iters: int, dropout: float, scaling: float | None,
                     want_weights: bool) -> tuple[Tensor, Tensor | None]:
    """Causal Sinkhorn in a causal self-attention layer: a full forward (past length 0) through
    :func:`sinkformer.attention`, or a cached decoding step through the module's state."""
    n_q, n_k = query.shape[-2], key.shape[-2]
    past = n_k - n_q
    if past < 0:
        raise ValueError(f"{type(module).__name__}: causal self-attention with {n_q} queries but {n_k} keys")
    pad = causal_key_padding(attention_mask, n_q, n_k)
    if past == 0:
        # a new sequence: the decoding state restarts from this prompt (replayed at the first cached step)
        record = None if torch.is_grad_enabled() else (query.detach(), key.detach(), value.detach(), pad)
        module._sinkformer_decoding = _DecodingState(n_iters, scaling, record)
        result = sinkformer_attention(query, key, value, n_iters=n_iters, scale=scaling, is_causal=True,
                                      key_padding_mask=pad, dropout_p=dropout, return_weights=want_weights)
        out, weights = result if want_weights else (result, None)
        return out.transpose(1, 2).contiguous(), weights
    if dropout > 0:
        raise ValueError(f"{type(module).__name__}: incremental causal Sinkhorn decoding runs without dropout "
                         f"(eval mode), got dropout={dropout}")
    state = getattr(module, "_sinkformer_decoding", None)
    cache = None if state is None else state.ready(n_iters, scaling, key[..., :past, :], pad, past)
    if cache is None:
        raise ValueError(
            f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}): a cached step with a past of "
            f"{past} token(s) that this layer's causal Sinkhorn state has not seen. Incremental decoding must follow a "
            "forward over the prompt run without gradients (as generate() does) and then every step in order; beam "
            "search and contrastive search (which reorder or crop the cache) and static caches are not supported."
        )
    new_pad = None if pad is None else pad[:, None, past:]
    out = cache.step(query, key[..., past:, :], value[..., past:, :], key_padding_mask=new_pad)
    return out.transpose(1, 2).contiguous(), None


class _DecodingState:
    """A causal layer's :class:`~sinkformer.attention.CausalSinkhornCache`, built lazily from the
    prompt's recorded projections at the first cached step."""

    def __init__(self, n_iters: int, scale: float | None, record: tuple | None) -> None:
        self.n_iters, self.scale, self.record = n_iters, scale, record
        self.cache: CausalSinkhornCache | None = None

    def ready(self, n_iters: int, scale: float | None, past_keys: Tensor, pad: Tensor | None,
              past: int) -> CausalSinkhornCache | None:
        """The cache holding exactly the ``past`` tokens of ``past_keys`` (with the padding ``pad``),
        or ``None`` when this state does not match them."""
        if (n_iters, scale) != (self.n_iters, self.scale):
            return None
        if self.cache is None:
            if self.record is None:
                return None
            q, k, v, prompt_pad = self.record
            self.cache, self.record = CausalSinkhornCache(n_iters, scale=scale), None
            self.cache.step(q, k, v, key_padding_mask=None if prompt_pad is None else prompt_pad[:, None, :])
        cache = self.cache
        if len(cache) != past or cache.keys.shape[:-2] != past_keys.shape[:-2]:
            return None
        valid = torch.ones(past_keys.shape[0], past, dtype=torch.bool, device=past_keys.device) if pad is None else ~pad[:, :past]
        same_valid = torch.equal(cache.valid, valid[:, None, :].expand_as(cache.valid))
        same_keys = torch.equal(cache.keys, past_keys.to(cache.keys.dtype))
        return cache if same_valid and same_keys else None


def _layer_kind(module: torch.nn.Module, query: Tensor, key: Tensor, is_causal: bool | None) -> str:
    """``"bidirectional"`` (self-attention), ``"causal"`` (causal self-attention) or ``"cross"``:
    see the module docstring."""
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)  # transformers' own default (sdpa)
    decoder = getattr(module, "is_decoder", False) or getattr(getattr(module, "config", None), "is_decoder", False)
    if getattr(module, "is_cross_attention", False):
        return "cross"
    if is_causal:
        return "causal"
    return "cross" if decoder or query.shape[-2] != key.shape[-2] else "bidirectional"
