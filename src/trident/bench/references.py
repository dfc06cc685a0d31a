"""The models a researcher would otherwise pick, built to trident's exact shapes: a causal LM
from ``torch.nn.TransformerEncoder`` and a translation model from ``torch.nn.Transformer``.
(timm's ``VisionTransformer`` is used as it is.)"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from trident.backbone import TransformerConfig


class TorchEncoderLM(nn.Module):
    """GPT-style LM on ``nn.TransformerEncoder`` with a causal mask: learned positions, embedding
    dropout, pre-norm GELU layers, final LayerNorm, output head tied to the token embedding."""

    def __init__(self, cfg: TransformerConfig, vocab_size: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, cfg.d_model)
        self.positions = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)
        layer = nn.TransformerEncoderLayer(
            cfg.d_model, cfg.n_heads, cfg.d_ff, cfg.dropout, activation=cfg.activation, batch_first=True,
            norm_first=cfg.norm_first, layer_norm_eps=cfg.norm_eps,
        )
        self.encoder = nn.TransformerEncoder(
            layer, cfg.n_layers, norm=nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps), enable_nested_tensor=False
        )
        self.head = nn.Linear(cfg.d_model, vocab_size, bias=False)
        self.head.weight = self.embed.weight
        causal = nn.Transformer.generate_square_subsequent_mask(cfg.max_seq_len)
        self.register_buffer("causal", causal, persistent=False)

    def forward(self, ids: Tensor) -> Tensor:
        length = ids.size(1)
        x = self.dropout(self.embed(ids) + self.positions(torch.arange(length, device=ids.device)))
        hidden = self.encoder(x, mask=self.causal[:length, :length], is_causal=True)
        return self.head(hidden)


class TorchTranslation(nn.Module):
    """Encoder-decoder on ``nn.Transformer``: shared scaled embeddings (also the output head),
    sinusoidal positions, source padding masks and a causal target mask, like trident's model."""

    def __init__(self, cfg: TransformerConfig, vocab_size: int, pad_id: int = 0) -> None:
        super().__init__()
        self.pad_id = pad_id
        self.scale = math.sqrt(cfg.d_model)
        self.embed = nn.Embedding(vocab_size, cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)
        self.transformer = nn.Transformer(
            cfg.d_model, cfg.n_heads, cfg.n_layers, cfg.n_layers, cfg.d_ff, cfg.dropout, activation=cfg.activation,
            batch_first=True, norm_first=cfg.norm_first, layer_norm_eps=cfg.norm_eps,
        )
        self.head = nn.Linear(cfg.d_model, vocab_size, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("table", sinusoids(cfg.max_seq_len, cfg.d_model), persistent=False)
        causal = nn.Transformer.generate_square_subsequent_mask(cfg.max_seq_len)
        self.register_buffer("causal", causal, persistent=False)

    def _embed(self, ids: Tensor) -> Tensor:
        return self.dropout(self.embed(ids) * self.scale + self.table[: ids.size(1)])

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        padding = src.eq(self.pad_id)
        length = tgt_in.size(1)
        hidden = self.transformer(
            self._embed(src), self._embed(tgt_in), tgt_mask=self.causal[:length, :length], tgt_is_causal=True,
            src_key_padding_mask=padding, memory_key_padding_mask=padding,
        )
        return self.head(hidden)


def sinusoids(length: int, d_model: int) -> Tensor:
    """The paper's fixed sinusoidal table (length, d_model)."""
    positions = torch.arange(length, dtype=torch.float32)[:, None]
    inv_freq = torch.exp(-math.log(10000.0) * torch.arange(0, d_model, 2, dtype=torch.float32) / d_model)
    table = torch.zeros(length, d_model)
    table[:, 0::2] = torch.sin(positions * inv_freq)
    table[:, 1::2] = torch.cos(positions * inv_freq)
    return table
