"""Greedy and beam search: beam 1 is greedy, beam scores at least greedy's, the KV cache changes
nothing, batching changes nothing, and decoding stops at EOS or the length limit."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from torch import Tensor

from trident.backbone import KVCache, TransformerConfig
from trident.models.decoding import Decoding, beam_search, greedy_decode, length_penalty, max_lengths
from trident.models.seq2seq import EncoderDecoder

PAD, BOS, EOS, VOCAB = 0, 1, 2, 40
LENGTHS = [10, 7, 4, 9, 3, 10, 6, 8]

# Tiny tensors: intra-op threads only contend for the shared cores.
pytestmark = pytest.mark.usefixtures("single_thread")


def small_model(seed: int = 0, encoding: str = "sinusoidal", tie: str = "all") -> EncoderDecoder:
    """A random 2 + 2 layer model: untrained, but its next-token distributions are far from
    uniform, so that greedy and beam search choose differently."""
    torch.manual_seed(seed)
    cfg = TransformerConfig(d_model=32, n_heads=4, n_layers=2, d_ff=64, dropout=0.0, max_seq_len=64, pos_encoding=encoding)
    return EncoderDecoder(cfg, VOCAB, pad_id=PAD, tie_embeddings=tie).eval()


def sources(lengths: list[int] = LENGTHS, seed: int = 1) -> Tensor:
    """(B, S) right-padded sources of the given lengths (EOS included)."""
    generator = torch.Generator().manual_seed(seed)
    src = torch.full((len(lengths), max(lengths)), PAD)
    for i, n in enumerate(lengths):
        src[i, : n - 1] = torch.randint(3, VOCAB, (n - 1,), generator=generator)
        src[i, n - 1] = EOS
    return src


def model_score(model: EncoderDecoder, src: Tensor, tokens: list[int]) -> float:
    """Sum of log-probabilities of ``tokens`` + EOS for one source (1, S), by teacher forcing."""
    target = torch.tensor([[BOS, *tokens, EOS]])
    with torch.no_grad():
        log_probs = torch.log_softmax(model(src, target[:, :-1]).float(), dim=-1)  # (1, T, V)
    return float(log_probs[0].gather(1, target[0, 1:, None]).sum())


DECODE = Decoding(BOS, EOS, max_len_a=1.5, max_len_b=5, banned_ids=(PAD, BOS))


def test_beam_size_one_equals_greedy() -> None:
    model, src = small_model(), sources()
    greedy = greedy_decode(model, src, DECODE)
    beam = beam_search(model, src, DECODE, beam_size=1, alpha=0.0)
    assert [h.tokens for h in beam] == [h.tokens for h in greedy]
    assert [h.score for h in beam] == pytest.approx([h.score for h in greedy], abs=1e-5)


@pytest.mark.parametrize("seed", [0, 1])
def test_beam_finds_scores_at_least_greedys(seed: int) -> None:
    """Not a theorem (pruning can drop the greedy path), but it holds on this fixture; and the
    scores reported are the model's own (recomputed by teacher forcing)."""
    model, src = small_model(seed), sources(seed=seed + 1)
    greedy = greedy_decode(model, src, DECODE)
    better = 0
    for beam_size in (2, 4):
        beam = beam_search(model, src, DECODE, beam_size=beam_size, alpha=0.0)
        for i, (b, g) in enumerate(zip(beam, greedy)):
            assert b.score >= g.score - 1e-4, f"sentence {i}, beam {beam_size}"
            assert b.score == pytest.approx(model_score(model, src[i : i + 1, : LENGTHS[i]], b.tokens), abs=1e-4)
            better += b.score > g.score + 1e-3
    assert better > 0, "beam search should beat greedy somewhere on this fixture"


class ScriptedModel:
    """Next-token distributions fixed by the prefix, to build a case where greedy loses:
    first token 3 (p=0.6) or 4 (p=0.4); after 3 every continuation is unlikely (EOS 0.3),
    after 4 EOS is likely (0.9). Greedy: 3 EOS, p = 0.18; beam 2: 4 EOS, p = 0.36."""

    max_positions = 16

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor]:
        return torch.zeros(src.size(0), src.size(1), 1), src.eq(PAD)

    def decode(self, tgt_in: Tensor, memory: Tensor, memory_padding_mask: Tensor, *, cache: KVCache | None = None) -> Tensor:
        assert cache is None, "scripted model decodes without a cache"
        probs = torch.full((tgt_in.size(0), tgt_in.size(1), 6), 1e-6)
        for row, prefix in enumerate(tgt_in.tolist()):
            if len(prefix) == 1:
                probs[row, -1, 3], probs[row, -1, 4] = 0.6, 0.4
            elif prefix[1] == 3:
                probs[row, -1, [EOS, 3, 4, 5]] = torch.tensor([0.3, 0.25, 0.25, 0.2])
            else:
                probs[row, -1, EOS], probs[row, -1, 5] = 0.9, 0.1
        return probs.log()

    def new_cache(self, max_len: int) -> KVCache:
        raise AssertionError("not used")


def test_beam_beats_greedy_where_greedy_is_myopic() -> None:
    model, src = ScriptedModel(), torch.tensor([[3, 3, EOS]])
    options = Decoding(BOS, EOS, max_len_a=0.0, max_len_b=4, use_cache=False)
    greedy = greedy_decode(model, src, options)[0]
    beam = beam_search(model, src, options, beam_size=2, alpha=0.0)[0]
    assert greedy.tokens == [3] and greedy.score == pytest.approx(math.log(0.6 * 0.3), abs=1e-4)
    assert beam.tokens == [4] and beam.score == pytest.approx(math.log(0.4 * 0.9), abs=1e-4)


@pytest.mark.parametrize("encoding", ["sinusoidal", "learned", "rope", "alibi", "relative"])
def test_cached_and_uncached_decoding_give_the_same_tokens(encoding: str) -> None:
    model, src = small_model(encoding=encoding), sources()
    for beam_size in (1, 3):
        cached = beam_search(model, src, DECODE, beam_size=beam_size)
        uncached = beam_search(model, src, replace(DECODE, use_cache=False), beam_size=beam_size)
        assert [h.tokens for h in cached] == [h.tokens for h in uncached]
    cached_greedy = greedy_decode(model, src, DECODE)
    assert [h.tokens for h in cached_greedy] == [h.tokens for h in greedy_decode(model, src, replace(DECODE, use_cache=False))]


@pytest.mark.parametrize("tie", ["all", "decoder", "none"])
def test_batched_decoding_equals_one_sentence_at_a_time(tie: str) -> None:
    """Source padding must not change a translation (the encoder and cross-attention masks)."""
    model, src = small_model(tie=tie), sources()
    batched = beam_search(model, src, DECODE, beam_size=3)
    alone = [beam_search(model, src[i : i + 1, :n], DECODE, beam_size=3)[0] for i, n in enumerate(LENGTHS)]
    assert [h.tokens for h in batched] == [h.tokens for h in alone]


def test_hypotheses_respect_the_length_limit() -> None:
    model, src = small_model(), sources()
    limits = max_lengths(src.eq(PAD), 0.5, 2, limit=64).tolist()  # tokens incl. EOS
    assert limits == [int(0.5 * n + 2) for n in LENGTHS]
    options = replace(DECODE, max_len_a=0.5, max_len_b=2)
    for hyps in (greedy_decode(model, src, options), beam_search(model, src, options, beam_size=3)):
        assert all(len(h.tokens) + 1 <= limit for h, limit in zip(hyps, limits))
        assert all(not {EOS, BOS, PAD} & set(h.tokens) for h in hyps)


def test_length_limit_never_exceeds_the_model_positions() -> None:
    assert max_lengths(torch.zeros(1, 50, dtype=torch.bool), 2.0, 10, limit=64).tolist() == [64]


def test_gnmt_length_penalty() -> None:
    assert length_penalty(1, 0.0) == 1.0
    assert length_penalty(7, 0.6) == pytest.approx(2.0**0.6)


class ShortOrBetter:
    """Ending at once has p = 0.3; token 3 (p = 0.7) then EOS (p = 0.999) scores higher, even with alpha = -1:
    log(0.3) / lp(1) = -1.204 < log(0.7 * 0.999) / lp(2) = -0.417 (lp(2) = (7/6) ** -1)."""

    max_positions = 64

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor]:
        return torch.zeros(src.size(0), src.size(1), 1), src.eq(PAD)

    def decode(self, tgt_in: Tensor, memory: Tensor, memory_padding_mask: Tensor, *, cache: KVCache | None = None) -> Tensor:
        probs = torch.full((tgt_in.size(0), tgt_in.size(1), 6), 1e-4)
        for row, prefix in enumerate(tgt_in.tolist()):
            if len(prefix) == 1:
                probs[row, -1, EOS], probs[row, -1, 3] = 0.3, 0.7
            else:
                probs[row, -1, EOS] = 0.999
        return probs.log()

    def new_cache(self, max_len: int) -> KVCache:
        raise AssertionError("not used")


@pytest.mark.parametrize("alpha", [-1.0, -0.5, 0.0, 0.6])
def test_early_stopping_is_right_for_negative_length_penalties(alpha: float) -> None:
    """The stopping bound divided by lp(max length), the largest lp only for alpha >= 0: with alpha = -1 a
    sentence stopped after the first step and returned the empty hypothesis over [3]."""
    options = Decoding(BOS, EOS, max_len_a=0.0, max_len_b=30, use_cache=False)
    (beam,) = beam_search(ShortOrBetter(), torch.tensor([[3, EOS]]), options, beam_size=2, alpha=alpha)
    assert beam.tokens == [3]
    assert beam.normalized_score == pytest.approx(math.log(0.7 * 0.999) / float(length_penalty(2, alpha)), abs=1e-3)


def test_every_sentence_gets_a_hypothesis_even_when_its_scores_turn_non_finite() -> None:
    model, src = small_model(), sources()
    decode = model.decode

    def diverged_on_sentence_2(*args: object, **kwargs: object) -> Tensor:
        logits = decode(*args, **kwargs)
        logits[8:12] = float("nan")  # beam 4: sentence 2 owns rows 8..11
        return logits

    model.decode = diverged_on_sentence_2  # type: ignore[method-assign]
    beams = beam_search(model, src, DECODE, beam_size=4, alpha=0.6)
    assert len(beams) == len(LENGTHS)
    assert beams[2].tokens == [] and beams[2].score == float("-inf")
    assert all(math.isfinite(b.score) for i, b in enumerate(beams) if i != 2)
