"""CLIP (``CLIPModel``) <-> trident's ``CLIP`` (an image tower and a text tower), both ways.

transformers' CLIP: a text tower (token and learned position embeddings, pre-norm causal layers, ``final_layer_norm``,
pooled at the end-of-text token: the first ``eos_token_id``, or the largest id where ``eos_token_id`` is the legacy 2)
and a vision tower (a bias-free patch convolution, a class embedding and learned positions, ``pre_layrnorm`` on the
embeddings: trident's ``embedding_norm``, pre-norm layers, ``post_layernorm`` on the class token: trident's final norm,
which is per token), each projected without bias, and ``logit_scale``. Its layers keep separate q/k/v projections,
fused here into trident's ``qkv_proj``. The text tower's settings are the backbone's; the vision tower's are the
image tower's (trident.models.properties), which the task that holds a ``CLIP`` maps onto its settings.
"""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer
from torch import Tensor

from trident.models.clip import CLIP
from trident.models.properties import (
    CHANNELS,
    END_OF_TEXT,
    IMAGE_SIZE,
    IMAGE_TOWER,
    MAX_SEQ_LEN,
    PATCH_SIZE,
    PIXEL_MEAN,
    PIXEL_STD,
    PROJECTION_DIM,
    TEXT_TOWER,
)
from trident.weights.adapters.common import (
    activation_from_hf,
    activation_to_hf,
    fuse_qkv,
    hf_model_settings,
    require_hf_block,
    require_source,
    split_qkv,
)
from trident.weights.adapters.outside_network import OutsideNetwork, require_property

FORMAT = "hf-clip"
MODEL_TYPE = "clip"
FAMILY = "clip"  # model.family of the stacks it reads and writes (both towers')
ARCHITECTURES = ("CLIPModel",)
NETWORK = CLIP
TARGET = "CLIP (hf export)"
# CLIP's tokenizer's named tokens (transformers' CLIPTokenizer pads with the end-of-text token), where the run's
# vocabulary has them: trident's own caption tokenizer has <|endoftext|> and no <|startoftext|>.
SPECIAL_TOKENS = {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
#: The image statistics CLIP was trained with (OpenAI's): transformers' CLIPImageProcessor's and open_clip's defaults, what
#: a CLIP directory without its processor's preprocessor_config.json is read with.
OPENAI_MEAN, OPENAI_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
#: transformers' CLIP pooled at the largest id while its configs said ``eos_token_id=2`` (before PR #24773).
LEGACY_EOS = 2

_LAYER = {
    "layer_norm1.weight": "self_attn_norm.weight", "layer_norm1.bias": "self_attn_norm.bias",
    "self_attn.out_proj.weight": "self_attn.out_proj.weight", "self_attn.out_proj.bias": "self_attn.out_proj.bias",
    "layer_norm2.weight": "ffn_norm.weight", "layer_norm2.bias": "ffn_norm.bias",
    "mlp.fc1.weight": "ffn.fc_in.weight", "mlp.fc1.bias": "ffn.fc_in.bias",
    "mlp.fc2.weight": "ffn.fc_out.weight", "mlp.fc2.bias": "ffn.fc_out.bias",
}
_TEXT = {
    "text_model.embeddings.token_embedding.weight": "text.embed.weight",
    "text_model.embeddings.position_embedding.weight": "text.decoder.pos_encoding.embedding.weight",
    "text_model.final_layer_norm.weight": "text.decoder.final_norm.weight",
    "text_model.final_layer_norm.bias": "text.decoder.final_norm.bias",
    "text_projection.weight": "text.projection.weight",
}
_VISION = {
    "vision_model.embeddings.patch_embedding.weight": "image.patch_embed.proj.weight",
    "vision_model.embeddings.position_embedding.weight": "image.encoder.pos_encoding.embedding.weight",
    "vision_model.pre_layrnorm.weight": "image.encoder.embedding_norm.weight",
    "vision_model.pre_layrnorm.bias": "image.encoder.embedding_norm.bias",
    "vision_model.post_layernorm.weight": "image.encoder.final_norm.weight",
    "vision_model.post_layernorm.bias": "image.encoder.final_norm.bias",
    "visual_projection.weight": "image.head.weight",
}
_SCALE = "logit_scale"  # () in transformers, (1,) in trident (FSDP2 shards no scalar)
_CLASS = ("vision_model.embeddings.class_embedding", "image.cls_token")  # (D,) <-> (1, 1, D)
_STACKS = (("text_model.encoder.layers", "text.decoder.blocks"), ("vision_model.encoder.layers", "image.encoder.blocks"))


def _stack_names(n_layers: tuple[int, int]) -> tuple[dict[str, str], dict[str, tuple[str, str, str]]]:
    """The names of both towers' layers (``n_layers``: the text tower's, the vision tower's), one map for both ways:
    transformers' -> trident's of each parameter kept as it is, and trident's fused ``qkv_proj`` -> transformers' q, k
    and v projections."""
    plain: dict[str, str] = {}
    fused: dict[str, tuple[str, str, str]] = {}
    for (hf, trident), layers in zip(_STACKS, n_layers, strict=True):
        for i in range(layers):
            theirs, mine = f"{hf}.{i}", f"{trident}.{i}"
            plain |= {f"{theirs}.{name}": f"{mine}.{own}" for name, own in _LAYER.items()}
            for kind in ("weight", "bias"):
                q, k, v = (f"{theirs}.self_attn.{role}_proj.{kind}" for role in "qkv")
                fused[f"{mine}.self_attn.qkv_proj.{kind}"] = (q, k, v)
    return plain, fused


def _tower_settings(config: dict[str, Any], source: str) -> dict[str, Any]:
    return hf_model_settings(
        int(config["hidden_size"]), int(config["num_attention_heads"]), int(config["num_hidden_layers"]),
        int(config["intermediate_size"]), activation=activation_from_hf(config.get("hidden_act", "quick_gelu"), source),
        norm_first=True, norm_eps=float(config.get("layer_norm_eps", 1e-5)),
    )


def clip_properties(projection_dim: int, image_tower: dict[str, Any], end_of_text: int | None, image_size: int,
                    patch_size: int, channels: int, context: int) -> dict[str, Any]:
    """What a CLIP's files say of it beside its backbone (the text tower's settings): its projection width, the image
    tower's settings (with its embedding norm: CLIP's ``pre_layrnorm`` / ``ln_pre``), the pooled token (None: each row's
    largest id), the image geometry, the text's context (its position table's rows) and OpenAI's image statistics (a
    preprocessor_config.json or open_clip's preprocess_cfg beside the weights states others)."""
    return {PROJECTION_DIM: projection_dim, TEXT_TOWER: None, IMAGE_TOWER: {**image_tower, "embedding_norm": True},
            END_OF_TEXT: end_of_text, IMAGE_SIZE: image_size, PATCH_SIZE: patch_size, CHANNELS: channels,
            MAX_SEQ_LEN: context, PIXEL_MEAN: OPENAI_MEAN, PIXEL_STD: OPENAI_STD}


def to_trident(config: dict[str, Any], state: dict[str, Tensor], tokenizer: Tokenizer | None, source: str) -> OutsideNetwork:
    """``config.json`` (its ``text_config`` and ``vision_config``) and ``CLIPModel``'s state dict in trident's terms:
    the text tower's settings as the backbone, the vision tower's as the image tower's."""
    text, vision = config["text_config"], config["vision_config"]
    require_source(int(vision.get("image_size", 224)) % int(vision.get("patch_size", 32)) == 0, source,
                   "a patch size that does not tile the image")
    plain, fused = _stack_names((int(text["num_hidden_layers"]), int(vision["num_hidden_layers"])))
    out = {mine: state[theirs] for theirs, mine in (_TEXT | _VISION | plain).items()}
    out |= {mine: fuse_qkv(*(state[name] for name in theirs)) for mine, theirs in fused.items()}
    out[_CLASS[1]] = state[_CLASS[0]][None, None]  # (D,) -> (1, 1, D)
    out[_SCALE] = state[_SCALE].reshape(1)
    eos = text.get("eos_token_id", LEGACY_EOS)
    properties = clip_properties(int(config.get("projection_dim", 512)), _tower_settings(vision, source),
                                 None if eos == LEGACY_EOS else int(eos), int(vision.get("image_size", 224)),
                                 int(vision.get("patch_size", 32)), int(vision.get("num_channels", 3)),
                                 int(text.get("max_position_embeddings", 77)))
    return OutsideNetwork(
        source=source, format=FORMAT, network=NETWORK, model=_tower_settings(text, source), pos_encoding="learned",
        properties=properties, state_dict=out, tokenizer=tokenizer, vocab_size=int(text["vocab_size"]),
    )


def _tower_config(cfg: Any, embedding_norm: bool, projection_dim: int) -> dict[str, Any]:
    """A tower's ``CLIPTextConfig`` / ``CLIPVisionConfig`` arguments; ``embedding_norm``: the vision tower's
    ``pre_layrnorm`` (the text tower has none); ``projection_dim``: the model's (``CLIPTextModelWithProjection`` and
    ``CLIPVisionModelWithProjection`` read a tower's own, 512 by default)."""
    require_hf_block(cfg, TARGET, norm_first=True, embedding_norm=embedding_norm)
    return {"hidden_size": cfg.d_model, "num_attention_heads": cfg.n_heads, "num_hidden_layers": cfg.n_layers,
            "intermediate_size": cfg.d_ff, "hidden_act": activation_to_hf(cfg.activation, TARGET),
            "layer_norm_eps": cfg.norm_eps, "attention_dropout": cfg.attn_dropout, "projection_dim": projection_dim}


def from_trident(net: CLIP) -> tuple[str, dict[str, Any], dict[str, Tensor]]:
    """``CLIPModel``'s architecture name, ``CLIPConfig`` arguments and state dict of ``net``."""
    text, image = net.text.decoder.cfg, net.image.encoder.cfg
    if image.grid is None:
        raise ValueError("CLIP's image tower always has a grid")
    # eos_token_id 2 is transformers' legacy marker, pooled at each row's largest id: not where this run pools.
    require_property(net.text.eos_id != LEGACY_EOS, NETWORK, END_OF_TEXT, net.text.eos_id, TARGET,
                     f"a CLIPModel whose eos_token_id is {LEGACY_EOS} pools at each row's largest id (its configs "
                     "before transformers' PR #24773): train with a tokenizer whose <|endoftext|> has another id "
                     "(trident's own caption tokenizer's is 1)")
    _, in_channels, patch_size, _ = net.image.patch_embed.proj.weight.shape  # (D, C, p, p)
    projection = net.text.projection.out_features
    config = {
        "projection_dim": projection,
        "logit_scale_init_value": float(net.logit_scale.detach()),
        # The text tower pools at eos_token_id; CLIPTextConfig's default bos and pad ids (49406, 1) are OpenAI's
        # tokenizer's, not the run's (whose ids the config's top level holds: hf_export.run_settings).
        "text_config": {**_tower_config(text, False, projection), "vocab_size": net.text.vocab_size,
                        "max_position_embeddings": text.max_seq_len, "bos_token_id": None, "pad_token_id": None,
                        "eos_token_id": LEGACY_EOS if net.text.eos_id is None else net.text.eos_id},
        "vision_config": {**_tower_config(image, True, projection), "image_size": image.grid[0] * patch_size,
                          "patch_size": patch_size, "num_channels": in_channels},
    }
    own = net.state_dict()
    plain, fused = _stack_names((text.n_layers, image.n_layers))
    state = {theirs: own[mine] for theirs, mine in (_TEXT | _VISION | plain).items()}
    for mine, theirs in fused.items():
        state |= {name: part.contiguous() for name, part in zip(theirs, split_qkv(own[mine]), strict=True)}
    state[_CLASS[0]] = own[_CLASS[1]].reshape(-1)
    state[_SCALE] = own[_SCALE].reshape(())
    return "CLIPModel", config, state


def writes(net: CLIP) -> bool:
    """Every CLIP is written as CLIPModel (its refusals name what CLIPModel lacks)."""
    return True
