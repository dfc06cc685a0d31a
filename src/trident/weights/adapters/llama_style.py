"""What Llama, Mistral, Qwen2 and Qwen3 share, both ways: a pre-norm decoder with RMSNorm, SwiGLU and
rope, laid out as ``model.layers.<i>.self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``,
``input_layernorm``, ``post_attention_layernorm``, ``model.norm`` and ``lm_head``. A family
(:class:`Family`) says which of the optional parts (attention biases, QK-norm, a sliding window in every layer or
in some) its config states and how.

trident's fused ``qkv_proj`` rows are ``[q; k; v]`` and its SwiGLU ``fc_in`` rows ``[gate; up]``
(silu(gate) * up); its rope rotates the two halves of each head (``rotate_half``), as transformers does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from tokenizers import Tokenizer
from torch import Tensor

from trident.backbone import TransformerConfig
from trident.data.tokenization import END_OF_TEXT, UNK
from trident.models import CausalLM
from trident.models.properties import MAX_SEQ_LEN, SCALED_EMBEDDING, TIED_HEAD
from trident.weights.adapters.base import ModelTypeNames
from trident.weights.adapters.common import require_equivalent, require_source, require_unshared, strip_prefix
from trident.weights.adapters.outside_network import OutsideNetwork, require_property

# Tokenizer attribute -> token in trident's own vocabularies; a tokenizer read with the weights brings its own
# (tokenizer_config.json, carried in PretrainedWeights.tokenizer_settings).
SPECIAL_TOKENS = {"bos_token": END_OF_TEXT, "eos_token": END_OF_TEXT, "unk_token": UNK}
# transformers' rope types that trident's rope option ``scaling`` has (its keys are rope_parameters' verbatim).
ROPE_SCALINGS = ("linear", "dynamic", "yarn", "llama3")
# trident block tensor <- this family's (without ``model.layers.<i>.``), one-to-one.
# The defaults of transformers' config classes (LlamaConfig...) every family shares, for the settings the reader takes:
# a config.json that leaves one out reads as transformers reads it. num_key_value_heads and head_dim: null stands for
# the attention heads and hidden_size / num_attention_heads (Family.defaults adds each family's own).
SHARED_DEFAULTS: dict[str, Any] = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                                   "attention_bias": False, "mlp_bias": False, "rope_theta": 10000.0,
                                   "num_key_value_heads": None, "head_dim": None}
_BLOCK = {"self_attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
          "self_attn.out_proj.weight": "self_attn.o_proj.weight", "ffn.fc_out.weight": "mlp.down_proj.weight"}


@dataclass(frozen=True)
class DecoderNames(ModelTypeNames):
    """The names a decoder family's adapter answers to (the Adapter interface of base.py, registered as it is in
    registry.ADAPTERS): those of :class:`Family` and of ``hf_gemma.GemmaFamily``."""

    model_type: str  # config.json's "model_type": "llama"
    architecture: str  # the transformers class export writes: "LlamaForCausalLM"
    target: str  # how error lines name it: "Llama (hf export)"

    NETWORK: ClassVar[type[CausalLM]] = CausalLM
    SPECIAL_TOKENS: ClassVar[dict[str, str]] = SPECIAL_TOKENS
    BASE_MODEL: ClassVar[str] = "Model"  # the headless class's suffix: LlamaModel

    @property
    def ARCHITECTURES(self) -> tuple[str, ...]:
        return self.architecture, self.architecture.replace("ForCausalLM", self.BASE_MODEL)

    @property
    def TARGET(self) -> str:
        return self.target


@dataclass(frozen=True)
class Family(DecoderNames):
    """One of the Llama-style families: its names and which optional parts its config can state."""

    qk_norm: bool  # q_norm / k_norm over each head (Qwen3), always present
    attention_bias: str  # "config": attention_bias on q, k, v and o (Llama, Qwen3); "qkv": always on q, k, v (Qwen2); "none"
    mlp_bias: bool  # config.mlp_bias can be true (Llama)
    window: str  # "none", "all" (Mistral's sliding_window on every layer), "layers" (Qwen's use_sliding_window)
    # transformers' config-class defaults of this family that differ from SHARED_DEFAULTS (max_position_embeddings,
    # Mistral's 8 key/value heads, Qwen's max_window_layers of 28...): what an absent key reads as.
    defaults: dict[str, Any] = field(default_factory=dict, hash=False)

    def to_trident(self, config: dict[str, Any], state: dict[str, Tensor], tokenizer: Tokenizer | None,
                   source: str) -> OutsideNetwork:
        return to_trident(self, SHARED_DEFAULTS | self.defaults | config, state, tokenizer, source)

    def from_trident(self, net: CausalLM) -> tuple[str, dict[str, Any], dict[str, Tensor]]:
        return from_trident(self, net)

    def writes(self, net: CausalLM) -> bool:
        return writes(self, net)


def family_name(cfg: TransformerConfig) -> str:
    """The family a rope decoder that declares none (model.family null) is exported as: norms after the sub-layers are
    Gemma's (with QK-norm Gemma 3's), QK-norm is Qwen3's, biases on q/k/v alone Qwen2's, a window Mistral's; anything
    else Llama (whose export then names what it lacks)."""
    if cfg.sandwich_norm:
        return "gemma3" if cfg.qk_norm else "gemma2"
    if cfg.qk_norm:
        return "qwen3"
    if cfg.qkv_bias and not cfg.attn_out_bias:
        return "qwen2"
    return "mistral" if any(layer.attention_window is not None for layer in cfg.layer_settings) else "llama"


def rope_options(config: dict[str, Any], source: str) -> dict[str, Any]:
    """``pos_encoding.options`` of a config: transformers 5's ``rope_parameters``, or the older files'
    ``rope_theta`` + ``rope_scaling`` (whose type is ``rope_type``, or ``type`` in the oldest), with the
    lengths transformers fills in (:func:`_transformers_lengths`)."""
    parameters = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    kind = parameters.pop("rope_type", None) or parameters.pop("type", None) or "default"
    parameters.pop("type", None)
    options: dict[str, Any] = {"base": float(parameters.pop("rope_theta", config["rope_theta"]))}
    if kind == "default":
        return options
    require_source(kind in ROPE_SCALINGS, source, f"rope scaling {kind!r} (trident has {', '.join(ROPE_SCALINGS)})")
    return options | {"scaling": {"type": kind, **_transformers_lengths(kind, parameters, int(config["max_position_embeddings"]))}}


def _transformers_lengths(kind: str, parameters: dict[str, Any], context: int) -> dict[str, Any]:
    """``parameters`` (a scaling's, without its type) with the original length and factor transformers reads
    (modeling_rope_utils): dynamic grows from ``max_position_embeddings`` (``context``), whatever the dict says;
    yarn and llama3 default their original length to it; yarn's null factor is ``context`` / original."""
    if kind == "dynamic":
        return parameters | {"original_max_position_embeddings": context}
    if kind == "linear":
        return parameters
    filled = {"original_max_position_embeddings": context} | parameters
    if kind == "yarn" and filled.get("factor") is None:
        filled["factor"] = context / filled["original_max_position_embeddings"]
    return filled


def context_length(config: dict[str, Any], options: dict[str, Any]) -> int:
    """``data.max_seq_len`` of a config: ``max_position_embeddings``, times the factor of a dynamic scaling, which
    transformers applies past that length (trident's generation feeds at most ``data.max_seq_len`` tokens)."""
    context = int(config["max_position_embeddings"])
    scaling = options.get("scaling") or {}
    return int(context * scaling["factor"]) if scaling.get("type") == "dynamic" else context


def layer_windows(family: Family, config: dict[str, Any], n_layers: int, context: int) -> list[int | None]:
    """Each layer's sliding window, None for none (Qwen's first max_window_layers layers, or its layer_types' full ones)."""
    # Qwen's config reads sliding_window as null without use_sliding_window, whatever layer_types says.
    if family.window == "none" or not config["sliding_window"]:
        return [None] * n_layers
    if family.window == "layers" and not config["use_sliding_window"]:
        return [None] * n_layers
    # A window as long as the context (data.max_seq_len) changes nothing (Mistral's 4096 in a shorter model).
    window = int(config["sliding_window"]) if int(config["sliding_window"]) < context else None
    if family.window == "all":
        return [window] * n_layers
    first = int(config["max_window_layers"])
    kinds = config.get("layer_types") or ["full_attention" if i < first else "sliding_attention" for i in range(n_layers)]
    return [window if kind == "sliding_attention" else None for kind in kinds]


def window_settings(windows: list[int | None]) -> dict[str, Any]:
    """The ``model`` values of each layer's window: one ``attention_window`` where every layer has the same (none where
    that is no window), else ``layers``, a window in the layers that have one."""
    if len(set(windows)) == 1:
        return {} if windows[0] is None else {"attention_window": windows[0]}
    return {"layers": [None if window is None else {"attention_window": window} for window in windows]}


def model_settings(family: Family, config: dict[str, Any], source: str) -> dict[str, Any]:
    """The ``model`` values of a config: every attention-shape setting stated, resolved; the window where there is one."""
    require_source(config["hidden_act"] == "silu", source,
                   f"activation {config['hidden_act']!r} (the family's SwiGLU gate is silu; trident's swiglu)")
    d_model, n_heads, n_layers = int(config["hidden_size"]), int(config["num_attention_heads"]), int(config["num_hidden_layers"])
    settings: dict[str, Any] = {
        "d_model": d_model, "n_heads": n_heads, "n_layers": n_layers, "d_ff": int(config["intermediate_size"]),
        "activation": "swiglu", "norm": "rmsnorm", "norm_first": True,
        "norm_eps": float(config["rms_norm_eps"]), "embedding_norm": False,
    }
    n_kv_heads = int(config.get("num_key_value_heads") or n_heads)
    head_dim = int(config.get("head_dim") or d_model // n_heads)
    attention_bias = family.attention_bias == "config" and bool(config["attention_bias"])
    biases = {"qkv_bias": attention_bias or family.attention_bias == "qkv", "attn_out_bias": attention_bias,
              "mlp_bias": family.mlp_bias and bool(config["mlp_bias"])}
    # Every attention-shape setting stated, resolved (init_from fixes each; an error line names its value). RMSNorm
    # has no bias, so model.bias only says whether every projection has one.
    settings |= {"n_kv_heads": n_kv_heads, "head_dim": head_dim, "qk_norm": family.qk_norm, **biases,
                 "bias": all(biases.values())}
    context = context_length(config, rope_options(config, source))
    return settings | window_settings(layer_windows(family, config, n_layers, context))


def to_trident(family: Family, config: dict[str, Any], state: dict[str, Tensor], tokenizer: Tokenizer | None,
               source: str) -> OutsideNetwork:
    model = model_settings(family, config, source)
    tied = bool(config["tie_word_embeddings"])
    options = rope_options(config, source)
    return OutsideNetwork(
        source=source, format=f"hf-{family.model_type}", network=CausalLM, model=model, pos_encoding="rope",
        pos_encoding_options=options,
        properties={TIED_HEAD: tied, SCALED_EMBEDDING: False, MAX_SEQ_LEN: context_length(config, options)},
        state_dict=state_from_hf(state, model, tied), tokenizer=tokenizer, vocab_size=int(config["vocab_size"]),
    )


def state_from_hf(state: dict[str, Tensor], model: dict[str, Any], tied: bool,
                  block: dict[str, str] = _BLOCK) -> dict[str, Tensor]:
    """A Llama-style state dict in trident's names; ``block``: the one-to-one block tensors (trident <- theirs)."""
    backbone = strip_prefix(state, "model.")
    out = {"embed.weight": backbone["embed_tokens.weight"], "decoder.final_norm.weight": backbone["norm.weight"]}
    for i in range(model["n_layers"]):
        hf, trident = f"layers.{i}", f"decoder.blocks.{i}"
        out |= {f"{trident}.{name}": backbone[f"{hf}.{theirs}"] for name, theirs in block.items()}
        out[f"{trident}.self_attn.qkv_proj.weight"] = torch.cat([backbone[f"{hf}.self_attn.{p}_proj.weight"] for p in "qkv"])
        out[f"{trident}.ffn.fc_in.weight"] = torch.cat([backbone[f"{hf}.mlp.{p}_proj.weight"] for p in ("gate", "up")])
        if model["qkv_bias"]:
            out[f"{trident}.self_attn.qkv_proj.bias"] = torch.cat([backbone[f"{hf}.self_attn.{p}_proj.bias"] for p in "qkv"])
        if model["attn_out_bias"]:
            out[f"{trident}.self_attn.out_proj.bias"] = backbone[f"{hf}.self_attn.o_proj.bias"]
        if model["mlp_bias"]:
            out[f"{trident}.ffn.fc_in.bias"] = torch.cat([backbone[f"{hf}.mlp.{p}_proj.bias"] for p in ("gate", "up")])
            out[f"{trident}.ffn.fc_out.bias"] = backbone[f"{hf}.mlp.down_proj.bias"]
        if model["qk_norm"]:
            for part in ("q_norm", "k_norm"):
                out[f"{trident}.self_attn.{part}.weight"] = backbone[f"{hf}.self_attn.{part}.weight"]
    head = state.get("lm_head.weight")
    out["head.weight"] = out["embed.weight"] if tied or head is None else head
    return out


def writes(family: Family, net: CausalLM) -> bool:
    """Whether the hf export writes ``net`` as ``family``: a rope decoder of that family (:func:`family_name`)."""
    return net.cfg.pos_encoding == "rope" and family_name(net.cfg) == family.model_type


def _require_family(family: Family, cfg: TransformerConfig, net: CausalLM) -> None:
    """One line for each setting the family's config cannot state."""
    target = family.target
    require_unshared(cfg, target)
    require_equivalent(cfg.pos_encoding == "rope", "pos_encoding", cfg.pos_encoding, target, "it has rope positions only")
    require_equivalent(cfg.norm == "rmsnorm", "model.norm", cfg.norm, target, "it uses RMSNorm")
    require_equivalent(cfg.activation == "swiglu", "model.activation", cfg.activation, target, "its MLP is SwiGLU")
    require_equivalent(cfg.norm_first, "model.norm_first", cfg.norm_first, target, "it is pre-norm")
    require_equivalent(not cfg.embedding_norm, "model.embedding_norm", cfg.embedding_norm, target,
                       "it does not normalise its embeddings")
    require_equivalent(cfg.layer_scale_init is None, "model.layer_scale_init", cfg.layer_scale_init, target, "it has no layer scale")
    require_equivalent(cfg.attention == "softmax", "model.attention", cfg.attention, target, "it computes softmax attention")
    require_equivalent(not cfg.memory_length, "model.memory_length", cfg.memory_length, target, "it keeps no memory")
    require_property(net.embed.scale == 1.0, CausalLM, SCALED_EMBEDDING, True, target, "it does not scale its embeddings")
    require_equivalent(cfg.qk_norm == family.qk_norm, "model.qk_norm", cfg.qk_norm, target,
                       "it has QK-norm in every layer" if family.qk_norm else "it has no QK-norm (Qwen3 has)")
    biases = {"config": cfg.qkv_bias, "qkv": True, "none": False}[family.attention_bias]
    require_equivalent(cfg.qkv_bias == biases, "model.qkv_bias", cfg.qkv_bias, target,
                       "its q/k/v projections have biases" if biases else "its q/k/v projections have no biases")
    out_bias = cfg.qkv_bias if family.attention_bias == "config" else False
    require_equivalent(cfg.attn_out_bias == out_bias, "model.attn_out_bias", cfg.attn_out_bias, target,
                       "its attention_bias puts a bias on q, k, v and o alike" if family.attention_bias == "config"
                       else "its o_proj has no bias")
    require_equivalent(family.mlp_bias or not cfg.mlp_bias, "model.mlp_bias", True, target, "its MLP has no biases")
    windows = [layer.attention_window for layer in cfg.layer_settings]
    require_equivalent(family.window != "none" or windows == [None] * cfg.n_layers, "model.attention_window",
                       cfg.attention_window, target, "it has no sliding window (Mistral, Qwen2 and Qwen3 have)")
    require_same_layers(cfg, target, windows=family.window != "all")


def require_same_layers(cfg: TransformerConfig, target: str, *, windows: bool, ropes: int = 1) -> None:
    """One line for per-layer settings ``target`` cannot state: rope off or other rope options in some layers (beyond
    ``ropes`` sets of options), windows of several lengths (or, without ``windows``, in some layers only)."""
    layers = cfg.layer_settings
    options = {str(layer.pos_encoding_options) for layer in layers}
    require_equivalent(all(layer.rope for layer in layers) and len(options) <= ropes, "model.layers", cfg.layers, target,
                       "its layers all rotate their queries and keys" + (" with the same rope" if ropes == 1 else
                                                                        f", with at most {ropes} rope settings"))
    sliding = {layer.attention_window for layer in layers} - {None}
    require_equivalent(len(sliding) <= 1 and (windows or len({layer.attention_window for layer in layers}) == 1),
                       "model.layers", cfg.layers, target, "its sliding window is one length" + (
                           "" if windows else ", in every layer (Qwen2, Qwen3 and Gemma have it in some layers only)"))


def rope_parameters(options: dict[str, Any]) -> tuple[dict[str, Any], int | None]:
    """transformers 5's ``rope_parameters`` of trident's rope options, and the ``max_position_embeddings`` a
    dynamic scaling needs (its original length, where transformers' dynamic reads it; None for the others)."""
    scaling = dict(options.get("scaling") or {})
    kind = scaling.pop("type", "default")
    original = scaling.pop("original_max_position_embeddings") if kind == "dynamic" else None
    return {"rope_theta": float(options.get("base", 10000.0)), "rope_type": kind, **scaling}, original


def older_rope_keys(rope: dict[str, Any]) -> dict[str, Any]:
    """``rope_parameters`` as transformers 4 reads it, written beside it (4.x ignores ``rope_parameters`` and would
    read theta 10,000 without scaling): ``rope_theta`` and ``rope_scaling`` (null for the default rope). transformers 5
    reads these as the same ``rope_parameters`` (its ``rope_scaling`` wins, with ``rope_theta`` filled in)."""
    scaling = {key: value for key, value in rope.items() if key != "rope_theta"}
    return {"rope_theta": rope["rope_theta"], "rope_scaling": None if rope["rope_type"] == "default" else scaling}


def from_trident(family: Family, net: CausalLM) -> tuple[str, dict[str, Any], dict[str, Tensor]]:
    """The architecture name, config arguments and state dict (the family's names) of ``net``."""
    cfg = net.cfg
    _require_family(family, cfg, net)
    rope, dynamic_start = rope_parameters(cfg.pos_encoding_options)
    config: dict[str, Any] = {
        "vocab_size": net.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu", "max_position_embeddings": dynamic_start or cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": net.head.weight is net.embed.weight,
        "attention_dropout": cfg.attn_dropout, "rope_parameters": rope, **older_rope_keys(rope),
    }
    if family.attention_bias == "config":
        config["attention_bias"] = cfg.qkv_bias
    if family.mlp_bias:
        config["mlp_bias"] = cfg.mlp_bias
    if family.window == "all":
        config["sliding_window"] = cfg.attention_window
    elif family.window == "layers":
        config |= qwen_windows([layer.attention_window for layer in cfg.layer_settings])
    return family.architecture, config, state_to_hf(net)


def qwen_windows(windows: list[int | None]) -> dict[str, Any]:
    """Qwen's window settings of each layer's window: layer_types, and max_window_layers the full layers before the
    first sliding one where only those are full (0 where none slides, as transformers reads it with layer_types)."""
    sliding = [window is not None for window in windows]
    leading = sliding.index(True) if any(sliding) else 0
    window = next((window for window in windows if window is not None), None)
    return {"use_sliding_window": any(sliding), "sliding_window": window,
            "max_window_layers": leading if all(sliding[leading:]) else 0,
            "layer_types": ["sliding_attention" if slides else "full_attention" for slides in sliding]}


def state_to_hf(net: CausalLM, block: dict[str, str] = _BLOCK) -> dict[str, Tensor]:
    """The inverse of :func:`state_from_hf`."""
    state, cfg = net.state_dict(), net.cfg
    q_rows, kv_rows = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    out = {"model.embed_tokens.weight": state["embed.weight"], "model.norm.weight": state["decoder.final_norm.weight"],
           "lm_head.weight": state["head.weight"]}
    for i in range(cfg.n_layers):
        hf, trident = f"model.layers.{i}", f"decoder.blocks.{i}"
        out |= {f"{hf}.{theirs}": state[f"{trident}.{name}"] for name, theirs in block.items()}
        kinds = ["weight"] + (["bias"] if cfg.qkv_bias else [])
        for kind in kinds:
            # (q_rows + 2 * kv_rows, ...) -> q (q_rows, ...), k and v (kv_rows, ...)
            parts = state[f"{trident}.self_attn.qkv_proj.{kind}"].split([q_rows, kv_rows, kv_rows])
            out |= {f"{hf}.self_attn.{p}_proj.{kind}": part.contiguous() for p, part in zip("qkv", parts)}
        for kind in ["weight"] + (["bias"] if cfg.mlp_bias else []):
            gate, up = state[f"{trident}.ffn.fc_in.{kind}"].chunk(2)  # (2 * d_ff, ...) -> (d_ff, ...) each
            out |= {f"{hf}.mlp.gate_proj.{kind}": gate.contiguous(), f"{hf}.mlp.up_proj.{kind}": up.contiguous()}
        if cfg.attn_out_bias:
            out[f"{hf}.self_attn.o_proj.bias"] = state[f"{trident}.self_attn.out_proj.bias"]
        if cfg.mlp_bias:
            out[f"{hf}.mlp.down_proj.bias"] = state[f"{trident}.ffn.fc_out.bias"]
        if cfg.qk_norm:
            out |= {f"{hf}.self_attn.{p}.weight": state[f"{trident}.self_attn.{p}.weight"] for p in ("q_norm", "k_norm")}
    return out
