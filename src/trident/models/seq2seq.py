"""Encoder-decoder Transformer (the paper's translation model) built on the shared backbone."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from trident.backbone import Decoder, Encoder, KVCache, TokenEmbedding, TransformerConfig, VocabularyHead, scored
from trident.errors import ConfigError

# all: encoder embedding = decoder embedding = output projection (the paper, section 3.4; needs
# a shared vocabulary); decoder: decoder embedding = output projection; embeddings: encoder embedding = decoder
# embedding, the output projection its own (T5 v1.1); none: three matrices.
TIE_MODES = ("all", "decoder", "embeddings", "none")


def tie_mode(value: str | bool) -> str:
    """``true`` means ``all`` and ``false`` means ``none``, as for the LM's boolean switch."""
    if isinstance(value, bool):
        return "all" if value else "none"
    if value not in TIE_MODES:
        raise ConfigError(f"task.tie_embeddings={value!r} is not supported: choose one of {', '.join(TIE_MODES)}")
    return value


class EncoderDecoder(nn.Module):
    """Source ids -> encoder -> memory; target prefix + memory -> decoder (with cross-attention)
    -> next-token logits. Both stacks share one :class:`TransformerConfig` (``n_layers`` each).

    ``scale_embeddings`` multiplies embeddings by sqrt(d_model) (the paper), which keeps them on
    the scale of the sinusoids when the same matrix is also the output projection.

    ``logits_bias``: a fixed (V,) vector added to the logits, a buffer that no optimizer moves (BART's
    ``final_logits_bias``). ``decoder_start_id``: the token the decoder's input starts with before the target's
    BOS (BART's ``decoder_start_token_id``, its EOS); None: the target's BOS itself (trident's own).
    ``rescale_head`` multiplies the decoder's output by d_model**-0.5 before the output projection (T5 v1.0, whose
    output projection is its unscaled embedding table).
    """

    def __init__(
        self,
        cfg: TransformerConfig,
        vocab_size: int,
        *,
        pad_id: int = 0,
        tie_embeddings: str | bool = "all",
        scale_embeddings: bool = True,
        logits_bias: bool = False,
        decoder_start_id: int | None = None,
        rescale_head: bool = False,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.decoder_start_id = decoder_start_id
        self.vocab_size = vocab_size
        self.pad_id = pad_id
        self.tie_embeddings = tie_mode(tie_embeddings)
        self.src_embed = TokenEmbedding(vocab_size, cfg.d_model, scale=scale_embeddings)
        # With "all" the two names refer to one module: parameters() lists its weight once.
        share = self.tie_embeddings in ("all", "embeddings")
        self.tgt_embed = self.src_embed if share else TokenEmbedding(vocab_size, cfg.d_model, scale=scale_embeddings)
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg, cross_attention=True)
        self.head = nn.Linear(cfg.d_model, vocab_size, bias=False)
        self.head_scale = cfg.d_model**-0.5 if rescale_head else 1.0
        if self.tie_embeddings in ("all", "decoder"):
            self.head.weight = self.tgt_embed.weight
        else:
            # The same scale as a scaled embedding table, so untied logits start at unit variance too.
            nn.init.normal_(self.head.weight, std=cfg.d_model**-0.5 if scale_embeddings else 0.02)
        if logits_bias:
            self.register_buffer("logits_bias", torch.zeros(vocab_size))  # (V,)
        else:
            self.logits_bias: Tensor | None = None

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor]:
        """``src``: (B, S) ids, right-padded with ``pad_id``. Returns memory (B, S, D) and the
        source padding mask (B, S), True at padding."""
        padding = src.eq(self.pad_id)  # (B, S)
        return self.encoder(self.src_embed(src), key_padding_mask=padding), padding

    def decode(self, tgt_in: Tensor, memory: Tensor, memory_padding_mask: Tensor, *, cache: KVCache | None = None,
               chunk: int = 0) -> Tensor | VocabularyHead:
        """``tgt_in``: (B, T) target prefix (with ``cache``: only the new tokens) -> logits (B, T, V); with ``chunk``
        > 0 (``task.loss_chunk``) the head and the hidden states it scores, for a loss computed chunk by chunk.

        No target padding mask is needed: targets are right-padded, so under the causal mask
        no real position ever attends to padding (and SDPA keeps its fused causal path).
        With ``cache``, the cross-attention keys/values of ``memory`` are projected on the first
        call and reused afterwards.
        """
        hidden = self.decoder(
            self.tgt_embed(tgt_in), memory=memory, memory_padding_mask=memory_padding_mask, cache=cache
        )  # (B, T, D)
        head = VocabularyHead(hidden if self.head_scale == 1.0 else hidden * self.head_scale, self.head,
                              bias=self.logits_bias, chunk=chunk)
        return scored(head)

    def forward(self, src: Tensor, tgt_in: Tensor, chunk: int = 0) -> Tensor | VocabularyHead:
        """Teacher forcing: (B, S) source, (B, T) decoder input -> logits (B, T, V) (``chunk``: :meth:`decode`)."""
        memory, padding = self.encode(src)
        return self.decode(tgt_in, memory, padding, chunk=chunk)

    def new_cache(self, max_len: int) -> KVCache:
        return self.decoder.new_cache(max_len)

    @property
    def max_positions(self) -> int:
        """Longest sequence either stack was configured for (``model.max_seq_len``)."""
        return self.cfg.max_seq_len
