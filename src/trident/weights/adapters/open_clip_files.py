"""open_clip's CLIP models of OpenAI's layout (``open_clip.model.CLIP``: ViT image tower, causal text transformer)
read into trident's ``CLIP``: a directory as open_clip's hub files hold it, ``open_clip_config.json``
(its ``model_cfg``: ``embed_dim``, ``vision_cfg``, ``text_cfg``, ``quick_gelu``) beside ``open_clip_model.safetensors``
or ``open_clip_pytorch_model.bin``. Read only, without open_clip.

The layout: fused ``in_proj`` attention (trident's ``qkv_proj``), ``ln_pre`` on the image embeddings (trident's
``embedding_norm``), ``ln_post`` on every token before the class token is pooled (trident's final norm), the projections
as (D, E) matrices the features multiply (trident's bias-free linear layers hold their transposes), the text pooled at
its largest id (OpenAI's end-of-text token is the last of the vocabulary).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from trident.models.clip import CLIP
from trident.models.properties import PIXEL_MEAN, PIXEL_STD
from trident.weights.adapters.common import require_source
from trident.weights.adapters.hf_clip import OPENAI_MEAN, OPENAI_STD, clip_properties
from trident.weights.adapters.hf_files import read_tokenizer
from trident.weights.adapters.outside_network import OutsideNetwork

FORMAT = "open-clip"
NETWORK = CLIP
CONFIG = "open_clip_config.json"
WEIGHTS = ("open_clip_model.safetensors", "open_clip_pytorch_model.bin")
SUFFIXES = tuple(Path(name).suffix for name in WEIGHTS)  # its weights files' (inside its directory)
DESCRIPTION = f"an open_clip model directory ({CONFIG} beside {' or '.join(WEIGHTS)})"
# The settings of open_clip's model_cfg that trident reproduces, and those that say only how open_clip tokenizes.
_TOP = ("embed_dim", "vision_cfg", "text_cfg", "quick_gelu")
_VISION = ("layers", "width", "head_width", "mlp_ratio", "patch_size", "image_size")
_TEXT = ("context_length", "vocab_size", "width", "heads", "layers", "mlp_ratio", "hf_tokenizer_name", "tokenizer_kwargs",
         "tokenizer_mode")
# Settings open_clip's configs may state at the value that builds OpenAI's layout; any other value is refused in one
# line (a layer scale, an attentional pooler, a text tower without its causal mask or pooled elsewhere...).
_AT_DEFAULT: dict[str, Any] = {
    "custom_text": False, "init_logit_bias": None, "ls_init_value": None, "patch_dropout": 0.0, "attentional_pool": False,
    "no_ln_pre": False, "pos_embed_type": "learnable", "final_ln_after_pool": False, "output_tokens": False,
    "timm_model_name": None, "hf_model_name": None, "act_kwargs": None, "norm_kwargs": None, "embed_cls": False,
    "no_causal_mask": False, "proj_bias": False, "proj_type": "linear",
}
# The pooling of OpenAI's layout: the image's class token, the text's largest id.
_POOLING = {"vision_cfg.": {"pool_type": "tok"}, "text_cfg.": {"pool_type": "argmax"}, "": {}}
_BLOCK = {"ln_1": "self_attn_norm", "attn.in_proj": "self_attn.qkv_proj", "attn.out_proj": "self_attn.out_proj",
          "ln_2": "ffn_norm", "mlp.c_fc": "ffn.fc_in", "mlp.c_proj": "ffn.fc_out"}


def recognises(path: Path) -> bool:
    return path.is_dir() and (path / CONFIG).is_file() and any((path / name).is_file() for name in WEIGHTS)


def _weights(path: Path) -> dict[str, Tensor]:
    file = next(path / name for name in WEIGHTS if (path / name).is_file())
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(file))
    return torch.load(file, map_location="cpu", weights_only=True)


def _blocks(state: dict[str, Tensor], theirs: str, mine: str, layers: int) -> dict[str, Tensor]:
    out = {}
    for i in range(layers):
        for name, target in _BLOCK.items():
            weight, bias = (f"{theirs}.{i}.{name}_weight", f"{theirs}.{i}.{name}_bias") if name == "attn.in_proj" else (
                f"{theirs}.{i}.{name}.weight", f"{theirs}.{i}.{name}.bias")
            out[f"{mine}.{i}.{target}.weight"], out[f"{mine}.{i}.{target}.bias"] = state[weight], state[bias]
    return out


def _settings(width: int, heads: int, layers: int, mlp_ratio: float, activation: str) -> dict[str, Any]:
    return {"d_model": width, "n_heads": heads, "n_layers": layers, "d_ff": int(width * mlp_ratio),
            "activation": activation, "norm": "layernorm", "norm_first": True, "bias": True, "norm_eps": 1e-5}


def state_to_trident(state: dict[str, Tensor], vision_layers: int, text_layers: int) -> dict[str, Tensor]:
    """open_clip's state dict (OpenAI's layout) in the names of trident's ``CLIP``."""
    out = {
        "image.patch_embed.proj.weight": state["visual.conv1.weight"],
        "image.cls_token": state["visual.class_embedding"][None, None],  # (D,) -> (1, 1, D)
        "image.encoder.pos_encoding.embedding.weight": state["visual.positional_embedding"],
        "image.head.weight": state["visual.proj"].T.contiguous(),  # (D, E) -> (E, D)
        "text.embed.weight": state["token_embedding.weight"],
        "text.decoder.pos_encoding.embedding.weight": state["positional_embedding"],
        "text.projection.weight": state["text_projection"].T.contiguous(),
        "logit_scale": state["logit_scale"].reshape(1),
    }
    for theirs, mine in (("visual.ln_pre", "image.encoder.embedding_norm"), ("visual.ln_post", "image.encoder.final_norm"),
                         ("ln_final", "text.decoder.final_norm")):
        out[f"{mine}.weight"], out[f"{mine}.bias"] = state[f"{theirs}.weight"], state[f"{theirs}.bias"]
    out |= _blocks(state, "visual.transformer.resblocks", "image.encoder.blocks", vision_layers)
    return out | _blocks(state, "transformer.resblocks", "text.decoder.blocks", text_layers)


def _checked(config: dict[str, Any], source: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``vision_cfg`` and ``text_cfg`` of open_clip's ``model_cfg``, each setting one trident reproduces; any other
    (an image tower of a ResNet, a timm model, an attentional pooler; a Hugging Face text tower) is one line."""
    vision, text = dict(config.get("vision_cfg") or {}), dict(config.get("text_cfg") or {})
    require_source(not isinstance(vision.get("layers"), list | tuple), source,
                   f"open_clip's ResNet image tower (vision_cfg.layers={vision.get('layers')})")
    for where, settings, kept in (("", config, _TOP), ("vision_cfg.", vision, _VISION), ("text_cfg.", text, _TEXT)):
        for key, value in settings.items():
            defaults = _AT_DEFAULT | _POOLING[where]
            known = key in kept or (key in defaults and value == defaults[key])
            require_source(known, source, f"open_clip's {where}{key}={value!r} setting")
    return vision, text


def _statistics(preprocess: dict[str, Any]) -> dict[str, list[float]]:
    """The image statistics open_clip normalises with: its ``preprocess_cfg``'s, else OpenAI's (open_clip's default)."""
    mean, std = preprocess.get("mean", OPENAI_MEAN), preprocess.get("std", OPENAI_STD)
    return {PIXEL_MEAN: [float(v) for v in mean], PIXEL_STD: [float(v) for v in std]}


def read(path: Path, source: str, n_heads: int | None) -> OutsideNetwork:
    """The model at ``path`` in trident's terms: the text tower's settings as the backbone, the image tower's as its
    property (trident.models.properties; ``n_heads`` is unused: open_clip's config records the heads), the tokenizer
    beside it where open_clip saved one (``tokenizer.json``: ``save_for_hf`` saves a Hugging Face tokenizer)."""
    written = json.loads((path / CONFIG).read_text())
    config = written.get("model_cfg") or {}
    vision, text = _checked(config, source)
    activation = "quick_gelu" if config.get("quick_gelu", False) else "gelu"
    width = int(vision.get("width", 768))
    image = _settings(width, width // int(vision.get("head_width", 64)), int(vision.get("layers", 12)),
                      float(vision.get("mlp_ratio", 4.0)), activation)
    model = _settings(int(text.get("width", 512)), int(text.get("heads", 8)), int(text.get("layers", 12)),
                      float(text.get("mlp_ratio", 4.0)), activation)
    state = state_to_trident(_weights(path), image["n_layers"], model["n_layers"])
    # OpenAI's layout pools the text at its largest id (its end-of-text token is the last of the vocabulary).
    properties = clip_properties(int(config.get("embed_dim", 512)), image, None, int(vision.get("image_size", 224)),
                                 int(vision.get("patch_size", 16)), 3, int(text.get("context_length", 77)))
    return OutsideNetwork(
        source=source, format=FORMAT, network=NETWORK, model=model, pos_encoding="learned",
        properties=properties | _statistics(written.get("preprocess_cfg") or {}), state_dict=state,
        tokenizer=read_tokenizer(path), vocab_size=int(text.get("vocab_size", 49408)),
    )
