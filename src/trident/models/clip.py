"""CLIP (Radford et al. 2021): a text tower and an image tower on the backbone, each ending in a projection into one
embedding space, and a learned temperature. Laid out as transformers' ``CLIPModel`` computes it, so that its weights
read in exactly: the text tower is a causal stack over learned positions pooled at the end-of-text token, the image
tower a ViT (class token, the vision tower's pre-norm: ``embedding_norm``), each projection without bias."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trident.backbone import Decoder, TokenEmbedding, TransformerConfig
from trident.models.vit import VisionTransformer

#: CLIP's initial temperature: logits scaled by 1 / 0.07, ``logit_scale`` its log.
INITIAL_LOGIT_SCALE = math.log(1 / 0.07)
#: CLIP clamps ``logit_scale`` at log(100) (a temperature of 0.01) "to prevent scaling the logits by more than 100".
MAX_LOGIT_SCALE = math.log(100)


def end_of_text(ids: Tensor, eos_id: int | None) -> Tensor:
    """(B, T) token ids -> (B,) the position each row is pooled at: its first ``eos_id`` (transformers'
    ``CLIPTextTransformer``; 0 in a row without one), or with ``eos_id`` None the position of the row's largest id
    (OpenAI's and open_clip's rule: their end-of-text token is the last id of the vocabulary)."""
    if eos_id is None:
        return ids.argmax(dim=-1)
    return (ids == eos_id).int().argmax(dim=-1)


class TextTower(nn.Module):
    """Token embedding -> causal stack (its final norm: transformers' ``final_layer_norm``) -> the hidden state at
    each row's end-of-text token (B, D) -> projection (B, E). A causal stack pooled at the end-of-text token never
    sees what follows it: padding after it needs no mask."""

    def __init__(self, cfg: TransformerConfig, vocab_size: int, embed_dim: int, eos_id: int | None) -> None:
        super().__init__()
        self.vocab_size, self.eos_id = vocab_size, eos_id
        self.embed = TokenEmbedding(vocab_size, cfg.d_model)
        self.decoder = Decoder(cfg)
        self.projection = nn.Linear(cfg.d_model, embed_dim, bias=False)
        nn.init.normal_(self.projection.weight, std=cfg.d_model**-0.5)

    def forward(self, ids: Tensor) -> Tensor:
        hidden = self.decoder(self.embed(ids))  # (B, T, D)
        pooled = hidden[torch.arange(ids.size(0), device=ids.device), end_of_text(ids, self.eos_id)]  # (B, D)
        return self.projection(pooled)


class CLIP(nn.Module):
    """``encode_image(images)`` (B, C, H, W) and ``encode_text(ids)`` (B, T) give the projected features (B, E),
    unnormalised (transformers' ``get_image_features`` / ``get_text_features``); ``forward(images, ids)`` the
    image-text logits (B_images, B_texts), ``logits_per_image``, scaled by the clamped temperature."""

    #: The methods that run the network besides ``forward``: FSDP gathers the root's weights around each of them as it
    #: does around ``forward`` (trident.parallel.fsdp.parallelize). None calls another: each is entered from outside.
    FORWARD_METHODS = ("encode_image", "encode_text", "normalised")

    def __init__(self, text: TransformerConfig, image: TransformerConfig, *, vocab_size: int, embed_dim: int,
                 eos_id: int | None, patch_size: int, in_channels: int) -> None:
        super().__init__()
        self.text = TextTower(text, vocab_size, embed_dim, eos_id)
        # The ViT's head is the image projection; its class token is pooled (after the final norm: CLIP's
        # post_layernorm); CLIP's patch projection has no bias.
        self.image = VisionTransformer(image, patch_size=patch_size, in_channels=in_channels, num_classes=embed_dim,
                                       pool="cls", patch_bias=False, head_bias=False)
        # (1,), not a scalar: FSDP2 shards parameters along their first axis (transformers' and open_clip's are ()).
        self.logit_scale = nn.Parameter(torch.full((1,), INITIAL_LOGIT_SCALE))

    def no_weight_decay(self) -> set[str]:
        """What AdamW should not decay: the temperature, the class token, the learned position tables."""
        return {"logit_scale", "text.decoder.pos_encoding.embedding.weight",
                *(f"image.{name}" for name in self.image.no_weight_decay())}

    def encode_image(self, images: Tensor) -> Tensor:
        return self.image(images)

    def encode_text(self, ids: Tensor) -> Tensor:
        return self.text(ids)

    def scale(self) -> Tensor:
        """(1,) exp of the temperature's log, clamped at log(100) as CLIP clamps it."""
        return self.logit_scale.clamp(max=MAX_LOGIT_SCALE).exp()

    def normalised(self, images: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
        """The L2-normalised features of ``images`` and ``ids``, (B, E) each."""
        return F.normalize(self.image(images), dim=-1), F.normalize(self.text(ids), dim=-1)

    def forward(self, images: Tensor, ids: Tensor) -> Tensor:
        image, text = F.normalize(self.image(images), dim=-1), F.normalize(self.text(ids), dim=-1)
        return self.scale() * image @ text.T  # (B_images, B_texts)
