"""Decoder-only language model (GPT): token embedding -> causal stack -> vocabulary logits."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from trident.backbone import VOCABULARY_PLAN, Decoder, KVCache, ParallelPlan, TokenEmbedding, TransformerConfig


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
    ) -> Tensor:
        """``ids``: (B, T) token ids -> logits (B, T, V). With ``cache``, ``ids`` are the new tokens only.
        ``documents``: (B, T) document ids of packed rows (see :class:`trident.backbone.stack.StackInputs`).
        ``key_padding_mask``: (B, T_total) True at padding, e.g. the left padding of a batch of prompts (transformers'
        ``attention_mask == 0``), the cached positions included; no position attends to a padded one.
        ``positions``: (B, T) each token's position counted from its row's first real token (transformers'
        ``position_ids``, which its ``generate`` derives from the padding); None: its index in the sequence."""
        hidden = self.decoder(self.embed(ids), cache=cache, documents=documents, key_padding_mask=key_padding_mask,
                              positions=positions)
        return self._logits(hidden)

    def forward_with_attention(self, ids: Tensor) -> tuple[Tensor, list[Tensor]]:
        """Logits and every layer's attention weights (B, nh, T, T), for visualisation."""
        hidden, weights = self.decoder.forward_with_attention(self.embed(ids))
        return self._logits(hidden), weights

    def _logits(self, hidden: Tensor) -> Tensor:
        """(B, T, D) -> (B, T, V); with ``model.final_logit_softcap`` (Gemma 2) capped at +-cap, smoothly."""
        logits = self.head(hidden)
        cap = self.cfg.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def new_cache(self, max_len: int) -> KVCache:
        return self.decoder.new_cache(max_len)

    @property
    def context_length(self) -> int | None:
        """Longest context generation feeds the model (``data.max_seq_len``); None: no limit (a
        sliding window over relative positions, see :attr:`trident.backbone.TransformerStack.context_length`)."""
        return self.decoder.context_length
