r"""Greedy and beam-search decoding for encoder-decoder models.

Both work with any model exposing ``encode(src, src_padding_mask) -> memory`` and
``decode(tgt, memory, memory_padding_mask) -> logits (batch, T, vocab)`` plus ``bos_id``,
``eos_id`` and ``max_len`` attributes (e.g. :class:`sinkformer.models.Seq2SeqTransformer`).
Beam search re-runs the decoder on the whole prefix at each step (no key/value cache): simple,
and quadratic in the output length. Greedy decoding does the same, unless the model also offers
``decoding_caches() -> states | None`` and ``decode_step(tgt_new, memory, memory_padding_mask,
states) -> logits`` (:class:`~sinkformer.models.SinkhornSeq2Seq` with ``vanilla``, ``sinkformer`` or
causal Sparse Sinkhorn decoder attention): then each new token goes through the decoder alone against
per-layer states (:class:`~sinkformer.attention.CausalSinkhornCache`,
:class:`~sinkformer.nn.SparseSinkhornCache`) — the same logits as re-running the decoder, to
rounding, :math:`O(t)` per token and layer for ``n_iters <= 3``.

Beam search keeps the ``beam_size`` best prefixes by summed log-probability; a prefix ending in
``<eos>`` is finished with score :math:`\log p(y) / |y|^{\alpha}` (``length_penalty`` =
:math:`\alpha`, fairseq's convention, :math:`|y|` counting ``<eos>``); a sentence stops once
``beam_size`` hypotheses are finished.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["greedy_decode", "beam_search"]


def _strip(ids: list[int], eos_id: int) -> list[int]:
    return ids[: ids.index(eos_id)] if eos_id in ids else ids


@torch.no_grad()
def greedy_decode(
    model, src: Tensor, src_padding_mask: Tensor | None = None, *, max_len: int | None = None
) -> list[list[int]]:
    """Most likely next token at every step; returns one id list per sentence (no bos/eos)."""
    max_len = min(max_len or model.max_len, model.max_len)
    memory = model.encode(src, src_padding_mask)
    tokens = torch.full((src.shape[0], 1), model.bos_id, dtype=torch.long, device=src.device)
    finished = torch.zeros(src.shape[0], dtype=torch.bool, device=src.device)
    states = model.decoding_caches() if hasattr(model, "decoding_caches") else None
    while tokens.shape[1] < max_len and not bool(finished.all()):
        if states is None:
            logits = model.decode(tokens, memory, src_padding_mask)
        else:
            logits = model.decode_step(tokens[:, len(states[0]):], memory, src_padding_mask, states)
        next_token = logits[:, -1].argmax(-1)
        next_token = next_token.masked_fill(finished, model.eos_id)
        tokens = torch.cat([tokens, next_token.unsqueeze(1)], dim=1)
        finished |= next_token == model.eos_id
    return [_strip(row[1:], model.eos_id) for row in tokens.tolist()]


@torch.no_grad()
def beam_search(
    model,
    src: Tensor,
    src_padding_mask: Tensor | None = None,
    *,
    beam_size: int = 5,
    max_len: int | None = None,
    length_penalty: float = 1.0,
) -> list[list[int]]:
    """Beam search; returns the best finished hypothesis per sentence (no bos/eos)."""
    max_len = min(max_len or model.max_len, model.max_len)
    batch, k = src.shape[0], beam_size
    memory = model.encode(src, src_padding_mask).repeat_interleave(k, dim=0)  # (batch*k, S, d)
    mask = None if src_padding_mask is None else src_padding_mask.repeat_interleave(k, dim=0)
    tokens = torch.full((batch * k, 1), model.bos_id, dtype=torch.long, device=src.device)
    scores = torch.full((batch, k), float("-inf"), device=src.device)
    scores[:, 0] = 0.0  # all beams start identical: keep one
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(batch)]

    for _ in range(max_len - 1):
        logp = torch.log_softmax(model.decode(tokens, memory, mask)[:, -1].float(), dim=-1)
        vocab = logp.shape[-1]
        candidates = (scores.unsqueeze(-1) + logp.view(batch, k, vocab)).view(batch, -1)
        top_scores, top_index = candidates.topk(2 * k, dim=-1)
        next_rows, next_tokens, next_scores = [], [], []
        for b in range(batch):
            alive: list[tuple[int, int, float]] = []
            for score, index in zip(top_scores[b].tolist(), top_index[b].tolist()):
                if len(finished[b]) >= k or len(alive) == k or score == float("-inf"):
                    break
                beam, token = divmod(index, vocab)
                if token == model.eos_id:
                    prefix = tokens[b * k + beam, 1:].tolist()
                    finished[b].append((score / (len(prefix) + 1) ** length_penalty, prefix))
                else:
                    alive.append((b * k + beam, token, score))
            while len(alive) < k:  # finished sentence or too few candidates: dead filler beams
                alive.append((b * k, model.eos_id, float("-inf")))
            for row, token, score in alive:
                next_rows.append(row)
                next_tokens.append(token)
                next_scores.append(score)
        if all(len(f) >= k for f in finished):
            break
        rows = torch.tensor(next_rows, device=src.device)
        tokens = torch.cat([tokens[rows], torch.tensor(next_tokens, device=src.device).unsqueeze(1)], dim=1)
        scores = torch.tensor(next_scores, device=src.device).view(batch, k)

    results = []
    for b in range(batch):
        if not finished[b]:  # ran out of length: best alive prefix
            best = int(scores[b].argmax())
            prefix = tokens[b * k + best, 1:].tolist()
            finished[b].append((float(scores[b, best]) / max(len(prefix), 1) ** length_penalty, prefix))
        results.append(_strip(max(finished[b], key=lambda h: h[0])[1], model.eos_id))
    return results
