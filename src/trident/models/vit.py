"""Vision Transformer (Dosovitskiy et al. 2021): patches -> shared encoder stack -> class logits."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from trident.backbone import Encoder, TransformerConfig
from trident.errors import ConfigError

POOLS = ("cls", "mean")


def vit_geometry(image_size: int, patch_size: int, pool: str) -> dict[str, Any]:
    """Backbone fields that follow from the image: the patch grid, the class-token prefix and
    the sequence length. Fails clearly when the patch size does not tile the image."""
    if pool not in POOLS:
        raise ConfigError(f"task.pool={pool!r} is not supported: choose cls or mean")
    if patch_size <= 0 or image_size % patch_size != 0:
        raise ConfigError(
            f"patch size {patch_size} does not divide image size {image_size}: choose data.patch_size among "
            f"{[p for p in range(1, image_size + 1) if image_size % p == 0]}, or a data.image_size that is a multiple "
            f"of {patch_size} (init_from fixes the patch size)"
        )
    side = image_size // patch_size
    prefix = 1 if pool == "cls" else 0
    return {"grid": (side, side), "num_prefix_tokens": prefix, "max_seq_len": side * side + prefix}


class PatchEmbedding(nn.Module):
    """Cut the image into non-overlapping patches and project each to d_model (a strided conv)."""

    def __init__(self, patch_size: int, in_channels: int, d_model: int, bias: bool = True) -> None:
        super().__init__()
        self.proj = nn.Conv2d(in_channels, d_model, kernel_size=patch_size, stride=patch_size, bias=bias)

    def forward(self, images: Tensor) -> Tensor:
        return self.proj(images).flatten(2).transpose(1, 2)  # (B, C, H, W) -> (B, D, h, w) -> (B, h*w, D)


class VisionTransformer(nn.Module):
    """``cfg`` must carry the grid of :func:`vit_geometry`. ``pool="cls"`` classifies from a learned
    class token (ViT); ``"mean"`` from the average of the patch outputs. ``patch_bias=False``: a patch projection
    without bias (CLIP's image tower); ``head_bias=False``: a head without bias (CLIP's projection)."""

    def __init__(
        self, cfg: TransformerConfig, *, patch_size: int, in_channels: int, num_classes: int, pool: str = "cls",
        patch_bias: bool = True, head_bias: bool = True,
    ) -> None:
        super().__init__()
        if cfg.grid is None or cfg.num_prefix_tokens != (1 if pool == "cls" else 0):
            raise ConfigError(f"a VisionTransformer with pool={pool} needs the grid and prefix of vit_geometry(..., {pool!r})")
        self.pool = pool
        self.num_prefix_tokens = cfg.num_prefix_tokens
        self.patch_embed = PatchEmbedding(patch_size, in_channels, cfg.d_model, bias=patch_bias)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.d_model)) if pool == "cls" else None
        self.encoder = Encoder(cfg)
        self.head = nn.Linear(cfg.d_model, num_classes, bias=head_bias)
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=0.02)
        nn.init.normal_(self.head.weight, std=0.02)
        if self.head.bias is not None:
            nn.init.zeros_(self.head.bias)

    def no_weight_decay(self) -> set[str]:
        """Parameters AdamW should not decay: the class token and a learned position table."""
        return {"cls_token", "encoder.pos_encoding.embedding.weight"}

    def _tokens(self, images: Tensor) -> Tensor:
        x = self.patch_embed(images)  # (B, N, D)
        if self.cls_token is not None:
            x = torch.cat((self.cls_token.expand(x.size(0), -1, -1), x), dim=1)  # (B, 1+N, D)
        return x

    def forward_features(self, images: Tensor) -> Tensor:
        """(B, C, H, W) -> encoder outputs (B, prefix + N, D)."""
        return self.encoder(self._tokens(images))

    def forward_head(self, features: Tensor, pre_logits: bool = False) -> Tensor:
        pooled = features[:, 0] if self.pool == "cls" else features[:, self.num_prefix_tokens :].mean(dim=1)  # (B, D)
        return pooled if pre_logits else self.head(pooled)

    def forward(self, images: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(images))

    def forward_with_attention(self, images: Tensor) -> tuple[Tensor, list[Tensor]]:
        """Logits and each block's attention weights (B, nh, T, T), e.g. for attention rollout."""
        features, weights = self.encoder.forward_with_attention(self._tokens(images))
        return self.forward_head(features), weights


def attention_rollout(weights: list[Tensor]) -> Tensor:
    """Attention rollout (Abnar & Zuidema 2020): average heads, add the residual identity,
    renormalise, and multiply through the layers. Returns (B, T, T)."""
    rollout: Tensor | None = None
    for layer in weights:
        attn = layer.float().mean(dim=1)  # (B, T, T)
        attn = attn + torch.eye(attn.size(-1), device=attn.device)
        attn = attn / attn.sum(dim=-1, keepdim=True)
        rollout = attn if rollout is None else attn @ rollout
    if rollout is None:
        raise ValueError("attention_rollout needs at least one layer of weights")
    return rollout


def patch_grid(net: nn.Module) -> tuple[tuple[int, int], int] | None:
    """The patch grid and class-token prefix of ``net`` if it is a :class:`VisionTransformer` (a source's
    position table of another image size is resampled to them), else None."""
    if not isinstance(net, VisionTransformer) or net.encoder.cfg.grid is None:
        return None
    return net.encoder.cfg.grid, net.num_prefix_tokens
