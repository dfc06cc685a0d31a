"""ViT (``ViTForImageClassification`` / ``ViTModel``) <-> trident's ``VisionTransformer`` (an image encoder).

Both are pre-norm encoders over a class token and patch embeddings (a strided convolution) with a
learned position table and a final LayerNorm (eps 1e-12 in Hugging Face's ViT); the classifier
reads the class token. ``ViTModel``'s pooler is not used by the classifier and is left out.
"""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer
from torch import Tensor

from trident.models.properties import CHANNELS, CLASSES, IMAGE_SIZE, PATCH_SIZE, READOUT
from trident.models.vit import VisionTransformer
from trident.weights.adapters.common import (
    activation_from_hf,
    activation_to_hf,
    encoder_settings,
    layer_from_hf,
    layer_to_hf,
    require_equivalent,
    require_hf_block,
    require_source,
    square_size,
    strip_prefix,
)
from trident.weights.adapters.outside_network import OutsideNetwork, require_property

FORMAT = "hf-vit"
MODEL_TYPE = "vit"
FAMILY = "vit"  # model.family of the stacks it reads and writes
ARCHITECTURES = ("ViTForImageClassification", "ViTModel")
NETWORK = VisionTransformer
TARGET = "ViT (hf export)"
SPECIAL_TOKENS: dict[str, str] = {}  # images: no tokenizer

_LAYER = {
    "layernorm_before.weight": "self_attn_norm.weight",
    "layernorm_before.bias": "self_attn_norm.bias",
    "attention.output.dense.weight": "self_attn.out_proj.weight",
    "attention.output.dense.bias": "self_attn.out_proj.bias",
    "layernorm_after.weight": "ffn_norm.weight",
    "layernorm_after.bias": "ffn_norm.bias",
    "intermediate.dense.weight": "ffn.fc_in.weight",
    "intermediate.dense.bias": "ffn.fc_in.bias",
    "output.dense.weight": "ffn.fc_out.weight",
    "output.dense.bias": "ffn.fc_out.bias",
}
_TOP = {
    "embeddings.patch_embeddings.projection.weight": "patch_embed.proj.weight",
    "embeddings.patch_embeddings.projection.bias": "patch_embed.proj.bias",
    "embeddings.cls_token": "cls_token",
    "layernorm.weight": "encoder.final_norm.weight",
    "layernorm.bias": "encoder.final_norm.bias",
}
_POSITIONS = "embeddings.position_embeddings"
_HEAD = {"classifier.weight": "head.weight", "classifier.bias": "head.bias"}


def to_trident(config: dict[str, Any], state: dict[str, Tensor], tokenizer: Tokenizer | None, source: str) -> OutsideNetwork:
    require_source(config.get("qkv_bias", True), source, "attention without biases next to biased layers (qkv_bias=false)")
    n_layers = int(config["num_hidden_layers"])
    backbone = strip_prefix(state, "vit.")
    out = {target: backbone[name] for name, target in _TOP.items()}
    out["encoder.pos_encoding.embedding.weight"] = backbone[_POSITIONS][0]  # (1, T, D) -> (T, D)
    for i in range(n_layers):
        out |= layer_from_hf(backbone, f"encoder.layer.{i}", f"encoder.blocks.{i}", _LAYER, "attention.attention")
    properties = {
        READOUT: "cls",
        IMAGE_SIZE: square_size(config.get("image_size", 224), "image_size", source),
        PATCH_SIZE: square_size(config.get("patch_size", 16), "patch_size", source),
        CHANNELS: int(config.get("num_channels", 3)),
    }
    if "classifier.weight" in state:
        out |= {target: state[name] for name, target in _HEAD.items()}
        properties[CLASSES] = int(state["classifier.weight"].shape[0])
    return OutsideNetwork(
        source=source,
        format=FORMAT,
        network=NETWORK,
        model=encoder_settings(config, activation=activation_from_hf(config.get("hidden_act", "gelu"), source), norm_first=True, embedding_norm=False),
        pos_encoding="learned",
        properties=properties,
        state_dict=out,
        tokenizer=None,
    )


def from_trident(net: VisionTransformer) -> tuple[str, dict[str, Any], dict[str, Tensor]]:
    """The architecture name, ``ViTConfig`` arguments and ``ViTForImageClassification`` state dict of ``net``."""
    cfg = net.encoder.cfg
    require_property(net.pool == "cls", NETWORK, READOUT, net.pool, TARGET, "Hugging Face's ViT classifies from the class token")
    require_hf_block(cfg, TARGET, norm_first=True, embedding_norm=False)
    require_equivalent(not cfg.distillation_token, "model.distillation_token", True, TARGET,
                       "ViTForImageClassification has no distillation token and head (timm's deit_*_distilled has: "
                       "trident.weights.adapters.timm_vit.trident_to_timm writes its state dict)")
    if cfg.grid is None:
        raise ValueError("a VisionTransformer always has a grid")
    _, in_channels, patch_size, _ = net.patch_embed.proj.weight.shape  # (D, C, p, p)
    config = {
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "intermediate_size": cfg.d_ff,
        "hidden_act": activation_to_hf(cfg.activation, TARGET),
        "hidden_dropout_prob": cfg.dropout,
        "attention_probs_dropout_prob": cfg.attn_dropout,
        "layer_norm_eps": cfg.norm_eps,
        "image_size": cfg.grid[0] * patch_size,
        "patch_size": patch_size,
        "num_channels": in_channels,
        "qkv_bias": True,
        "num_labels": net.head.out_features,
    }
    own = net.state_dict()
    state = {f"vit.{name}": own[target] for name, target in _TOP.items()}
    state[f"vit.{_POSITIONS}"] = own["encoder.pos_encoding.embedding.weight"][None]  # (1, T, D)
    for i in range(cfg.n_layers):
        state |= layer_to_hf(own, f"encoder.blocks.{i}", f"vit.encoder.layer.{i}", _LAYER, "attention.attention")
    state |= {name: own[target] for name, target in _HEAD.items()}
    return "ViTForImageClassification", config, state


def writes(net: VisionTransformer) -> bool:
    """Every VisionTransformer is written as ViT (its refusals name what ViT lacks)."""
    return True
