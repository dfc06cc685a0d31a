"""Sequence classifier on the shared stack: token embedding -> encoder (BERT) or decoder (GPT) ->
one pooled vector per sequence -> class logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trident.backbone import Decoder, Encoder, TokenEmbedding, TransformerConfig
from trident.errors import ConfigError

# stack -> the pools it serves: a decoder's first position sees only itself, so it cannot be a [CLS].
POOLS = {"encoder": ("cls", "mean"), "decoder": ("last", "mean")}
# task.pooler's activations (true: tanh, BERT's); a head's module tells which it has (the hf export checks it).
POOLER_ACTIVATIONS: dict[str, type[nn.Module]] = {"tanh": nn.Tanh, "gelu": nn.GELU}


def pooler_activation(pooler: bool | str) -> str | None:
    """The activation of ``task.pooler``: None for false (no pooler), tanh for true, else its name; another value is
    one line."""
    if pooler is False or pooler is True:
        return "tanh" if pooler else None
    if pooler not in POOLER_ACTIVATIONS:
        raise ConfigError(f"task.pooler must be false, true (tanh), {' or '.join(POOLER_ACTIVATIONS)}, got {pooler!r}: "
                          "set task.pooler=true for BERT's pooler, task.pooler=gelu for ELECTRA's classification head")
    return str(pooler)


class SequenceClassifier(nn.Module):
    """``pool``: ``cls`` the output at position 0: the text's own class token where its tokenizer
    starts every text with one (``class_token_in_text``: BERT's ``[CLS]``, RoBERTa's ``<s>``; the
    tokens then sit at the positions of pre-training), else at a learned ``[CLS]`` vector prepended
    to the embeddings (a parameter, not a vocabulary entry, so a pre-trained embedding fits);
    ``mean`` the mean over non-padding positions, ``last`` the last non-padding position (GPT). The
    stack is named ``encoder`` or ``decoder`` as in the MLM and LM models, so their weights load by name."""

    def __init__(self, cfg: TransformerConfig, vocab_size: int, num_classes: int, *, stack: str = "encoder",
                 pool: str = "cls", scale_embeddings: bool = False, class_token_in_text: bool = False,
                 pooler: bool | str = False) -> None:
        super().__init__()
        if pool not in POOLS.get(stack, ()):
            raise ValueError(f"pool={pool!r} does not fit stack={stack!r}")
        self.cfg, self.stack_kind, self.pool = cfg, stack, pool
        width = cfg.embedding_width  # E: model.embedding_dim (ALBERT's factorised embedding), else D
        self.embed = TokenEmbedding(vocab_size, width, scale=scale_embeddings)
        if stack == "encoder":
            self.encoder = Encoder(cfg)
        else:
            self.decoder = Decoder(cfg)
        self.prepends_cls = pool == "cls" and not class_token_in_text
        if self.prepends_cls:
            self.cls_token = nn.Parameter(torch.zeros(1, 1, width))
            nn.init.normal_(self.cls_token, std=0.02)
        # ``pooler``: a dense layer and tanh (true) or GELU ("gelu") before the class projection (BERT's and ALBERT's
        # pooler, RoBERTa's classification head: tanh; ELECTRA's: GELU), part of the head: it trains with it, under a
        # frozen backbone or LoRA.
        out = nn.Linear(cfg.d_model, num_classes)
        activation = pooler_activation(pooler)
        self.head: nn.Module = (nn.Sequential(nn.Linear(cfg.d_model, cfg.d_model), POOLER_ACTIVATIONS[activation](), out)
                                if activation is not None else out)
        for layer in self.head.modules():
            if isinstance(layer, nn.Linear):
                nn.init.normal_(layer.weight, std=0.02)
                nn.init.zeros_(layer.bias)

    @property
    def stack(self) -> Encoder | Decoder:
        return self.encoder if self.stack_kind == "encoder" else self.decoder

    def forward(self, ids: Tensor, *, key_padding_mask: Tensor | None = None) -> Tensor:
        """``ids``: (B, T) right-padded; ``key_padding_mask``: (B, T) True at padding. Returns (B, C)."""
        x = self.embed(ids)  # (B, T, D)
        if self.prepends_cls:
            x = torch.cat([self.cls_token.expand(x.size(0), -1, -1), x], dim=1)  # (B, 1 + T, D)
            if key_padding_mask is not None:
                key_padding_mask = F.pad(key_padding_mask, (1, 0), value=False)  # (B, 1 + T)
        hidden = self.stack(x, key_padding_mask=key_padding_mask)  # (B, T', D)
        keep = torch.ones(hidden.shape[:2], dtype=torch.bool, device=ids.device) if key_padding_mask is None else ~key_padding_mask
        if self.pool == "cls":
            pooled = hidden[:, 0]  # (B, D)
        elif self.pool == "mean":
            weights = keep.unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
            pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1)  # (B, D)
        else:
            last = keep.sum(dim=1) - 1  # (B,): right padding, so the last real token is at length - 1
            pooled = hidden[torch.arange(ids.size(0), device=ids.device), last]  # (B, D)
        return self.head(pooled)

    def layer_of(self, name: str) -> int:
        """Depth of parameter ``name`` for layer-wise learning-rate decay (ELECTRA, BEiT): 0 for the
        embedding, ``[CLS]`` and position tables, i + 1 for block i, n_layers + 1 for the final norm and head."""
        parts = name.split(".")
        if parts[0] in ("embed", "cls_token") or "pos_encoding" in parts:
            return 0
        if len(parts) > 2 and parts[1] == "blocks":
            return int(parts[2]) + 1
        return self.cfg.n_layers + 1

    def named_backbone_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Everything but the head: what freezing the backbone freezes."""
        return [(name, p) for name, p in self.named_parameters() if not name.startswith("head.")]
