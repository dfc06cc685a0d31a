"""Vision Transformer (Dosovitskiy et al. 2021): patches -> shared encoder stack -> class logits; with
``model.distillation_token`` DeiT's (Touvron et al. 2021), which reads a second token into a second head."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from trident.backbone import Encoder, TransformerConfig
from trident.errors import ConfigError

POOLS = ("cls", "mean")


def vit_geometry(image_size: int, patch_size: int, pool: str, distillation_token: bool = False) -> dict[str, Any]:
    """Backbone fields that follow from the image: the patch grid, the prefix (the class token, and DeiT's
    distillation token after it) and the sequence length. Fails clearly when the patch size does not tile the image."""
    if pool not in POOLS:
        raise ConfigError(f"task.pool={pool!r} is not supported: choose cls or mean")
    if distillation_token and pool != "cls":
        raise ConfigError(f"model.distillation_token=true needs task.pool=cls (DeiT averages the heads of the class and "
                          f"distillation tokens), got task.pool={pool}: set task.pool=cls or model.distillation_token=false")
    if patch_size <= 0 or image_size % patch_size != 0:
        raise ConfigError(
            f"patch size {patch_size} does not divide image size {image_size}: choose data.patch_size among "
            f"{[p for p in range(1, image_size + 1) if image_size % p == 0]}, or a data.image_size that is a multiple "
            f"of {patch_size} (init_from fixes the patch size)"
        )
    side = image_size // patch_size
    prefix = (1 + int(distillation_token)) if pool == "cls" else 0
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
    without bias (CLIP's image tower); ``head_bias=False``: a head without bias (CLIP's projection).

    ``cfg.distillation_token`` (DeiT, timm's ``VisionTransformerDistilled``): a second learned token after the class
    token, with its own position, read by a second head ``head_dist``. The network returns the two heads' average,
    except in training with :attr:`distilled_training` set (a teacher teaches the second head), when it returns both
    logits ``(class, distillation)``, as timm's does."""

    def __init__(
        self, cfg: TransformerConfig, *, patch_size: int, in_channels: int, num_classes: int, pool: str = "cls",
        patch_bias: bool = True, head_bias: bool = True,
    ) -> None:
        super().__init__()
        distilled = bool(cfg.distillation_token)
        if cfg.grid is None or cfg.num_prefix_tokens != vit_geometry(1, 1, pool, distilled)["num_prefix_tokens"]:
            raise ConfigError(f"a VisionTransformer with pool={pool} needs the grid and prefix of "
                              f"vit_geometry(..., {pool!r}, distillation_token={distilled})")
        self.pool = pool
        self.num_prefix_tokens = cfg.num_prefix_tokens
        self.patch_embed = PatchEmbedding(patch_size, in_channels, cfg.d_model, bias=patch_bias)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.d_model)) if pool == "cls" else None
        self.dist_token = nn.Parameter(torch.zeros(1, 1, cfg.d_model)) if distilled else None
        self.encoder = Encoder(cfg)
        self.head = nn.Linear(cfg.d_model, num_classes, bias=head_bias)
        self.head_dist = nn.Linear(cfg.d_model, num_classes, bias=head_bias) if distilled else None
        # Set by a task that has a teacher for the distillation head: training then returns both heads' logits.
        self.distilled_training = False
        for token in (self.cls_token, self.dist_token):
            if token is not None:
                nn.init.normal_(token, std=0.02)
        for head in (self.head, self.head_dist):
            if head is not None:
                nn.init.normal_(head.weight, std=0.02)
                if head.bias is not None:
                    nn.init.zeros_(head.bias)

    def no_weight_decay(self) -> set[str]:
        """Parameters AdamW should not decay: the class and distillation tokens and a learned position table."""
        return {"cls_token", "dist_token", "encoder.pos_encoding.embedding.weight"}

    def _tokens(self, images: Tensor) -> Tensor:
        x = self.patch_embed(images)  # (B, N, D)
        prefix = [token.expand(x.size(0), -1, -1) for token in (self.cls_token, self.dist_token) if token is not None]
        return torch.cat((*prefix, x), dim=1) if prefix else x  # (B, prefix + N, D)

    def forward_features(self, images: Tensor) -> Tensor:
        """(B, C, H, W) -> encoder outputs (B, prefix + N, D)."""
        return self.encoder(self._tokens(images))

    def forward_head(self, features: Tensor, pre_logits: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """Logits (B, classes) of the encoder outputs (B, prefix + N, D), or the pooled features (B, D) with
        ``pre_logits``; with a distillation token in distilled training, the class and distillation logits."""
        if self.head_dist is not None:  # timm's VisionTransformerDistilled.forward_head
            pooled, pooled_dist = features[:, 0], features[:, 1]  # (B, D) each
            if pre_logits:
                return (pooled + pooled_dist) / 2
            logits, logits_dist = self.head(pooled), self.head_dist(pooled_dist)
            if self.distilled_training and self.training:
                return logits, logits_dist
            return (logits + logits_dist) / 2
        pooled = features[:, 0] if self.pool == "cls" else features[:, self.num_prefix_tokens :].mean(dim=1)  # (B, D)
        return pooled if pre_logits else self.head(pooled)

    def forward(self, images: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        return self.forward_head(self.forward_features(images))

    def forward_with_attention(self, images: Tensor) -> tuple[Tensor, list[Tensor]]:
        """Logits and each block's attention weights (B, nh, T, T), e.g. for attention rollout (run in eval mode: a
        distilled network's logits are then its heads' average)."""
        features, weights = self.encoder.forward_with_attention(self._tokens(images))
        logits = self.forward_head(features)
        assert isinstance(logits, Tensor), "forward_with_attention runs in eval mode"
        return logits, weights


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
