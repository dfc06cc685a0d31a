"""Encoder-only masked language model (BERT): token embedding -> bidirectional stack -> MLM head."""

from __future__ import annotations

from torch import Tensor, nn

from trident.backbone import VOCABULARY_PLAN, Encoder, ParallelPlan, TokenEmbedding, TransformerConfig, make_norm


class MaskedLM(nn.Module):
    """BERT's prediction head on the shared encoder: a dense + GELU + norm transform, then a
    vocabulary projection whose weight is the input embedding (Devlin et al. 2019; the tied
    output layer of Press & Wolf 2017) plus a bias of its own."""

    def __init__(self, cfg: TransformerConfig, vocab_size: int, *, scale_embeddings: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.embed = TokenEmbedding(vocab_size, cfg.d_model, scale=scale_embeddings)
        self.encoder = Encoder(cfg)
        self.transform = nn.Sequential(
            nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias),
            nn.GELU(),
            make_norm(cfg.norm, cfg.d_model, bias=cfg.bias, eps=cfg.norm_eps),
        )
        nn.init.normal_(self.transform[0].weight, std=0.02)
        self.head = nn.Linear(cfg.d_model, vocab_size)
        self.head.weight = self.embed.weight
        nn.init.zeros_(self.head.bias)

    def parallel_plan(self) -> ParallelPlan:
        """The embedding and its tied head split by vocabulary (the transform stays whole)."""
        return VOCABULARY_PLAN

    def forward(self, ids: Tensor, *, key_padding_mask: Tensor | None = None, select: Tensor | None = None) -> Tensor:
        """``ids``: (B, T); ``key_padding_mask``: (B, T) True at padding. Returns logits (B, T, V), or
        with ``select`` ((B, T) bool) the logits of the selected positions only, (N, V): the head,
        the largest matmul of a small model, then runs on the ~15% of positions that are predicted."""
        hidden = self.encoder(self.embed(ids), key_padding_mask=key_padding_mask)  # (B, T, D)
        if select is not None:
            hidden = hidden[select]  # (N, D)
        return self.head(self.transform(hidden))
