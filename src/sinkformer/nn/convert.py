"""Turn a (trained) Transformer into a Sinkformer by swapping its attention modules.

:func:`convert` reports what it converted through the :mod:`logging` logger
``"sinkformer.nn.convert"`` (a child of ``"sinkformer"``), never with ``print``: at INFO with
``verbose=True``, at DEBUG otherwise (the default), so the library is quiet unless the
application shows those levels, e.g. ``logging.basicConfig(level=logging.INFO)`` (as
``sinkformer``'s command line does).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable

import torch

from .._validation import check_choice, check_positive_int
from ..attention import COSTS, NORMALIZATIONS
from .multihead import MultiheadAttention

__all__ = ["convert"]

logger = logging.getLogger(__name__)


def convert(
    model: torch.nn.Module,
    n_iters: int = 5,
    normalization: str = "sinkhorn",
    *,
    cost: str = "dot",
    where: Callable[[str, torch.nn.Module], bool] | None = None,
    causal: bool = False,
    verbose: bool = False,
    return_count: bool = False,
) -> torch.nn.Module | tuple[torch.nn.Module, int]:
    """Replace every ``torch.nn.MultiheadAttention`` in ``model`` by :class:`MultiheadAttention`.

    The new modules keep the weights (same ``state_dict``), device, dtype and train/eval mode,
    so this is the paper's "Sinkformer with the weights of the trained Transformer" (§6.3):
    with ``n_iters=1`` the model computes exactly what it computed before.

    Args:
        model: any module; converted in place and returned.
        n_iters: Sinkhorn normalisations for the new modules.
        normalization: normalisation for the new modules (default ``"sinkhorn"``).
        cost: ``"dot"`` or ``"l2"``.
        where: optional ``(qualified_name, module) -> bool`` selecting which attention modules to
            convert (e.g. ``lambda name, m: name.startswith("encoder")`` for §6.3's encoder-only
            Sinkformer). Default: all.
        causal: with ``normalization="sinkhorn"``, also make the *self-attention* of every
            ``nn.TransformerDecoderLayer`` a causal Sinkformer: called with ``is_causal=True``
            (``tgt_is_causal=True``, or ``nn.Transformer``'s causal ``tgt_mask``), it computes causal
            Sinkhorn — row :math:`t` balanced on the prefix :math:`0..t` alone, so no output depends on
            a later token. The decoder's *cross-attention* (``multihead_attn``) stays on SoftMax either
            way, with a warning: its column normalisation would sum over all target positions, so past
            outputs would depend on future tokens under teacher forcing. Default ``False``: both
            decoder attentions stay on SoftMax (the paper's §6.3), with a warning that names them.
        verbose: log how many modules were converted at INFO (default ``False``: at DEBUG) on the
            logger ``"sinkformer.nn.convert"``; nothing is printed — configure :mod:`logging` to
            see it (``logging.basicConfig(level=logging.INFO)``). The count is also returned with
            ``return_count=True``.
        return_count: return ``(model, count)`` instead of ``model``.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    check_positive_int(n_iters, "n_iters")
    check_choice(normalization, "normalization", NORMALIZATIONS)
    check_choice(cost, "cost", COSTS)

    self_names, cross_names = _decoder_attention(model)
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.MultiheadAttention) and (where is None or where(name, module))
    ]
    kept: list[str] = []
    if normalization == "sinkhorn":
        leaking = cross_names if causal else self_names | cross_names
        kept = [name for name, _ in targets if name in leaking]
    targets = [(name, module) for name, module in targets if name not in kept]
    for name, old in targets:
        if isinstance(old, MultiheadAttention):
            old.normalization, old.n_iters, old.cost = normalization, n_iters, cost
            continue
        new = _like(old, normalization=normalization, n_iters=n_iters, cost=cost)
        if name == "":
            raise TypeError("model is itself a torch.nn.MultiheadAttention; build sinkformer.nn.MultiheadAttention instead")
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, new)

    # nn.TransformerEncoder may pack padded batches into nested tensors, which bypasses attention
    for module in model.modules():
        if isinstance(module, torch.nn.TransformerEncoder):
            module.use_nested_tensor = False

    count = len(targets)
    if kept:
        warnings.warn(_kept_message(kept, causal), stacklevel=2)
    if count == 0 and not kept:
        warnings.warn("convert() found no torch.nn.MultiheadAttention module to convert", stacklevel=2)
    else:
        logger.log(logging.INFO if verbose else logging.DEBUG,
                   "sinkformer.convert: %d attention module(s) now use %r (n_iters=%d)", count, normalization, n_iters)
    return (model, count) if return_count else model


def _decoder_attention(model: torch.nn.Module) -> tuple[set[str], set[str]]:
    """Qualified names of the attention modules with causal queries: the self-attentions and the
    cross-attentions of every ``nn.TransformerDecoderLayer``."""
    prefixes = [f"{name}." if name else "" for name, module in model.named_modules()
                if isinstance(module, torch.nn.TransformerDecoderLayer)]
    return {p + "self_attn" for p in prefixes}, {p + "multihead_attn" for p in prefixes}


def _kept_message(kept: list[str], causal: bool) -> str:
    """The warning of :func:`convert` for the decoder attention it leaves on SoftMax."""
    names = ", ".join(kept)
    if causal:
        return (
            f"convert(causal=True) kept {len(kept)} decoder cross-attention module(s) on SoftMax ({names}): "
            "Sinkhorn's column normalisation would sum over all target positions, so past outputs would depend on "
            "future tokens. The decoder self-attention is now causal Sinkhorn (each prefix balanced on its own)."
        )
    return (
        f"convert() kept {len(kept)} decoder attention module(s) on SoftMax ({names}): their queries are causal, "
        "and Sinkhorn's column normalisation sums over all queries, so past outputs would depend on future tokens. "
        "Pass causal=True to make the decoder self-attention causal Sinkhorn (each prefix balanced on its own, no "
        "leak); the cross-attention stays on SoftMax."
    )


def _like(old: torch.nn.MultiheadAttention, **options) -> MultiheadAttention:
    """A sinkformer module with the configuration, weights, device, dtype and mode of ``old``."""
    weight = old.in_proj_weight if old._qkv_same_embed_dim else old.q_proj_weight
    new = MultiheadAttention(
        old.embed_dim,
        old.num_heads,
        dropout=old.dropout,
        bias=old.in_proj_bias is not None,
        add_bias_kv=old.bias_k is not None,
        add_zero_attn=old.add_zero_attn,
        kdim=old.kdim,
        vdim=old.vdim,
        batch_first=old.batch_first,
        device=weight.device,
        dtype=weight.dtype,
        **options,
    )
    new.load_state_dict(old.state_dict())
    new.train(old.training)
    return new
