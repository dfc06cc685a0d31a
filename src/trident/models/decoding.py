"""Batched greedy and beam-search decoding for encoder-decoder models.

Both encode the source once, keep the decoder's self-attention keys/values in a KV cache (each
step feeds only the newest token) and project the encoder output for cross-attention once (the
cache's ``memory``). A hypothesis ends at EOS or at its maximum length ``a * src_len + b``
(source length in tokens, EOS included, as in fairseq), where EOS is forced.

The model score of a hypothesis is the sum of the log-probabilities of its tokens and its EOS.
Beam search ranks finished hypotheses by score / lp, with the GNMT length penalty
lp = ((5 + length) / 6) ** alpha (Wu et al. 2016; the paper used beam 4, alpha 0.6); the
length counts generated tokens, EOS included (as fairseq does).

``scoring=transformers`` scores as transformers' ``generate`` does (BART read from Hugging Face): the length penalty
is length ** alpha, and a forced token (``first_id``, EOS at the length limit) scores 0, as its forced-token logits
processors leave it, not its log-probability. Either way the search stops only when no live beam can beat the best
finished hypothesis: ``generate``'s ``early_stopping="never"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from trident.backbone import KVCache


class Seq2SeqModel(Protocol):
    def encode(self, src: Tensor) -> tuple[Tensor, Tensor]: ...

    def decode(self, tgt_in: Tensor, memory: Tensor, memory_padding_mask: Tensor, *, cache: KVCache | None = None) -> Tensor: ...

    def new_cache(self, max_len: int) -> KVCache: ...

    @property
    def max_positions(self) -> int: ...


@dataclass(frozen=True)
class Decoding:
    """What greedy and beam search both follow: the sequence's first token, the token that ends it, its maximum
    length ``max_len_a * src_len + max_len_b`` (see :func:`max_lengths`), tokens never to generate, and whether the
    decoder's keys/values are cached (False recomputes the prefix each step: the reference the cache is tested by)."""

    bos_id: int
    eos_id: int
    max_len_a: float = 1.2
    max_len_b: int = 10
    banned_ids: tuple[int, ...] = ()
    use_cache: bool = True
    first_id: int | None = None  # the token the first step must generate (BART's forced_bos_token_id)
    scoring: str = "gnmt"  # one of SCORINGS: see the module's docstring


SCORINGS = ("gnmt", "transformers")


@dataclass
class Hypothesis:
    tokens: list[int]  # generated tokens, without BOS and EOS
    score: float  # model score: sum of log-probabilities, EOS included
    normalized_score: float  # score / length penalty: what beam search ranks by


def length_penalty(length: int | Tensor, alpha: float, scoring: str = "gnmt") -> float | Tensor:
    """GNMT: ((5 + length) / 6) ** alpha; transformers: length ** alpha; alpha = 0 ranks by the raw model score."""
    return length**alpha if scoring == "transformers" else ((5 + length) / 6) ** alpha


def max_lengths(padding: Tensor, a: float, b: int, limit: int) -> Tensor:
    """(B,) most tokens to generate per sentence (EOS included): a * src_len + b, at least 1,
    at most ``limit`` (the decoder must hold BOS plus all but the last generated token)."""
    src_len = (~padding).sum(dim=1).float()
    return (a * src_len + b).floor().long().clamp(min=1, max=limit)


class _StepDecoder:
    """Feeds the decoder one step at a time, with the KV cache or by recomputing the prefix."""

    def __init__(self, model: Seq2SeqModel, memory: Tensor, padding: Tensor, max_len: int, use_cache: bool) -> None:
        self.model, self.memory, self.padding = model, memory, padding
        self.cache = model.new_cache(max_len) if use_cache else None

    def log_probs(self, tokens: Tensor) -> Tensor:
        """``tokens``: (R, t) every row's prefix so far -> (R, V) fp32 next-token log-probs."""
        if self.cache is not None:
            logits = self.model.decode(tokens[:, -1:], self.memory, self.padding, cache=self.cache)
        else:
            logits = self.model.decode(tokens, self.memory, self.padding)
        return F.log_softmax(logits[:, -1].float(), dim=-1)

    def reorder(self, rows: Tensor) -> None:
        if self.cache is not None:
            self.cache.reorder(rows)  # self-attention keys/values and the projected memory
        else:
            self.memory = self.memory.index_select(0, rows)
        self.padding = self.padding.index_select(0, rows)


def _restrict(log_probs: Tensor, at_limit: Tensor, decoding: Decoding, step: int) -> Tensor:
    """Tokens never to generate (PAD, BOS: never training targets) get -inf; the first step may only generate
    ``first_id`` where one is set, and rows at their length limit may only end (transformers' order: its bad words,
    then its forced BOS, then its forced EOS)."""
    restricted = log_probs
    if decoding.banned_ids:
        restricted = restricted.index_fill(1, torch.tensor(decoding.banned_ids, device=log_probs.device), float("-inf"))
    if step == 0 and decoding.first_id is not None:
        restricted = _force(restricted, log_probs, torch.ones_like(at_limit), decoding.first_id, decoding.scoring)
    return _force(restricted, log_probs, at_limit, decoding.eos_id, decoding.scoring)


def _force(restricted: Tensor, log_probs: Tensor, rows: Tensor, token: int, scoring: str) -> Tensor:
    """``restricted`` (R, V) with each of ``rows`` (R,) bool allowed ``token`` alone, scored 0 (transformers) or its
    log-probability in ``log_probs`` (gnmt)."""
    only = torch.full_like(restricted, float("-inf"))
    only[:, token] = 0.0 if scoring == "transformers" else log_probs[:, token]
    return torch.where(rows[:, None], only, restricted)


@torch.no_grad()
def greedy_decode(model: Seq2SeqModel, src: Tensor, decoding: Decoding) -> list[Hypothesis]:
    """The most likely next token at each step, for a batch of (B, S) right-padded sources."""
    memory, padding = model.encode(src)  # (B, S, D), (B, S)
    batch = src.size(0)
    limits = max_lengths(padding, decoding.max_len_a, decoding.max_len_b, model.max_positions)  # (B,)
    steps = int(limits.max())
    decoder = _StepDecoder(model, memory, padding, steps, decoding.use_cache)
    tokens = torch.full((batch, 1), decoding.bos_id, dtype=torch.long, device=src.device)  # (B, 1 + t)
    scores = torch.zeros(batch, device=src.device)
    lengths = torch.zeros(batch, dtype=torch.long, device=src.device)
    finished = torch.zeros(batch, dtype=torch.bool, device=src.device)
    for step in range(steps):
        log_probs = _restrict(decoder.log_probs(tokens), step + 1 >= limits, decoding, step)  # (B, V)
        best, next_token = log_probs.max(dim=-1)  # (B,)
        next_token = next_token.masked_fill(finished, decoding.eos_id)  # finished rows just repeat EOS
        scores += best.masked_fill(finished, 0.0)
        lengths += (~finished).long()
        finished |= next_token == decoding.eos_id
        tokens = torch.cat((tokens, next_token[:, None]), dim=1)
        if bool(finished.all()):
            break
    return [
        Hypothesis(row[1 : 1 + n - 1], s, s)  # drop BOS and the final EOS
        for row, n, s in zip(tokens.tolist(), lengths.tolist(), scores.tolist())
    ]


@torch.no_grad()
def beam_search(
    model: Seq2SeqModel, src: Tensor, decoding: Decoding, *, beam_size: int = 4, alpha: float = 0.6
) -> list[Hypothesis]:
    """The best hypothesis per sentence by length-normalised score, keeping ``beam_size`` beams.

    The B sentences' beams are decoded together as B * K rows. Each step scores all K * V
    extensions of a sentence's beams and takes the 2K best (at most K of them end in EOS, one per
    beam): EOS candidates among the top K become finished hypotheses, the K best others
    continue. The KV cache follows each surviving beam through ``KVCache.reorder``.

    A sentence stops when no live beam can still beat its best finished hypothesis: scores only
    fall as tokens are added (score_now <= 0), so score_now / lp(L) over the lengths L a beam can
    still end at bounds its future normalised score. The largest lp gives the bound: the longest
    length for alpha >= 0, the next one for alpha < 0 (lp then falls with length), as transformers'
    ``BeamHypotheses.is_done`` does; with alpha = 0 the bound is exact. fairseq instead stops at
    ``beam_size`` finished hypotheses, which is faster but can miss a better, longer translation.

    Every sentence gets a hypothesis, in order: one whose scores turned non-finite before any
    hypothesis ended (a diverged model) gets the empty translation with score -inf, so that the
    outputs still pair with their references.
    """
    if beam_size < 1:
        raise ValueError(f"beam_size must be >= 1, got {beam_size}")
    memory, padding = model.encode(src)  # (B, S, D), (B, S)
    batch, k, device = src.size(0), beam_size, src.device
    limits = max_lengths(padding, decoding.max_len_a, decoding.max_len_b, model.max_positions)  # (B,)
    steps = int(limits.max())
    # Every sentence's K beams are adjacent rows: sentence b owns rows b*K .. b*K + K-1.
    decoder = _StepDecoder(
        model, memory.repeat_interleave(k, dim=0), padding.repeat_interleave(k, dim=0), steps, decoding.use_cache
    )
    row_limits = limits.repeat_interleave(k)  # (B*K,)
    tokens = torch.full((batch * k, 1), decoding.bos_id, dtype=torch.long, device=device)  # (B*K, 1 + t)
    beam_scores = torch.zeros(batch, k, device=device)
    beam_scores[:, 1:] = float("-inf")  # all beams start equal: extend only the first at step 0
    best: list[Hypothesis | None] = [None] * batch
    best_scores = torch.full((batch,), float("-inf"), device=device)  # (B,) best finished, normalised
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    first_rows = torch.arange(batch, device=device)[:, None] * k  # (B, 1)
    for step in range(steps):
        log_probs = _restrict(decoder.log_probs(tokens), step + 1 >= row_limits, decoding, step)  # (B*K, V)
        vocab = log_probs.size(-1)
        candidates = (beam_scores.view(-1, 1) + log_probs).view(batch, k * vocab)  # (B, K*V)
        top_scores, top_index = candidates.topk(min(2 * k, k * vocab), dim=1)  # (B, 2K)
        origin, token = top_index // vocab, top_index % vocab  # beam each extends, and its token
        is_eos = (token == decoding.eos_id) & torch.isfinite(top_scores) & ~done[:, None]
        normalized = top_scores / float(length_penalty(step + 1, alpha, decoding.scoring))
        rank = torch.arange(top_scores.size(1), device=device).expand_as(top_scores)
        _keep_best(best, best_scores, is_eos & (rank < k), normalized, top_scores, first_rows + origin, tokens)
        # The K best candidates that do not end: rank order, EOS candidates pushed to the back.
        keep = (rank + top_scores.size(1) * is_eos.long()).topk(k, dim=1, largest=False).indices  # (B, K)
        beam_scores = top_scores.gather(1, keep)
        beam_scores = beam_scores.masked_fill(token.gather(1, keep) == decoding.eos_id, float("-inf"))
        # (B,) the length whose lp is largest among those a live beam can still end at (the next step's or later).
        bound_length = limits if alpha >= 0 else limits.clamp(max=step + 2)
        bound = beam_scores.max(dim=1).values / length_penalty(bound_length.float(), alpha, decoding.scoring)  # (B,) best reachable
        done |= (best_scores >= bound) | (step + 1 >= limits)
        if bool(done.all()):
            break
        beam_scores = beam_scores.masked_fill(done[:, None], float("-inf"))
        rows = (first_rows + origin.gather(1, keep)).view(-1)  # (B*K,) the row each new beam extends
        tokens = torch.cat((tokens.index_select(0, rows), token.gather(1, keep).view(-1, 1)), dim=1)
        decoder.reorder(rows)
    return [Hypothesis([], float("-inf"), float("-inf")) if found is None else found for found in best]


def _keep_best(
    best: list[Hypothesis | None],
    best_scores: Tensor,
    ends: Tensor,
    normalized: Tensor,
    scores: Tensor,
    rows: Tensor,
    tokens: Tensor,
) -> None:
    """Keep each sentence's best finished hypothesis (EOS among its K best candidates this step)."""
    candidate = normalized.masked_fill(~ends, float("-inf"))  # (B, 2K)
    value, j = candidate.max(dim=1)  # (B,)
    improved = value > best_scores
    if not bool(improved.any()):
        return
    best_scores.copy_(torch.where(improved, value, best_scores))
    for b in improved.nonzero().flatten().tolist():
        col = int(j[b])
        prefix = tokens[int(rows[b, col]), 1:].tolist()  # the extended beam's tokens, without BOS
        best[b] = Hypothesis(prefix, float(scores[b, col]), float(normalized[b, col]))
