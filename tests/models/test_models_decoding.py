import torch

from sinkformer.models import Seq2SeqTransformer, beam_search, greedy_decode

PAD, BOS, EOS, A, B = range(5)


class Lattice:
    """A fake encoder-decoder with fixed next-token probabilities, where greedy search is not optimal.

    First token: A (0.6) or B (0.4). After A: EOS 0.4, A 0.3, B 0.3. After B: EOS 1.0.
    Greedy picks A then EOS (p = 0.24); the best sentence is B EOS (p = 0.4).
    """

    bos_id, eos_id, max_len = BOS, EOS, 6

    def encode(self, src, src_padding_mask=None):
        return torch.zeros(src.shape[0], 1, 1)

    def decode(self, tgt, memory, memory_padding_mask=None):
        probs = torch.full((tgt.shape[0], tgt.shape[1], 5), 1e-9)
        for row, prefix in enumerate(tgt.tolist()):
            last = prefix[-1]
            if last == BOS:
                probs[row, -1, A], probs[row, -1, B] = 0.6, 0.4
            elif last == A:
                probs[row, -1, EOS], probs[row, -1, A], probs[row, -1, B] = 0.4, 0.3, 0.3
            else:
                probs[row, -1, EOS] = 1.0
        return probs.log()


def test_beam_search_beats_greedy_on_a_lattice():
    src = torch.zeros(2, 3, dtype=torch.long)
    assert greedy_decode(Lattice(), src) == [[A], [A]]
    assert beam_search(Lattice(), src, beam_size=2) == [[B], [B]]


def test_beam_of_one_is_greedy():
    torch.manual_seed(0)
    model = Seq2SeqTransformer(30, dim=16, encoder_layers=1, decoder_layers=1, num_heads=2, dim_feedforward=32,
                               dropout=0.0, max_len=12).eval()
    src = torch.randint(4, 30, (3, 7))
    assert beam_search(model, src, beam_size=1) == greedy_decode(model, src)


def test_wide_beam_search_is_exhaustive():
    """With a beam wider than the search space, beam search returns the best sentence by brute force."""
    torch.manual_seed(1)
    vocab, max_len = 6, 4  # finished sentences: up to 2 tokens (ids != eos) then <eos>
    model = Seq2SeqTransformer(vocab, dim=16, encoder_layers=1, decoder_layers=1, num_heads=2, dim_feedforward=32,
                               dropout=0.0, max_len=max_len).eval()
    src = torch.tensor([[4, 5, 3]])

    def score(ids):  # log p(ids <eos>) / |ids <eos>|, the ranking of finished sentences
        logp = torch.log_softmax(model(src, torch.tensor([[BOS] + ids]))[0], -1)
        targets = ids + [EOS]
        return sum(logp[t, y].item() for t, y in enumerate(targets)) / len(targets)

    words = [t for t in range(vocab) if t != EOS]
    candidates = [[]] + [[a] for a in words] + [[a, b] for a in words for b in words]
    best = max(candidates, key=score)
    assert beam_search(model, src, beam_size=200, length_penalty=1.0) == [best]
