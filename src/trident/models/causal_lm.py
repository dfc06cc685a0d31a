"""Decoder-only language model (GPT): token embedding -> causal stack -> vocabulary logits."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from trident.backbone import (
    VOCABULARY_PLAN,
    Decoder,
    KVCache,
    ParallelPlan,
    RecurrentCache,
    SegmentMemory,
    TokenEmbedding,
    TransformerConfig,
    VocabularyHead,
    scored,
)
from trident.errors import ConfigError


class CausalLM(nn.Module):
    def __init__(
        self, cfg: TransformerConfig, vocab_size: int, *, tie_embeddings: bool = True, scale_embeddings: bool = False
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.embed = TokenEmbedding(vocab_size, cfg.d_model, scale=scale_embeddings)
        self.decoder = Decoder(cfg)
        self.head = nn.Linear(cfg.d_model, vocab_size, bias=False)
        if tie_embeddings:
            # Input and output embeddings share one matrix (Press & Wolf 2017; the paper, section 3.4).
            self.head.weight = self.embed.weight
        else:
            nn.init.normal_(self.head.weight, std=0.02)

    def parallel_plan(self) -> ParallelPlan:
        """The embedding and the head (tied or not) split by vocabulary; the blocks declare their own."""
        return VOCABULARY_PLAN

    def forward(
        self,
        ids: Tensor,
        *,
        cache: KVCache | None = None,
        documents: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        positions: Tensor | None = None,
        memory: SegmentMemory | None = None,
        chunk: int = 0,
    ) -> Tensor | VocabularyHead:
        """``ids``: (B, T) token ids -> logits (B, T, V); with ``chunk`` > 0 (``task.loss_chunk``) the head and the
        hidden states (B, T, D) it scores, which a chunked loss scores ``chunk`` rows at a time. With ``cache``, ``ids`` are the new tokens only.
        ``documents``: (B, T) document ids of packed rows (see :class:`trident.backbone.stack.StackInputs`).
        ``key_padding_mask``: (B, T_total) True at padding, e.g. the left padding of a batch of prompts (transformers'
        ``attention_mask == 0``), the cached positions included; no position attends to a padded one.
        ``positions``: (B, T) each token's position counted from its row's first real token (transformers'
        ``position_ids``, which its ``generate`` derives from the padding); None: its index in the sequence.
        With ``model.memory_length`` (Transformer-XL) the text is read in segments of ``max_seq_len`` tokens, each on
        top of ``memory`` (:meth:`new_memory`; None: a new one, empty) which it then joins: training passes the memory
        that the previous batch's rows filled, generation the one its cache (:meth:`new_cache`) holds."""
        if self.cfg.memory_length:
            # The stack refuses padding, packed documents and per-row positions with a memory.
            hidden = self._forward_segments(ids, cache, memory, (key_padding_mask, documents, positions))
            return scored(self.vocabulary_head(hidden, chunk))
        if memory is not None:
            raise ValueError("memory is for a model with model.memory_length > 0")
        hidden = self.decoder(self.embed(ids), cache=cache, documents=documents, key_padding_mask=key_padding_mask,
                              positions=positions)
        return scored(self.vocabulary_head(hidden, chunk))

    def _forward_segments(self, ids: Tensor, cache: KVCache | None, memory: SegmentMemory | None,
                          refused: tuple[Tensor | None, Tensor | None, Tensor | None]) -> Tensor:
        """(B, T) ids -> (B, T, D) hidden states, in pieces that end where a segment ends (there the memory rolls, and a
        cache starts the next segment's keys from it). ``refused``: the padding mask, documents and positions given to
        :meth:`forward`, which the stack refuses with a memory."""
        if cache is not None:
            if not isinstance(cache, RecurrentCache):
                raise TypeError("a model with model.memory_length decodes with its own cache: use model.new_cache()")
            memory = cache.memory
        memory = memory if memory is not None else self.new_memory()
        hidden, start = [], 0
        while start < ids.size(1):
            piece = ids[:, start : start + memory.segment - memory.filled]  # (B, <= S)
            padding, documents, positions = refused  # all None: the stack refuses each with a memory
            hidden.append(self.decoder(self.embed(piece), cache=cache, recurrence=memory, key_padding_mask=padding,
                                       documents=documents, positions=positions))
            if memory.advance(piece.size(1)) and cache is not None:
                cache.restart()
            start += piece.size(1)
        # The head scores each position alone: the pieces' hidden states joined, then scored, are their logits joined.
        return hidden[0] if len(hidden) == 1 else torch.cat(hidden, dim=1)

    def new_memory(self) -> SegmentMemory:
        """An empty memory of ``model.memory_length`` states per layer for segments of ``max_seq_len`` tokens."""
        return SegmentMemory(self.cfg.n_layers, self.cfg.memory_length, self.cfg.max_seq_len)

    def forward_with_attention(self, ids: Tensor) -> tuple[Tensor, list[Tensor]]:
        """Logits and every layer's attention weights (B, nh, T, T), for visualisation (with a memory: one segment,
        the first, which reads none)."""
        if self.cfg.memory_length and ids.size(1) > self.cfg.max_seq_len:
            raise ConfigError(f"a model with model.memory_length reads {ids.size(1)} tokens in segments of "
                              f"{self.cfg.max_seq_len}, each with its own weights to show: show one segment at a time")
        hidden, weights = self.decoder.forward_with_attention(self.embed(ids))
        return self.vocabulary_head(hidden).logits(), weights

    def vocabulary_head(self, hidden: Tensor, chunk: int = 0) -> VocabularyHead:
        """The head on (B, T, D) ``hidden``: logits (B, T, V), with ``model.final_logit_softcap`` (Gemma 2) capped at
        +-cap, smoothly."""
        return VocabularyHead(hidden, self.head, softcap=self.cfg.final_logit_softcap, chunk=chunk)

    def new_cache(self, max_len: int) -> KVCache:
        """A KV cache for up to ``max_len`` positions; with ``model.memory_length`` a :class:`RecurrentCache`, which
        holds a segment's keys and its memory (M + S positions) however long the text."""
        if self.cfg.memory_length:
            return RecurrentCache(self.cfg.n_layers, self.new_memory())
        return self.decoder.new_cache(max_len)

    @property
    def context_length(self) -> int | None:
        """Longest context generation feeds the model (``data.max_seq_len``); None: no limit (a
        sliding window over relative positions, see :attr:`trident.backbone.TransformerStack.context_length`; a memory
        (model.memory_length), which reads any length segment by segment)."""
        return None if self.cfg.memory_length else self.decoder.context_length
