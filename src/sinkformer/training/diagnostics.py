r"""Attention diagnostics: the column sums of every attention matrix (Sinkformers paper, Figure 2).

The paper observes that the attention matrices of a trained Transformer become nearly doubly
stochastic: the column sums :math:`\sum_i K_{ij}` of the row-stochastic SoftMax matrices
concentrate around 1 during training. :class:`AttentionRecorder` collects them.

While attached, it asks every attention module — :class:`torch.nn.MultiheadAttention` (hence
:class:`sinkformer.nn.MultiheadAttention`) and :class:`sinkformer.nn.offset_attention.OffsetAttention`
— for its weights (``need_weights=True``, per head) through a forward pre-hook, and stores
:math:`\sum_i P_{ij}` of each matrix. When detached no hook is installed at all, so training
runs exactly as fast as without diagnostics.
"""

from __future__ import annotations

import inspect
from functools import partial

import torch
from torch import Tensor

from ..nn.offset_attention import OffsetAttention

__all__ = ["AttentionRecorder", "ATTENTION_MODULES"]

ATTENTION_MODULES = (torch.nn.MultiheadAttention, OffsetAttention)


def _ask_for_weights(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook: call ``module`` with ``need_weights=True`` (and per-head weights)."""
    bound = inspect.signature(module.forward).bind(*args, **kwargs)
    bound.arguments["need_weights"] = True
    if "average_attn_weights" in inspect.signature(module.forward).parameters:
        bound.arguments["average_attn_weights"] = False
    return bound.args, bound.kwargs


class AttentionRecorder:
    """Record the column sums of the attention matrices computed inside ``model``.

    Use as a context manager (or :meth:`attach` / :meth:`detach`)::

        with AttentionRecorder(model) as recorder:
            model(x)
        recorder.column_sums()   # {module name: 1-D tensor of all recorded column sums}

    Padding keys contribute zero columns.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._handles: list = []
        self._sums: dict[str, list[Tensor]] = {}

    def attach(self) -> "AttentionRecorder":
        if self._handles:
            return self
        for name, module in self.model.named_modules():
            if isinstance(module, ATTENTION_MODULES):
                self._handles.append(module.register_forward_pre_hook(_ask_for_weights, with_kwargs=True))
                self._handles.append(module.register_forward_hook(partial(self._record, name)))
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> "AttentionRecorder":
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.detach()

    def _record(self, name: str, module: torch.nn.Module, args: tuple, output: tuple) -> None:
        weights = output[1]
        if weights is not None:  # (..., n_q, n_k) -> one row of column sums per matrix
            self._sums.setdefault(name, []).append(weights.detach().float().sum(-2).flatten(0, -2).cpu())

    def column_sums(self) -> dict[str, Tensor]:
        """All recorded column sums per module, flattened to 1-D."""
        return {name: torch.cat([s.flatten() for s in sums]) for name, sums in self._sums.items()}

    def coefficient_of_variation(self) -> float:
        """Mean over recorded matrices of std/mean of their column sums (0 = doubly stochastic)."""
        values = [s.std(-1, unbiased=False) / s.mean(-1).clamp_min(1e-12) for sums in self._sums.values() for s in sums]
        return float(torch.cat(values).mean()) if values else float("nan")

    def reset(self) -> None:
        self._sums = {}
