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

**Only bidirectional self-attention becomes Sinkhorn.** Causal (decoder) self-attention and
cross-attention keep SoftMax (``transformers``' own ``sdpa`` function), as in §6.3 of the
Sinkformers paper ("we plug Sinkhorn's algorithm only into the encoder part"): Sinkhorn under
a causal mask is not the paper's model. A ``UserWarning`` names the layer class once, and
``output_attentions`` returns no weights for these layers (as with ``sdpa``). A layer is
causal or cross-attention when its ``is_causal``, ``is_decoder`` or ``is_cross_attention``
attribute (or ``config.is_decoder``) says so, or when queries and keys have different lengths;
a layer without ``is_causal`` counts as causal, as in ``transformers``.

**Padding.** The 4-D mask built from the tokenizer's ``attention_mask`` excludes padded
*keys* only: a padded query still attends to every real token. In self-attention a token that
no query may attend to is padding, so it is removed as a query too: its row is zero and it
takes no part in the column normalisation — the masked-marginal semantics of the core, under
which the block of real tokens is doubly stochastic. Masks arrive as bool (True = attend) or
as float additive masks whose excluded entries hold ``torch.finfo(dtype).min`` or ``-inf``;
both are read.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import Tensor

from .. import attention as sinkformer_attention
from .._validation import check_positive_int

try:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError as err:
    raise ImportError(
        "sinkformer.integrations.huggingface needs transformers>=5.4; install it with "
        "pip install 'sinkformer[hf]'"
    ) from err

__all__ = ["register", "sinkhorn_attention_forward", "self_attention_mask"]

_UNSUPPORTED = ("softcap", "s_aux")  # score capping and attention sinks: no Sinkhorn analogue here


def register(n_iters: int = 5, name: str = "sinkhorn") -> str:
    """Make ``attn_implementation=name`` run Sinkhorn attention in ``transformers`` models.

    Args:
        n_iters: Sinkhorn normalisations (paper eq. (3)): 1 = SoftMax, odd counts end
            row-stochastic, more iterations get closer to doubly stochastic.
        name: the ``attn_implementation`` string; registering the same name again changes its
            ``n_iters`` for every model using it (the lookup happens at each forward). Names ``transformers`` already uses (``"sdpa"``, ``"eager"``, ...) are
            refused.

    Returns:
        ``name``, so that ``from_pretrained(path, attn_implementation=register())`` reads well.
    """
    check_positive_int(n_iters, "n_iters")
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__} {name!r}")
    if not name:
        raise ValueError("name must be a non-empty string, got ''")
    existing = AttentionInterface().get(name)
    ours = isinstance(existing, functools.partial) and existing.func is sinkhorn_attention_forward
    if name == "eager" or (existing is not None and not ours):
        raise ValueError(f"name {name!r} is already an attention implementation of transformers; choose another name")
    AttentionInterface.register(name, functools.partial(sinkhorn_attention_forward, n_iters=n_iters))
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
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[Tensor, Tensor | None]:
    """The attention function :func:`register` installs (``transformers``' calling convention).

    Args:
        module: the calling attention layer (read for ``is_causal``, ``is_decoder``,
            ``num_key_value_groups``).
        query: ``(B, H, n_q, d)``. key, value: ``(B, H_kv, n_k, d)``; ``H_kv`` divides ``H``.
        attention_mask: ``None`` or ``(B, 1 | H, n_q, n_k)``, bool (True = attend) or additive
            float.
        n_iters: Sinkhorn normalisations. dropout: on the weights. scaling: score factor
            (default ``d**-0.5``).
        kwargs: ``output_attentions`` (return the weights), ``position_bias`` (added to the
            scores), ``is_causal``; others are passed on to ``sdpa`` in causal/cross layers.

    Returns:
        ``(B, n_q, H, d)`` output and the ``(B, H, n_q, n_k)`` weights when
        ``output_attentions`` is set (``None`` otherwise).
    """
    if not _is_bidirectional_self_attention(module, query, key, kwargs.get("is_causal")):
        warnings.warn(
            f"{type(module).__name__}: causal and cross-attention layers keep SoftMax attention (sdpa); "
            "Sinkhorn runs only in bidirectional self-attention, as in §6.3 of the Sinkformers paper.",
            UserWarning,
            stacklevel=2,
        )
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    for option in _UNSUPPORTED:
        if kwargs.get(option) is not None:
            raise ValueError(f"sinkhorn attention does not support {option}= (passed by {type(module).__name__})")
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:  # grouped-query attention: head h reads key/value head h // groups
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    mask = self_attention_mask(attention_mask, kwargs.get("position_bias"))
    want_weights = bool(kwargs.get("output_attentions", False))
    result = sinkformer_attention(query, key, value, n_iters=n_iters, scale=scaling, attn_mask=mask,
                                  dropout_p=dropout, return_weights=want_weights)
    out, weights = result if want_weights else (result, None)
    return out.transpose(1, 2).contiguous(), weights


def self_attention_mask(attention_mask: Tensor | None, position_bias: Tensor | None = None) -> Tensor | None:
    """The ``attn_mask`` for :func:`sinkformer.attention` from a self-attention layer's 4-D mask.

    ``keep`` is the bool mask itself, or for a float mask the entries above
    ``torch.finfo(dtype).min / 2`` (``transformers`` writes ``finfo.min``, or ``-inf``, where a
    pair is excluded). A token no query may attend to — column ``j`` all excluded, i.e. padding
    — is removed as a query as well: ``keep[..., j, :] = False``.

    Args:
        attention_mask: ``None`` or ``(B, 1 | H, n, n)``. position_bias: ``None`` or a float bias
            broadcastable to ``(B, H, n, n)``.

    Returns:
        ``position_bias`` (possibly ``None``) when there is no mask; the bool ``keep`` when there
        is no bias; otherwise the float bias with ``-inf`` where ``keep`` is False.
    """
    if attention_mask is None:
        return position_bias
    if attention_mask.dtype == torch.bool:
        keep, bias = attention_mask, None
    else:
        keep = attention_mask > torch.finfo(attention_mask.dtype).min / 2
        bias = attention_mask.masked_fill(~keep, 0.0)
    is_token = keep.any(dim=-2, keepdim=True)  # (B, h, 1, n): False on padding
    keep = keep & is_token.transpose(-1, -2)
    if position_bias is not None:
        bias = position_bias if bias is None else bias + position_bias
    return keep if bias is None else bias.masked_fill(~keep, float("-inf"))


def _is_bidirectional_self_attention(module: torch.nn.Module, query: Tensor, key: Tensor,
                                     is_causal: bool | None) -> bool:
    """False for causal (decoder) and cross-attention layers; see the module docstring."""
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)  # transformers' own default (sdpa)
    decoder = getattr(module, "is_decoder", False) or getattr(getattr(module, "config", None), "is_decoder", False)
    cross = getattr(module, "is_cross_attention", False)
    return not (is_causal or decoder or cross) and query.shape[-2] == key.shape[-2]
