"""A timm ``VisionTransformer`` state dict <-> trident's ``VisionTransformer`` (an image encoder), DeiT's distilled
ViT (timm's ``VisionTransformerDistilled``: ``dist_token`` and ``head_dist``, named alike in both) included.

timm and trident name the same tensors differently; the layouts match (fused qkv in q, k, v
order with heads contiguous; the class token's position first in the position table, then the
distillation token's). A state
dict does not record the number of heads, and it changes no tensor's shape: it comes from timm's
``config.json`` beside the weights (``model_args``, else the architecture's own), else from the
caller (``model.n_heads=``); only where nothing states it are 64-channel heads assumed (most timm
ViTs; not huge, giant or gigantic), and the weights table says so.
"""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from trident.errors import ConfigError, DataError
from trident.models.properties import CHANNELS, CLASSES, IMAGE_SIZE, PATCH_SIZE, READOUT
from trident.models.vit import VisionTransformer
from trident.weights.adapters.common import require_source
from trident.weights.adapters.hf_files import read_state_dict
from trident.weights.adapters.outside_network import OutsideNetwork

log = logging.getLogger(__name__)

FORMAT = "timm-vit"
NETWORK = VisionTransformer  # the trident network it reads into
SUFFIXES = (".pth", ".pt", ".bin", ".safetensors")
DESCRIPTION = f"a timm ViT state-dict file ({'/'.join(SUFFIXES)}) or directory (timm's config.json + weights)"
ASSUMED_HEAD_DIM = 64  # channels per head of timm's tiny ... large ViTs (huge 1280/16 and larger differ)
TIMM_NORM_EPS = 1e-6

# timm block tensor prefix -> trident's, inside ``blocks.<i>.`` / ``encoder.blocks.<i>.``.
_LAYER = {
    "norm1.": "self_attn_norm.",
    "attn.qkv.": "self_attn.qkv_proj.",
    "attn.proj.": "self_attn.out_proj.",
    "ls1.": "self_attn_scale.",
    "norm2.": "ffn_norm.",
    "mlp.fc1.": "ffn.fc_in.",
    "mlp.fc2.": "ffn.fc_out.",
    "ls2.": "ffn_scale.",
}
# Outside the blocks: timm name or prefix -> trident's (the rest, e.g. patch_embed, head, cls_token, dist_token,
# head_dist, is shared).
_TOP = {"norm.": "encoder.final_norm."}
_POSITIONS = ("pos_embed", "encoder.pos_encoding.embedding.weight")


def _rename(name: str, blocks: tuple[str, str], layer: dict[str, str], top: dict[str, str]) -> str:
    """``name`` with the prefixes of one naming replaced by the other's (``blocks`` = (from, to))."""
    if match := re.match(rf"{re.escape(blocks[0])}(\d+)\.(.+)", name):
        index, rest = match.groups()
        for old, new in layer.items():
            if rest.startswith(old):
                return f"{blocks[1]}{index}.{new}{rest.removeprefix(old)}"
        return name
    for old, new in top.items():
        if name.startswith(old):
            return new + name.removeprefix(old)
    return name


def timm_to_trident(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """Rename a timm ViT state dict to trident's names (pos_embed (1, T, D) -> table (T, D))."""
    out: dict[str, Tensor] = {}
    for name, tensor in state_dict.items():
        if name == _POSITIONS[0]:
            out[_POSITIONS[1]] = tensor[0]
        else:
            out[_rename(name, ("blocks.", "encoder.blocks."), _LAYER, _TOP)] = tensor
    return out


def trident_to_timm(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """The inverse of :func:`timm_to_trident` (table (T, D) -> pos_embed (1, T, D))."""
    layer = {new: old for old, new in _LAYER.items()}
    top = {new: old for old, new in _TOP.items()}
    out: dict[str, Tensor] = {}
    for name, tensor in state_dict.items():
        if name == _POSITIONS[1]:
            out[_POSITIONS[0]] = tensor[None]
        else:
            out[_rename(name, ("encoder.blocks.", "blocks."), layer, top)] = tensor
    return out


def recognises(path: Path) -> bool:
    """A state-dict file of a timm suffix, or a directory with timm's ``config.json`` (it names the ``architecture``)."""
    return path.suffix in SUFFIXES if path.is_file() else timm_config(path) is not None


def read(path: Path, source: str, n_heads: int | None) -> OutsideNetwork:
    """A timm ViT file (timm's ``config.json`` beside it, if any, gives the heads) or timm's directory."""
    if path.is_file():
        return from_timm(read_timm_file(path), source, timm_config(path.parent), n_heads)
    return from_timm(read_state_dict(path), source, timm_config(path), n_heads)


def read_timm_file(path: Path) -> dict[str, Tensor]:
    """The state dict in a timm checkpoint file (.pth/.bin/.safetensors; a training checkpoint's
    ``state_dict`` or ``model`` entry too)."""
    if not path.is_file():
        raise DataError(f"pretrained weights {str(path)!r} not found: give a timm ViT state-dict file")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise DataError(f"cannot read pretrained weights {str(path)!r} ({type(err).__name__}): not a state-dict file") from err
    if not isinstance(state, dict):
        raise DataError(f"pretrained weights {str(path)!r} hold a {type(state).__name__}, not a state dict")
    return state.get("state_dict", state.get("model", state))


def timm_config(directory: Path) -> dict[str, Any] | None:
    """timm's ``config.json`` in ``directory`` (``save_pretrained`` / the Hub's layout: it names the
    ``architecture``), or None where there is none (a Hugging Face ``config.json`` is not timm's)."""
    path = directory / "config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise DataError(f"{path} cannot be read ({type(err).__name__}): give timm's config.json or remove it") from None
    return config if isinstance(config, dict) and "architecture" in config else None


def _architecture_heads(config: dict[str, Any], d_model: int, source: str) -> int:
    """The head count timm's ``config.json`` states: its ``model_args``, else its architecture's default
    (built on the meta device: no memory, no download), which must be as wide as the weights."""
    args = dict(config.get("model_args") or {})
    if "num_heads" in args and int(args.get("embed_dim", d_model)) == d_model:
        return int(args["num_heads"])
    import timm
    from timm.models.vision_transformer import VisionTransformer as TimmViT

    name = config["architecture"]
    try:
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False, **args)
    except Exception as err:  # an unknown name (RuntimeError) or arguments it does not take (TypeError)
        raise DataError(f"{source}: its config.json names {name}, which timm {timm.__version__} cannot build "
                        f"({type(err).__name__}): add model_args.num_heads to it, or remove it and set model.n_heads=") from err
    require_source(isinstance(model, TimmViT), source, f"a timm {type(model).__name__} ({name}), not a VisionTransformer")
    if model.embed_dim != d_model:
        raise DataError(f"{source}: its config.json names {name}, which is {model.embed_dim} wide; the weights are "
                        f"{d_model} wide: give the config.json saved with these weights")
    return int(model.blocks[0].attn.num_heads)


def _heads(d_model: int, config: dict[str, Any] | None, n_heads: int | None, source: str) -> tuple[int, dict[str, str]]:
    """The head count and, where the file does not record it, the weights table's note saying so."""
    if config is not None:
        return _architecture_heads(config, d_model, source), {}
    if n_heads is not None:
        if n_heads <= 0 or d_model % n_heads:
            raise ConfigError(f"n_heads={n_heads} does not divide the width {d_model} of {source}: give the head count "
                              f"of the model that was trained (a divisor of {d_model})")
        return n_heads, {"encoder.blocks": f"heads: {n_heads} (as given; the file does not record them)"}
    if d_model % ASSUMED_HEAD_DIM:
        raise DataError(f"{source} is a timm ViT {d_model} wide and records no head count, which {ASSUMED_HEAD_DIM}-channel "
                        "heads do not divide: set model.n_heads= (read_pretrained: n_heads=), or put timm's config.json "
                        "beside the file")
    heads = d_model // ASSUMED_HEAD_DIM
    note = f"heads: {heads} (assumed {ASSUMED_HEAD_DIM} channels each; set model.n_heads= if the source differs)"
    log.warning("%s: %s", source, note)
    return heads, {"encoder.blocks": note}


def from_timm(state: dict[str, Tensor], source: str, config: dict[str, Any] | None = None,
              n_heads: int | None = None) -> OutsideNetwork:
    """A timm ViT state dict in trident's terms; its geometry is read off the tensors' shapes, its head
    count from timm's ``config`` (``config.json``), else ``n_heads``, else 64-channel heads (noted)."""
    require_source("pos_embed" in state and "patch_embed.proj.weight" in state, source,
                   "no pos_embed/patch_embed.proj.weight, so not a timm ViT; it holds something")
    require_source("cls_token" in state, source, "no class token (global average pooling with fc_norm)")
    distilled = "dist_token" in state  # DeiT's distillation token and its head
    require_source(distilled == ("head_dist.weight" in state) or "head.weight" not in state, source,
                   "a distillation token without its head (head_dist), or the reverse")
    converted = timm_to_trident(state)
    d_model, in_channels, patch_size, _ = state["patch_embed.proj.weight"].shape  # (D, C, p, p)
    n_layers = 1 + max(int(m.group(1)) for name in state if (m := re.match(r"blocks\.(\d+)\.", name)))
    side = math.isqrt(state["pos_embed"].shape[1] - 1 - distilled)  # (1, prefix + side*side, D)
    shared = ("encoder.", "patch_embed.", "cls_token", "head.", *(("dist_token", "head_dist.") if distilled else ()))
    foreign = sorted(n for n in converted if not n.startswith(shared))
    require_source(not foreign, source, f"tensors trident's ViT has no place for ({', '.join(foreign[:3])})")
    require_source(state["blocks.0.attn.qkv.weight"].shape == (3 * d_model, d_model), source,
                   "attention of another width than the model (attn_head_dim)")
    layer_scale = "blocks.0.ls1.gamma" in state
    heads, notes = _heads(int(d_model), config, n_heads, source)
    properties = {READOUT: "cls", IMAGE_SIZE: side * int(patch_size), PATCH_SIZE: int(patch_size), CHANNELS: int(in_channels)}
    if "head.weight" in state:
        properties[CLASSES] = int(state["head.weight"].shape[0])
    return OutsideNetwork(
        source=source,
        format=FORMAT,
        network=NETWORK,
        model={
            "d_model": int(d_model),
            "n_heads": heads,
            "n_layers": n_layers,
            "d_ff": int(state["blocks.0.mlp.fc1.weight"].shape[0]),
            "activation": "gelu",
            "norm": "layernorm",
            "norm_first": True,
            "bias": "blocks.0.attn.qkv.bias" in state,
            "norm_eps": TIMM_NORM_EPS,
            "embedding_norm": False,
            # Only whether the scale exists matters: its loaded values replace the initial ones.
            "layer_scale_init": 1e-5 if layer_scale else None,
            "distillation_token": distilled,
        },
        pos_encoding="learned",
        properties=properties,
        state_dict=converted,
        tokenizer=None,
        notes=notes,
    )


def resample_position_table(table: Tensor, grid: tuple[int, int], num_prefix_tokens: int) -> Tensor:
    """A square grid's learned position table (prefix + side*side, D) for another grid (prefix + h*w, D),
    as timm resamples it when a ViT is loaded at another image size: bicubic and antialiased, the
    prefix (class token) rows kept as they are."""
    from timm.layers import resample_abs_pos_embed

    return resample_abs_pos_embed(table[None], new_size=list(grid), num_prefix_tokens=num_prefix_tokens)[0]
