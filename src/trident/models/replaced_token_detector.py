"""ELECTRA's discriminator (Clark et al. 2020): token embedding -> bidirectional stack -> one logit per token, whether
that token was replaced (by the generator of task=electra) or is the original."""

from __future__ import annotations

from torch import Tensor, nn

from trident.backbone import GATED_ACTIVATIONS, Encoder, TokenEmbedding, TransformerConfig
from trident.errors import ConfigError
from trident.models.masked_lm import HeadActivation


class ReplacedTokenDetector(nn.Module):
    """The encoder of a masked LM with ELECTRA's discriminator head (``detector``: dense -> the blocks' activation ->
    one logit, transformers' ``discriminator_predictions``) in place of the MLM head. Named ``detector``, not
    ``head``: a classifier started from it (task=classify init_from) builds its own head rather than taking the
    detector's dense layer for its pooler."""

    def __init__(self, cfg: TransformerConfig, vocab_size: int, *, scale_embeddings: bool = False) -> None:
        super().__init__()
        if cfg.activation in GATED_ACTIVATIONS:
            raise ConfigError(f"model.activation={cfg.activation} is gated, which the discriminator head of ELECTRA "
                              "(dense -> the blocks' activation -> one logit) cannot use: set model.activation=gelu")
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.embed = TokenEmbedding(vocab_size, cfg.embedding_width, scale=scale_embeddings)
        self.encoder = Encoder(cfg)
        self.detector = nn.Sequential(nn.Linear(cfg.d_model, cfg.d_model), HeadActivation(cfg.activation),
                                      nn.Linear(cfg.d_model, 1))
        for layer in (self.detector[0], self.detector[2]):
            nn.init.normal_(layer.weight, std=0.02)
            nn.init.zeros_(layer.bias)

    def forward(self, ids: Tensor, *, key_padding_mask: Tensor | None = None) -> Tensor:
        """``ids``: (B, T); ``key_padding_mask``: (B, T) True at padding. Returns (B, T): per token, the logit that
        it was replaced."""
        hidden = self.encoder(self.embed(ids), key_padding_mask=key_padding_mask)  # (B, T, D)
        return self.detector(hidden).squeeze(-1)  # (B, T)
