"""Encoder-only masked language model (BERT): token embedding -> bidirectional stack -> MLM head."""

from __future__ import annotations

from torch import Tensor, nn

from trident.backbone import (
    ACTIVATIONS,
    GATED_ACTIVATIONS,
    VOCABULARY_PLAN,
    Encoder,
    ParallelPlan,
    TokenEmbedding,
    TransformerConfig,
    VocabularyHead,
    make_norm,
    scored,
)
from trident.errors import ConfigError


class MaskedLM(nn.Module):
    """BERT's prediction head on the shared encoder: a dense + GELU + norm transform, then a
    vocabulary projection whose weight is the input embedding (Devlin et al. 2019; the tied
    output layer of Press & Wolf 2017) plus a bias of its own."""

    def __init__(self, cfg: TransformerConfig, vocab_size: int, *, scale_embeddings: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        self.vocab_size = vocab_size
        width = cfg.embedding_width  # E: model.embedding_dim (ALBERT's factorised embedding), else D
        self.embed = TokenEmbedding(vocab_size, width, scale=scale_embeddings)
        self.encoder = Encoder(cfg)
        self.transform = nn.Sequential(
            nn.Linear(cfg.d_model, width, bias=cfg.bias),  # ALBERT's head projects D back to E here
            _head_activation(cfg),
            make_norm(cfg.norm, width, bias=cfg.bias, eps=cfg.norm_eps),
        )
        nn.init.normal_(self.transform[0].weight, std=0.02)
        self.head = nn.Linear(width, vocab_size)
        self.head.weight = self.embed.weight
        nn.init.zeros_(self.head.bias)

    def parallel_plan(self) -> ParallelPlan:
        """The embedding and its tied head split by vocabulary (the transform stays whole)."""
        return VOCABULARY_PLAN

    def forward(self, ids: Tensor, *, key_padding_mask: Tensor | None = None, select: Tensor | None = None,
                chunk: int = 0) -> Tensor | VocabularyHead:
        """``ids``: (B, T); ``key_padding_mask``: (B, T) True at padding. Returns logits (B, T, V), or
        with ``select`` ((B, T) bool) the logits of the selected positions only, (N, V): the head,
        the largest matmul of a small model, then runs on the ~15% of positions that are predicted. With ``chunk`` > 0
        (``task.loss_chunk``): the vocabulary projection and the transformed states it scores, for a chunked loss."""
        hidden = self.encoder(self.embed(ids), key_padding_mask=key_padding_mask)  # (B, T, D)
        if select is not None:
            hidden = hidden[select]  # (N, D)
        return scored(VocabularyHead(self.transform(hidden), self.head, chunk=chunk))


class HeadActivation(nn.Module):
    """One of the blocks' activations (model.activation) as a module of the head's transform."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.act = ACTIVATIONS[name]

    def extra_repr(self) -> str:
        return self.name

    def forward(self, x: Tensor) -> Tensor:
        return self.act(x)


def _head_activation(cfg: TransformerConfig) -> nn.Module:
    """BERT's transform is GELU whatever its blocks use; ALBERT's (a factorised embedding, model.embedding_dim) uses
    its blocks' activation (transformers' AlbertMLMHead takes hidden_act), which must then not be gated."""
    if cfg.embedding_dim is None:
        return nn.GELU()
    if cfg.activation in GATED_ACTIVATIONS:
        raise ConfigError(f"model.activation={cfg.activation} is gated, which the MLM head of a factorised embedding "
                          "(model.embedding_dim, ALBERT's: the blocks' activation) cannot use: set model.activation=gelu "
                          "or gelu_tanh, or model.embedding_dim=null")
    return HeadActivation(cfg.activation)
