"""Turn a (trained) Transformer into a Sinkformer by swapping its attention modules."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from .._validation import check_choice, check_positive_int
from ..attention import COSTS, NORMALIZATIONS
from .multihead import MultiheadAttention

__all__ = ["convert"]


def convert(
    model: torch.nn.Module,
    n_iters: int = 5,
    normalization: str = "sinkhorn",
    *,
    cost: str = "dot",
    where: Callable[[str, torch.nn.Module], bool] | None = None,
    verbose: bool = True,
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
        verbose: print how many modules were converted.
        return_count: return ``(model, count)`` instead of ``model``.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    check_positive_int(n_iters, "n_iters")
    check_choice(normalization, "normalization", NORMALIZATIONS)
    check_choice(cost, "cost", COSTS)

    targets = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.MultiheadAttention) and (where is None or where(name, module))
    ]
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
    if count == 0:
        warnings.warn("convert() found no torch.nn.MultiheadAttention module to convert", stacklevel=2)
    elif verbose:
        print(f"sinkformer.convert: {count} attention module(s) now use {normalization!r} (n_iters={n_iters})")
    return (model, count) if return_count else model


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
