"""A timm ``VisionTransformer`` state dict <-> trident's ``VisionTransformer`` (task=vit).

timm and trident name the same tensors differently; the layouts match (fused qkv in q, k, v
order with heads contiguous; the class token's position first in the position table).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
from timm.layers import resample_abs_pos_embed
from torch import Tensor

from trident.errors import DataError
from trident.models.vit import VisionTransformer

log = logging.getLogger(__name__)

_RENAMES = [
    (r"^blocks\.(\d+)\.norm1\.", r"encoder.blocks.\1.self_attn_norm."),
    (r"^blocks\.(\d+)\.attn\.qkv\.", r"encoder.blocks.\1.self_attn.qkv_proj."),
    (r"^blocks\.(\d+)\.attn\.proj\.", r"encoder.blocks.\1.self_attn.out_proj."),
    (r"^blocks\.(\d+)\.ls1\.", r"encoder.blocks.\1.self_attn_scale."),
    (r"^blocks\.(\d+)\.norm2\.", r"encoder.blocks.\1.ffn_norm."),
    (r"^blocks\.(\d+)\.mlp\.fc1\.", r"encoder.blocks.\1.ffn.fc_in."),
    (r"^blocks\.(\d+)\.mlp\.fc2\.", r"encoder.blocks.\1.ffn.fc_out."),
    (r"^blocks\.(\d+)\.ls2\.", r"encoder.blocks.\1.ffn_scale."),
    (r"^norm\.", "encoder.final_norm."),
]


def timm_to_trident(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """Rename a timm ViT state dict to trident's names (pos_embed (1, T, D) -> table (T, D))."""
    out: dict[str, Tensor] = {}
    for name, tensor in state_dict.items():
        if name == "pos_embed":
            out["encoder.pos_encoding.embedding.weight"] = tensor[0]
            continue
        for pattern, replacement in _RENAMES:
            name = re.sub(pattern, replacement, name)
        out[name] = tensor
    return out


def load_timm_weights(model: VisionTransformer, path: str | Path) -> None:
    """Load a timm checkpoint file (.pth/.bin/.safetensors). A head of another size is skipped
    (fine-tuning on new classes); a position table of another length is resampled."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"pretrained weights {str(path)!r} not found: set model.pretrained to a timm ViT state-dict file")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise DataError(f"cannot read pretrained weights {str(path)!r} ({type(err).__name__}): not a state-dict file") from err
    state = state.get("state_dict", state.get("model", state))
    converted = timm_to_trident(state)
    own = model.state_dict()
    table = "encoder.pos_encoding.embedding.weight"
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
