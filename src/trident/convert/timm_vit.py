"""A timm ``VisionTransformer`` state dict <-> trident's ``VisionTransformer`` (task=vit).

timm and trident name the same tensors differently; the layouts match (fused qkv in q, k, v
order with heads contiguous; the class token's position first in the position table). A state
dict does not record the number of heads: timm's ViTs all use 64 channels per head.
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path

import torch
from timm.layers import resample_abs_pos_embed
from torch import Tensor

from trident.convert.common import require_source
from trident.convert.weights import PretrainedWeights
from trident.errors import DataError
from trident.models.vit import VisionTransformer

log = logging.getLogger(__name__)

FORMAT = "timm-vit"
HEAD_DIM = 64  # channels per attention head in every timm ViT (tiny 192/3 ... huge 1280/16)
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
# Outside the blocks: timm name or prefix -> trident's (the rest, e.g. patch_embed, head, cls_token, is shared).
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


def from_timm(state: dict[str, Tensor], source: str) -> PretrainedWeights:
    """A timm ViT state dict in trident's terms; its geometry is read off the tensors' shapes."""
    require_source("pos_embed" in state and "patch_embed.proj.weight" in state, source,
                   "no pos_embed/patch_embed.proj.weight, so not a timm ViT; it holds something")
    require_source("cls_token" in state, source, "no class token (global average pooling with fc_norm)")
    converted = timm_to_trident(state)
    d_model, in_channels, patch_size, _ = state["patch_embed.proj.weight"].shape  # (D, C, p, p)
    n_layers = 1 + max(int(m.group(1)) for name in state if (m := re.match(r"blocks\.(\d+)\.", name)))
    side = math.isqrt(state["pos_embed"].shape[1] - 1)  # (1, 1 + side*side, D)
    foreign = sorted(n for n in converted if not n.startswith(("encoder.", "patch_embed.", "cls_token", "head.")))
    require_source(not foreign, source, f"tensors trident's ViT has no place for ({', '.join(foreign[:3])})")
    layer_scale = "blocks.0.ls1.gamma" in state
    return PretrainedWeights(
        source=source,
        format=FORMAT,
        task="vit",
        model={
            "d_model": int(d_model),
            "n_heads": max(1, int(d_model) // HEAD_DIM),
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
        },
        pos_encoding="learned",
        task_options={"pool": "cls"},
        data_options={"image_size": side * int(patch_size), "patch_size": int(patch_size), "in_channels": int(in_channels)},
        state_dict=converted,
        tokenizer=None,
        num_classes=int(state["head.weight"].shape[0]) if "head.weight" in state else None,
    )


def load_timm_weights(model: VisionTransformer, path: str | Path) -> None:
    """Load a timm checkpoint file (.pth/.bin/.safetensors). A head of another size is skipped
    (fine-tuning on new classes); a position table of another length is resampled."""
    path = Path(path)
    converted = timm_to_trident(read_timm_file(path))
    own = model.state_dict()
    table = _POSITIONS[1]
    if table in converted and table in own and converted[table].shape != own[table].shape:
        side = model.encoder.cfg.grid
        resampled = resample_abs_pos_embed(
            converted[table][None], new_size=list(side or ()), num_prefix_tokens=model.num_prefix_tokens
        )
        converted[table] = resampled[0]
    for name in ("head.weight", "head.bias"):
        if name in converted and converted[name].shape != own[name].shape:
            log.warning("pretrained head %s has shape %s, model needs %s: keeping the new head", name,
                        tuple(converted[name].shape), tuple(own[name].shape))
            del converted[name]
    missing, unexpected = model.load_state_dict(converted, strict=False)
    missing = [m for m in missing if not m.startswith("head.")]
    if missing or unexpected:
        raise DataError(
            f"pretrained weights {str(path)!r} do not fit this model (missing {missing[:3]}, unexpected "
            f"{unexpected[:3]}): match model size, data.patch_size and pos_encoding=learned to the checkpoint"
        )
