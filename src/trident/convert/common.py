"""Helpers every adapter shares: refusing what a format cannot express, and splitting a fused
QKV projection into the separate query, key and value of Hugging Face's attention."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from trident.errors import ConfigError, DataError

# trident's model.activation <-> Hugging Face's hidden_act / activation_function (exact equivalents only).
HF_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}
TRIDENT_TO_HF_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}


def require_equivalent(ok: bool, setting: str, value: Any, target: str, fix: str) -> None:
    """One error line when a trident setting has no counterpart in ``target`` (an export format)."""
    if not ok:
        raise ConfigError(f"{setting}={value} has no {target} equivalent: {fix}")


def require_source(ok: bool, source: str, what: str) -> None:
    """One error line when a source model uses something trident cannot reproduce exactly."""
    if not ok:
        raise DataError(f"{source}: {what}, which trident cannot reproduce exactly")


def activation_from_hf(name: str, source: str) -> str:
    require_source(name in HF_ACTIVATIONS, source, f"activation {name!r} (trident has {', '.join(HF_ACTIVATIONS)})")
    return HF_ACTIVATIONS[name]


def activation_to_hf(name: str, target: str) -> str:
    require_equivalent(
        name in TRIDENT_TO_HF_ACTIVATIONS, "model.activation", name, target,
        f"export a model trained with one of {', '.join(TRIDENT_TO_HF_ACTIVATIONS)}",
    )
    return TRIDENT_TO_HF_ACTIVATIONS[name]


def fuse_qkv(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Separate projections -> trident's fused one (q, k, v stacked along the output dimension)."""
    return torch.cat((q, k, v), dim=0)  # (3D, D) or, for biases, (3D,)


def split_qkv(qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    q, k, v = qkv.chunk(3, dim=0)  # (D, D) or (D,) each
    return q, k, v


def strip_prefix(state: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """A headed model's backbone keys (``transformer.h.0...``) as the bare model names them."""
    return {name.removeprefix(prefix): tensor for name, tensor in state.items()}


def layer_from_hf(state: dict[str, Tensor], hf: str, trident: str, table: dict[str, str], qkv: str) -> dict[str, Tensor]:
    """One layer of a Hugging Face encoder with separate ``{qkv}.query/key/value`` projections (BERT,
    ViT) in trident's names: ``table`` maps the other tensors' suffixes (``hf`` and ``trident`` prefixes)."""
    out = {f"{trident}.{target}": state[f"{hf}.{name}"] for name, target in table.items()}
    for kind in ("weight", "bias"):
        parts = (state[f"{hf}.{qkv}.{role}.{kind}"] for role in ("query", "key", "value"))
        out[f"{trident}.self_attn.qkv_proj.{kind}"] = fuse_qkv(*parts)
    return out


def layer_to_hf(state: dict[str, Tensor], trident: str, hf: str, table: dict[str, str], qkv: str) -> dict[str, Tensor]:
    """The inverse of :func:`layer_from_hf`."""
    out = {f"{hf}.{name}": state[f"{trident}.{target}"] for name, target in table.items()}
    for kind in ("weight", "bias"):
        for role, part in zip(("query", "key", "value"), split_qkv(state[f"{trident}.self_attn.qkv_proj.{kind}"])):
            out[f"{hf}.{qkv}.{role}.{kind}"] = part.contiguous()
    return out


def square_size(value: Any, name: str, source: str) -> int:
    """An image or patch size that Hugging Face may write as an int or a [height, width] pair."""
    if isinstance(value, list | tuple):
        require_source(len(value) == 2 and value[0] == value[1], source, f"a non-square {name} {value}")
        value = value[0]
    return int(value)
