"""Helpers every adapter shares: refusing what a format cannot express, and splitting a fused
QKV projection into the separate query, key and value of Hugging Face's attention."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from trident.backbone import TransformerConfig
from trident.errors import ConfigError, DataError

# trident's model.activation <-> Hugging Face's hidden_act / activation_function (exact equivalents only).
HF_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu",
                  "quick_gelu": "quick_gelu"}
TRIDENT_TO_HF_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "quick_gelu": "quick_gelu"}


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


def encoder_settings(config: dict[str, Any], *, activation: str, norm_first: bool, embedding_norm: bool) -> dict[str, Any]:
    """The ``model`` values of a BERT-style config (BERT, ViT: ``hidden_size``, ``layer_norm_eps``...)."""
    return hf_model_settings(
        int(config["hidden_size"]),
        int(config["num_attention_heads"]),
        int(config["num_hidden_layers"]),
        int(config["intermediate_size"]),
        activation=activation,
        norm_first=norm_first,
        norm_eps=float(config.get("layer_norm_eps", 1e-12)),
        embedding_norm=embedding_norm,
    )


def hf_model_settings(
    d_model: int, n_heads: int, n_layers: int, d_ff: int, *, activation: str, norm_first: bool, norm_eps: float,
    embedding_norm: bool = False,
) -> dict[str, Any]:
    """The ``model`` values of a Hugging Face model here (GPT-2, BERT, ViT: LayerNorm, biases everywhere)."""
    return {"d_model": d_model, "n_heads": n_heads, "n_layers": n_layers, "d_ff": d_ff, "activation": activation,
            "norm": "layernorm", "norm_first": norm_first, "bias": True, "norm_eps": norm_eps,
            "embedding_norm": embedding_norm}


def require_unshared(cfg: TransformerConfig, target: str) -> None:
    """What every family but ALBERT lacks: cross-layer sharing and a factorised embedding (one line each)."""
    require_equivalent(cfg.share_layers in (False, None), "model.share_layers", cfg.share_layers, target,
                       "each of its layers has weights of its own (train with model.share_layers=false)")
    require_equivalent(cfg.embedding_dim is None, "model.embedding_dim", cfg.embedding_dim, target,
                       "its embedding is as wide as its layers (train with model.embedding_dim=null)")


def require_hf_block(cfg: TransformerConfig, target: str, *, norm_first: bool, embedding_norm: bool,
                     shared: bool = False) -> None:
    """What the Hugging Face models here share (learned positions, LayerNorm, biases, no layer scale),
    with ``norm_first`` and ``embedding_norm`` as ``target`` has them; ``shared``: ``target`` is ALBERT, whose
    layers may share weights and whose embedding is factorised (else :func:`require_unshared`)."""
    if not shared:
        require_unshared(cfg, target)
    require_equivalent(cfg.pos_encoding == "learned", "pos_encoding", cfg.pos_encoding, target,
                       "it has learned positions only (train with pos_encoding=learned)")
    require_equivalent(cfg.norm_first == norm_first, "model.norm_first", cfg.norm_first, target,
                       f"it is {'pre' if norm_first else 'post'}-norm")
    require_equivalent(cfg.norm == "layernorm", "model.norm", cfg.norm, target, "it uses LayerNorm")
    require_equivalent(cfg.bias, "model.bias", cfg.bias, target, "its layers have biases")
    require_equivalent(cfg.n_kv_heads == cfg.n_heads, "model.n_kv_heads", cfg.n_kv_heads, target,
                       "it has a key/value head per query head (train with model.n_kv_heads=null)")
    require_equivalent(cfg.head_dim * cfg.n_heads == cfg.d_model, "model.head_dim", cfg.head_dim, target,
                       "its heads split d_model (train with model.head_dim=null)")
    require_equivalent(not cfg.qk_norm, "model.qk_norm", cfg.qk_norm, target, "it does not normalise queries and keys")
    for name in ("qkv_bias", "attn_out_bias", "mlp_bias"):
        require_equivalent(getattr(cfg, name), f"model.{name}", getattr(cfg, name), target,
                           f"its layers have biases (train with model.{name}=null)")
    require_equivalent(cfg.embedding_norm == embedding_norm, "model.embedding_norm", cfg.embedding_norm, target,
                       "it normalises its embeddings (train with model.embedding_norm=true)" if embedding_norm
                       else "it does not normalise its embeddings")
    require_equivalent(cfg.layer_scale_init is None, "model.layer_scale_init", cfg.layer_scale_init, target,
                       "it has no layer scale")
    require_equivalent(cfg.attention == "softmax", "model.attention", cfg.attention, target, "it computes softmax attention")
