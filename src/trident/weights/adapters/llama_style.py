"""What Llama, Mistral, Qwen2 and Qwen3 share, both ways: a pre-norm decoder with RMSNorm, SwiGLU and
rope, laid out as ``model.layers.<i>.self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``,
``input_layernorm``, ``post_attention_layernorm``, ``model.norm`` and ``lm_head``. A family
(:class:`Family`) says which of the optional parts (attention biases, QK-norm, a sliding window) its
config states and how.

trident's fused ``qkv_proj`` rows are ``[q; k; v]`` and its SwiGLU ``fc_in`` rows ``[gate; up]``
(silu(gate) * up); its rope rotates the two halves of each head (``rotate_half``), as transformers does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from tokenizers import Tokenizer
from torch import Tensor

from trident.backbone import TransformerConfig
from trident.data.tokenization import END_OF_TEXT, UNK
from trident.models import CausalLM
from trident.weights.adapters.common import require_equivalent, require_source, strip_prefix
from trident.weights.pretrained import PretrainedWeights

# Tokenizer attribute -> token in trident's own vocabularies; a tokenizer read with the weights brings its own
# (tokenizer_config.json, carried in PretrainedWeights.tokenizer_settings).
SPECIAL_TOKENS = {"bos_token": END_OF_TEXT, "eos_token": END_OF_TEXT, "unk_token": UNK}
# transformers' rope types that trident's rope option ``scaling`` has (its keys are rope_parameters' verbatim).
ROPE_SCALINGS = ("linear", "dynamic", "yarn", "llama3")
# trident block tensor <- this family's (without ``model.layers.<i>.``), one-to-one.
_BLOCK = {"self_attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
          "self_attn.out_proj.weight": "self_attn.o_proj.weight", "ffn.fc_out.weight": "mlp.down_proj.weight"}


@dataclass(frozen=True)
class Family:
    """One of the Llama-style families: its names and which optional parts its config can state."""

    model_type: str  # config.json's "model_type": "llama"
    architecture: str  # the transformers class export writes: "LlamaForCausalLM"
    target: str  # how error lines name it: "Llama (hf export)"
    qk_norm: bool  # q_norm / k_norm over each head (Qwen3), always present
    attention_bias: str  # "config": attention_bias on q, k, v and o (Llama, Qwen3); "qkv": always on q, k, v (Qwen2); "none"
    mlp_bias: bool  # config.mlp_bias can be true (Llama)
    window: str  # "none", "all" (Mistral's sliding_window on every layer), "layers" (Qwen's use_sliding_window)


def switches(cfg: TransformerConfig) -> dict[str, Any]:
    """The grouped-query, head width, QK-norm, bias and window settings of ``cfg``, resolved (a bias left
    null follows ``model.bias``); the backbone fields absent from an older trident read as their defaults."""
    bias = cfg.bias
    resolved = {name: getattr(cfg, name, None) for name in ("qkv_bias", "attn_out_bias", "mlp_bias")}
    return {
        "n_kv_heads": getattr(cfg, "n_kv_heads", None) or cfg.n_heads,
        "head_dim": cfg.head_dim,
        "qk_norm": bool(getattr(cfg, "qk_norm", False)),
        "attention_window": getattr(cfg, "attention_window", None),
        **{name: bias if value is None else bool(value) for name, value in resolved.items()},
    }


def family_name(cfg: TransformerConfig) -> str:
    """The family a rope decoder is exported as: QK-norm is Qwen3's, biases on q/k/v alone Qwen2's, a
    window Mistral's; anything else Llama (whose export then names what it lacks)."""
    own = switches(cfg)
    if own["qk_norm"]:
        return "qwen3"
    if own["qkv_bias"] and not own["attn_out_bias"]:
        return "qwen2"
    return "mistral" if own["attention_window"] is not None else "llama"


def rope_options(config: dict[str, Any], source: str) -> dict[str, Any]:
    """``pos_encoding.options`` of a config: transformers 5's ``rope_parameters``, or the older files'
    ``rope_theta`` + ``rope_scaling`` (whose type is ``rope_type``, or ``type`` in the oldest)."""
    parameters = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    kind = parameters.pop("rope_type", None) or parameters.pop("type", None) or "default"
    parameters.pop("type", None)
    options: dict[str, Any] = {"base": float(parameters.pop("rope_theta", config.get("rope_theta", 10000.0)))}
    if kind == "default":
        return options
    require_source(kind in ROPE_SCALINGS, source, f"rope scaling {kind!r} (trident has {', '.join(ROPE_SCALINGS)})")
    return options | {"scaling": {"type": kind, **parameters}}


def _window(family: Family, config: dict[str, Any], n_layers: int, source: str) -> int | None:
    """The one sliding window of every layer, None for none; layers of both kinds are one line."""
    if family.window == "none" or not config.get("sliding_window"):
        return None
    if family.window == "layers":
        first = int(config.get("max_window_layers", 0)) if config.get("use_sliding_window") else n_layers
        kinds = config.get("layer_types") or ["full_attention" if i < first else "sliding_attention" for i in range(n_layers)]
        sliding = [kind == "sliding_attention" for kind in kinds]
        require_source(all(sliding) or not any(sliding), source,
                       f"a sliding window in {sum(sliding)} of {n_layers} layers (use_sliding_window, max_window_layers, "
                       "layer_types; trident's model.attention_window is every layer's)")
        if not any(sliding):
            return None
    window = int(config["sliding_window"])
    # A window as long as the context changes nothing (Mistral's 4096 in a shorter model).
    return window if window < int(config["max_position_embeddings"]) else None


def model_settings(family: Family, config: dict[str, Any], source: str) -> dict[str, Any]:
    """The ``model`` values of a config; the backbone switches only where they differ from their default."""
    require_source(config.get("hidden_act", "silu") == "silu", source,
                   f"activation {config.get('hidden_act')!r} (the family's SwiGLU gate is silu; trident's swiglu)")
    d_model, n_heads, n_layers = int(config["hidden_size"]), int(config["num_attention_heads"]), int(config["num_hidden_layers"])
    settings: dict[str, Any] = {
        "d_model": d_model, "n_heads": n_heads, "n_layers": n_layers, "d_ff": int(config["intermediate_size"]),
        "activation": "swiglu", "norm": "rmsnorm", "norm_first": True, "bias": False,
        "norm_eps": float(config.get("rms_norm_eps", 1e-6)), "embedding_norm": False,
    }
    n_kv_heads = int(config.get("num_key_value_heads") or n_heads)
    head_dim = int(config.get("head_dim") or d_model // n_heads)
    attention_bias = family.attention_bias == "config" and bool(config.get("attention_bias", False))
    switched = {
        "n_kv_heads": (n_kv_heads, n_heads), "head_dim": (head_dim, d_model // n_heads), "qk_norm": (family.qk_norm, False),
        "qkv_bias": (attention_bias or family.attention_bias == "qkv", False), "attn_out_bias": (attention_bias, False),
        "mlp_bias": (family.mlp_bias and bool(config.get("mlp_bias", False)), False),
        "attention_window": (_window(family, config, n_layers, source), None),
    }
    biases = {switched[name][0] for name in ("qkv_bias", "attn_out_bias", "mlp_bias")}
    if len(biases) == 1:  # biases on every projection or on none: model.bias says it alone
        settings["bias"] = biases.pop()
        switched = {name: value for name, value in switched.items() if name not in ("qkv_bias", "attn_out_bias", "mlp_bias")}
    return settings | {name: value for name, (value, default) in switched.items() if value != default}


def to_trident(family: Family, config: dict[str, Any], state: dict[str, Tensor], tokenizer: Tokenizer | None,
               source: str) -> PretrainedWeights:
    model = model_settings(family, config, source)
    own = {name: bool(model.get(name, model["bias"])) for name in ("qkv_bias", "attn_out_bias", "mlp_bias")}
    own["qk_norm"] = bool(model.get("qk_norm", False))
    tied = bool(config.get("tie_word_embeddings", False))
    backbone = strip_prefix(state, "model.")
    out = {"embed.weight": backbone["embed_tokens.weight"], "decoder.final_norm.weight": backbone["norm.weight"]}
    for i in range(model["n_layers"]):
        hf, trident = f"layers.{i}", f"decoder.blocks.{i}"
        out |= {f"{trident}.{name}": backbone[f"{hf}.{theirs}"] for name, theirs in _BLOCK.items()}
        out[f"{trident}.self_attn.qkv_proj.weight"] = torch.cat([backbone[f"{hf}.self_attn.{p}_proj.weight"] for p in "qkv"])
        out[f"{trident}.ffn.fc_in.weight"] = torch.cat([backbone[f"{hf}.mlp.{p}_proj.weight"] for p in ("gate", "up")])
        if own["qkv_bias"]:
            out[f"{trident}.self_attn.qkv_proj.bias"] = torch.cat([backbone[f"{hf}.self_attn.{p}_proj.bias"] for p in "qkv"])
        if own["attn_out_bias"]:
            out[f"{trident}.self_attn.out_proj.bias"] = backbone[f"{hf}.self_attn.o_proj.bias"]
        if own["mlp_bias"]:
            out[f"{trident}.ffn.fc_in.bias"] = torch.cat([backbone[f"{hf}.mlp.{p}_proj.bias"] for p in ("gate", "up")])
            out[f"{trident}.ffn.fc_out.bias"] = backbone[f"{hf}.mlp.down_proj.bias"]
        if own["qk_norm"]:
            for part in ("q_norm", "k_norm"):
                out[f"{trident}.self_attn.{part}.weight"] = backbone[f"{hf}.self_attn.{part}.weight"]
    head = state.get("lm_head.weight")
    out["head.weight"] = out["embed.weight"] if tied or head is None else head
    return PretrainedWeights(
        source=source, format=f"hf-{family.model_type}", task="lm", model=model, pos_encoding="rope",
        pos_encoding_options=rope_options(config, source),
        task_options={"tie_embeddings": tied, "scale_embeddings": False},
        data_options={"max_seq_len": int(config["max_position_embeddings"])},
        state_dict=out, tokenizer=tokenizer, vocab_size=int(config["vocab_size"]),
    )


def writes(family: Family, net: CausalLM) -> bool:
    """Whether the hf export writes ``net`` as ``family``: a rope decoder of that family (:func:`family_name`)."""
    return net.cfg.pos_encoding == "rope" and family_name(net.cfg) == family.model_type


def _require_family(family: Family, cfg: TransformerConfig, own: dict[str, Any], net: CausalLM) -> None:
    """One line for each setting the family's config cannot state."""
    target = family.target
    require_equivalent(cfg.pos_encoding == "rope", "pos_encoding", cfg.pos_encoding, target, "it has rope positions only")
    require_equivalent(cfg.norm == "rmsnorm", "model.norm", cfg.norm, target, "it uses RMSNorm")
    require_equivalent(cfg.activation == "swiglu", "model.activation", cfg.activation, target, "its MLP is SwiGLU")
    require_equivalent(cfg.norm_first, "model.norm_first", cfg.norm_first, target, "it is pre-norm")
    require_equivalent(not cfg.embedding_norm, "model.embedding_norm", cfg.embedding_norm, target,
                       "it does not normalise its embeddings")
    require_equivalent(cfg.layer_scale_init is None, "model.layer_scale_init", cfg.layer_scale_init, target, "it has no layer scale")
    require_equivalent(net.embed.scale == 1.0, "task.scale_embeddings", True, target, "it does not scale its embeddings")
    require_equivalent(own["qk_norm"] == family.qk_norm, "model.qk_norm", own["qk_norm"], target,
                       "it has QK-norm in every layer" if family.qk_norm else "it has no QK-norm (Qwen3 has)")
    biases = {"config": own["qkv_bias"], "qkv": True, "none": False}[family.attention_bias]
    require_equivalent(own["qkv_bias"] == biases, "model.qkv_bias", own["qkv_bias"], target,
                       "its q/k/v projections have biases" if biases else "its q/k/v projections have no biases")
    out_bias = own["qkv_bias"] if family.attention_bias == "config" else False
    require_equivalent(own["attn_out_bias"] == out_bias, "model.attn_out_bias", own["attn_out_bias"], target,
                       "its attention_bias puts a bias on q, k, v and o alike" if family.attention_bias == "config"
                       else "its o_proj has no bias")
    require_equivalent(family.mlp_bias or not own["mlp_bias"], "model.mlp_bias", True, target, "its MLP has no biases")
    require_equivalent(family.window != "none" or own["attention_window"] is None, "model.attention_window",
                       own["attention_window"], target, "it has no sliding window (Mistral, Qwen2 and Qwen3 have)")


def rope_parameters(options: dict[str, Any]) -> dict[str, Any]:
    """transformers 5's ``rope_parameters`` of trident's rope options."""
    scaling = dict(options.get("scaling") or {})
    return {"rope_theta": float(options.get("base", 10000.0)), "rope_type": scaling.pop("type", "default"), **scaling}


def from_trident(family: Family, net: CausalLM) -> tuple[str, dict[str, Any], dict[str, Tensor]]:
    """The architecture name, config arguments and state dict (the family's names) of ``net``."""
    cfg, own = net.cfg, switches(net.cfg)
    _require_family(family, cfg, own, net)
    config: dict[str, Any] = {
        "vocab_size": net.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads, "num_key_value_heads": own["n_kv_heads"],
        "head_dim": own["head_dim"],
        "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": net.head.weight is net.embed.weight, "attention_dropout": cfg.attn_dropout,
        "rope_parameters": rope_parameters(cfg.pos_encoding_options),
    }
    if family.attention_bias == "config":
        config["attention_bias"] = own["qkv_bias"]
    if family.mlp_bias:
        config["mlp_bias"] = own["mlp_bias"]
    if family.window == "all":
        config["sliding_window"] = own["attention_window"]
    elif family.window == "layers":
        sliding = own["attention_window"] is not None
        config |= {"use_sliding_window": sliding, "sliding_window": own["attention_window"], "max_window_layers": 0,
                   "layer_types": ["sliding_attention" if sliding else "full_attention"] * cfg.n_layers}
    return family.architecture, config, _state_to_hf(net, own)


def _state_to_hf(net: CausalLM, own: dict[str, Any]) -> dict[str, Tensor]:
    state, cfg = net.state_dict(), net.cfg
    q_rows, kv_rows = cfg.n_heads * own["head_dim"], own["n_kv_heads"] * own["head_dim"]
    out = {"model.embed_tokens.weight": state["embed.weight"], "model.norm.weight": state["decoder.final_norm.weight"],
           "lm_head.weight": state["head.weight"]}
    for i in range(cfg.n_layers):
        hf, trident = f"model.layers.{i}", f"decoder.blocks.{i}"
        out |= {f"{hf}.{theirs}": state[f"{trident}.{name}"] for name, theirs in _BLOCK.items()}
        kinds = ["weight"] + (["bias"] if own["qkv_bias"] else [])
        for kind in kinds:
            # (q_rows + 2 * kv_rows, ...) -> q (q_rows, ...), k and v (kv_rows, ...)
            parts = state[f"{trident}.self_attn.qkv_proj.{kind}"].split([q_rows, kv_rows, kv_rows])
            out |= {f"{hf}.self_attn.{p}_proj.{kind}": part.contiguous() for p, part in zip("qkv", parts)}
        for kind in ["weight"] + (["bias"] if own["mlp_bias"] else []):
            gate, up = state[f"{trident}.ffn.fc_in.{kind}"].chunk(2)  # (2 * d_ff, ...) -> (d_ff, ...) each
            out |= {f"{hf}.mlp.gate_proj.{kind}": gate.contiguous(), f"{hf}.mlp.up_proj.{kind}": up.contiguous()}
        if own["attn_out_bias"]:
            out[f"{hf}.self_attn.o_proj.bias"] = state[f"{trident}.self_attn.out_proj.bias"]
        if own["mlp_bias"]:
            out[f"{hf}.mlp.down_proj.bias"] = state[f"{trident}.ffn.fc_out.bias"]
        if own["qk_norm"]:
            out |= {f"{hf}.self_attn.{p}.weight": state[f"{trident}.self_attn.{p}.weight"] for p in ("q_norm", "k_norm")}
    return out
