"""Gemma 2 (``Gemma2ForCausalLM``) and Gemma 3's text model (``Gemma3ForCausalLM``, model_type ``gemma3_text``) <->
trident's ``CausalLM`` (task=lm), laid out as ``llama_style.py`` with two more norms per layer.

What sets them apart, each a backbone setting: Gemma's RMSNorm with gain 1 + weight (model.norm=rmsnorm_offset), a norm
after attention and after the MLP as well as before them (model.sandwich_norm; transformers' post_attention_layernorm is
the norm *after* attention here, not Llama's pre-MLP norm), GeGLU with tanh GELU (model.activation=geglu_tanh),
embeddings scaled by sqrt(hidden_size) and tied to the head (task.scale_embeddings), scores scaled by
1/sqrt(query_pre_attn_scalar) (model.attn_scale_dim), sliding-window and global layers as layer_types says
(model.layers), Gemma 2's soft-capping of the attention scores and of the logits (model.attn_softcap,
model.final_logit_softcap), Gemma 3's QK-norm and its two ropes (the global layers' rope_parameters are the stack's
pos_encoding.options, the sliding layers' their model.layers pos_encoding_options). transformers 5's Gemma 3 attention
does not apply attn_logit_softcapping: it is read as none, and a capped stack is not written as a Gemma 3.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenizers import Tokenizer
from torch import Tensor

from trident.backbone import TransformerConfig
from trident.models import CausalLM
from trident.models.properties import MAX_SEQ_LEN, SCALED_EMBEDDING, TIED_HEAD
from trident.weights.adapters.common import require_equivalent, require_source, require_unshared
from trident.weights.adapters.llama_style import (
    DecoderNames,
    context_length,
    family_name,
    older_rope_keys,
    require_same_layers,
    rope_options,
    rope_parameters,
    state_from_hf,
    state_to_hf,
    window_settings,
)
from trident.weights.adapters.outside_network import OutsideNetwork, require_property

# trident block tensor <- Gemma's (without ``model.layers.<i>.``), one-to-one.
_BLOCK = {"self_attn_norm.weight": "input_layernorm.weight", "self_attn_post_norm.weight": "post_attention_layernorm.weight",
          "ffn_norm.weight": "pre_feedforward_layernorm.weight", "ffn_post_norm.weight": "post_feedforward_layernorm.weight",
          "self_attn.out_proj.weight": "self_attn.o_proj.weight", "ffn.fc_out.weight": "mlp.down_proj.weight"}
SLIDING, FULL = "sliding_attention", "full_attention"
# The defaults of transformers' config classes both share, for the settings the reader takes (GemmaFamily.defaults adds each's).
SHARED_DEFAULTS: dict[str, Any] = {"hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
                                   "attention_bias": False, "query_pre_attn_scalar": 256, "sliding_window": 4096,
                                   "num_key_value_heads": 4, "head_dim": 256, "use_bidirectional_attention": None}


@dataclass(frozen=True)
class GemmaFamily(DecoderNames):
    """Gemma 2 or Gemma 3's text model: their names and what sets one apart from the other."""

    family: str  # model.family: "gemma2", "gemma3" (Gemma 3's model_type is "gemma3_text")
    qk_norm: bool  # Gemma 3's q_norm / k_norm
    softcap: bool  # whether the attention applies attn_logit_softcapping (Gemma 2's does)
    two_ropes: bool  # rope_parameters per layer type (Gemma 3)
    sliding_every: int  # the layer_types a config without them has: every n-th layer global, the others sliding
    defaults: dict[str, Any] = field(default_factory=dict, hash=False)

    @property
    def FAMILY(self) -> str:
        return self.family

    @property
    def ARCHITECTURES(self) -> tuple[str, ...]:
        return self.architecture, self.architecture.replace("ForCausalLM", "TextModel" if self.two_ropes else "Model")

    def to_trident(self, config: dict[str, Any], state: dict[str, Tensor], tokenizer: Tokenizer | None,
                   source: str) -> OutsideNetwork:
        """``config.json`` (over transformers' defaults), the state dict and the tokenizer in trident's terms."""
        config = SHARED_DEFAULTS | self.defaults | config
        model, options = model_settings(self, config, source)
        tied = bool(config["tie_word_embeddings"])
        return OutsideNetwork(
            source=source, format=self.FORMAT, network=CausalLM, model=model, pos_encoding="rope",
            pos_encoding_options=options,
            properties={TIED_HEAD: tied, SCALED_EMBEDDING: True, MAX_SEQ_LEN: context_length(config, options)},
            state_dict=state_from_hf(state, model, tied, _BLOCK), tokenizer=tokenizer, vocab_size=int(config["vocab_size"]),
        )

    def from_trident(self, net: CausalLM) -> tuple[str, dict[str, Any], dict[str, Tensor]]:
        """The architecture name, config arguments and state dict (Gemma's names) of ``net``."""
        cfg = net.cfg
        _require_family(self, cfg, net)
        kinds, ropes = _layer_ropes(self, cfg)
        window = next((layer.attention_window for layer in cfg.layer_settings if layer.attention_window is not None), None)
        _, dynamic_start = rope_parameters(cfg.pos_encoding_options)
        context = dynamic_start or cfg.max_seq_len
        config: dict[str, Any] = {
            "vocab_size": net.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff,
            "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
            "head_dim": cfg.head_dim, "hidden_activation": "gelu_pytorch_tanh",
            "max_position_embeddings": context, "rms_norm_eps": cfg.norm_eps,
            "tie_word_embeddings": net.head.weight is net.embed.weight, "attention_bias": cfg.qkv_bias,
            "attention_dropout": cfg.attn_dropout, "query_pre_attn_scalar": _number(cfg.attn_scale_dim or cfg.head_dim),
            # transformers' Gemma builds a sliding mask whatever layer_types says: with no sliding layer, one as long as the
            # context (which reads back as none).
            "sliding_window": context if window is None else window, "layer_types": kinds, "final_logit_softcapping": cfg.final_logit_softcap,
            "attn_logit_softcapping": cfg.attn_softcap,
        }
        if self.two_ropes:
            full, local = ropes[FULL], ropes[SLIDING]
            # transformers 4 reads rope_theta, rope_scaling (the global layers') and rope_local_base_freq instead.
            config |= {"rope_parameters": {FULL: full, SLIDING: local}, **older_rope_keys(full),
                       "rope_local_base_freq": local["rope_theta"], **sliding_window_pattern(kinds)}
        else:
            config |= {"rope_parameters": ropes[FULL], **older_rope_keys(ropes[FULL])}
        return self.architecture, config, state_to_hf(net, _BLOCK)

    def writes(self, net: CausalLM) -> bool:
        """A rope decoder that declares no family, with Gemma's norms (``family_name``)."""
        return net.cfg.pos_encoding == "rope" and family_name(net.cfg) == self.family


def _ropes(family: GemmaFamily, config: dict[str, Any], source: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The rope options of the global layers and of the sliding ones: Gemma 3's rope_parameters per layer type (or the
    older files' rope_theta, rope_scaling and rope_local_base_freq), Gemma 2's one rope for both."""
    if not family.two_ropes:
        options = rope_options(config, source)
        return options, options
    parameters = config.get("rope_parameters") or {}
    if FULL in parameters:
        full, local = parameters[FULL], parameters[SLIDING]
    else:
        full = {"rope_theta": config.get("rope_theta", 1_000_000.0), **(config.get("rope_scaling") or {})}
        local = {"rope_theta": config.get("rope_local_base_freq", 10_000.0)}
    full_options, local_options = (rope_options({**config, "rope_parameters": part, "rope_theta": part["rope_theta"]}, source)
                                   for part in (full, local))
    return full_options, local_options


def model_settings(family: GemmaFamily, config: dict[str, Any], source: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``model`` values of a config and the stack's rope options (the global layers')."""
    activation = config.get("hidden_activation") or config.get("hidden_act")
    require_source(activation == "gelu_pytorch_tanh", source,
                   f"activation {activation!r} (Gemma's GeGLU gate is gelu_pytorch_tanh; trident's geglu_tanh)")
    require_source(not config["use_bidirectional_attention"], source, "bidirectional attention (use_bidirectional_attention)")
    d_model, n_heads, n_layers = int(config["hidden_size"]), int(config["num_attention_heads"]), int(config["num_hidden_layers"])
    head_dim = int(config.get("head_dim") or d_model // n_heads)
    scale_dim = float(config["query_pre_attn_scalar"])
    biases = bool(config["attention_bias"])
    softcap = config.get("attn_logit_softcapping") if family.softcap else None
    settings: dict[str, Any] = {
        "d_model": d_model, "n_heads": n_heads, "n_layers": n_layers, "d_ff": int(config["intermediate_size"]),
        "activation": "geglu_tanh", "norm": "rmsnorm_offset", "norm_first": True, "sandwich_norm": True,
        "norm_eps": float(config["rms_norm_eps"]), "embedding_norm": False,
        "n_kv_heads": int(config.get("num_key_value_heads") or n_heads), "head_dim": head_dim, "qk_norm": family.qk_norm,
        "qkv_bias": biases, "attn_out_bias": biases, "mlp_bias": False, "bias": False,
        # The head width is the default: a scale stated only where it differs reads back as the stack had it.
        "attn_scale_dim": None if scale_dim == head_dim else scale_dim,
        "attn_softcap": None if softcap is None else float(softcap),
        "final_logit_softcap": None if config.get("final_logit_softcapping") is None else float(config["final_logit_softcapping"]),
    }
    full, local = _ropes(family, config, source)
    every = int(config.get("sliding_window_pattern") or family.sliding_every)  # older Gemma 3 files state it
    kinds = config.get("layer_types") or [SLIDING if (i + 1) % every else FULL for i in range(n_layers)]
    window = config["sliding_window"]
    window = int(window) if window and int(window) < context_length(config, full) else None
    windows = [window if kind == SLIDING else None for kind in kinds]
    layers = window_settings(windows).get("layers") or [None] * n_layers
    if local != full:  # the sliding layers' own rope
        layers = [{**(entry or {}), "pos_encoding_options": local} if kind == SLIDING else entry
                  for entry, kind in zip(layers, kinds, strict=True)]
    if any(entry is not None for entry in layers):
        settings["layers"] = layers
    elif window is not None:  # every layer slides
        settings["attention_window"] = window
    return settings, full


def _require_family(family: GemmaFamily, cfg: TransformerConfig, net: CausalLM) -> None:
    """One line for each setting the family's config cannot state."""
    target = family.target
    require_unshared(cfg, target)
    for ok, setting, value, fix in (
        (cfg.pos_encoding == "rope", "pos_encoding", cfg.pos_encoding, "it has rope positions only"),
        (cfg.norm == "rmsnorm_offset", "model.norm", cfg.norm, "its RMSNorm's gain is 1 + weight (rmsnorm_offset)"),
        (cfg.activation == "geglu_tanh", "model.activation", cfg.activation, "its MLP is GeGLU with tanh GELU (geglu_tanh)"),
        (cfg.norm_first and cfg.sandwich_norm, "model.sandwich_norm", cfg.sandwich_norm, "it norms before and after each sub-layer"),
        (not cfg.embedding_norm, "model.embedding_norm", cfg.embedding_norm, "it does not normalise its embeddings"),
        (cfg.layer_scale_init is None, "model.layer_scale_init", cfg.layer_scale_init, "it has no layer scale"),
        (cfg.attention == "softmax", "model.attention", cfg.attention, "it computes softmax attention"),
        (not cfg.memory_length, "model.memory_length", cfg.memory_length, "it keeps no memory"),
    ):
        require_equivalent(ok, setting, value, target, fix)
    require_property(net.embed.scale != 1.0, CausalLM, SCALED_EMBEDDING, False, target,
                     "it scales its embeddings by sqrt(hidden_size)")
    for ok, setting, value, fix in (
        (cfg.qk_norm == family.qk_norm, "model.qk_norm", cfg.qk_norm,
         "it has QK-norm in every layer" if family.qk_norm else "it has no QK-norm (Gemma 3 has)"),
        (cfg.qkv_bias == cfg.attn_out_bias, "model.attn_out_bias", cfg.attn_out_bias, "its attention_bias is on q, k, v and o alike"),
        (not cfg.mlp_bias, "model.mlp_bias", cfg.mlp_bias, "its MLP has no biases"),
        (family.softcap or cfg.attn_softcap is None, "model.attn_softcap", cfg.attn_softcap,
         "transformers' Gemma 3 attention applies no soft-capping (Gemma 2's does)"),
    ):
        require_equivalent(ok, setting, value, target, fix)
    require_same_layers(cfg, target, windows=True, ropes=2 if family.two_ropes else 1)


def _layer_ropes(family: GemmaFamily, cfg: TransformerConfig) -> tuple[list[str], dict[str, Any]]:
    """layer_types and the rope_parameters of each kind; every layer of a kind must rotate as the others."""
    layers = cfg.layer_settings
    kinds = [SLIDING if layer.attention_window is not None else FULL for layer in layers]
    ropes: dict[str, dict[str, Any]] = {}
    for kind, layer in zip(kinds, layers, strict=True):
        options = ropes.setdefault(kind, layer.pos_encoding_options)
        require_equivalent(options == layer.pos_encoding_options, "model.layers", cfg.layers, family.target,
                           "its sliding layers share one rope, and its global layers another")
    ropes.setdefault(FULL, ropes.get(SLIDING, cfg.pos_encoding_options))
    ropes.setdefault(SLIDING, ropes[FULL])
    parameters = {kind: rope_parameters(options) for kind, options in ropes.items()}
    require_equivalent(all(start is None for _, start in parameters.values()) or not family.two_ropes,
                       "pos_encoding.options.scaling", "dynamic", family.target, "its two ropes take no dynamic scaling")
    return kinds, {kind: rope for kind, (rope, _) in parameters.items()}


def sliding_window_pattern(kinds: list[str]) -> dict[str, int]:
    """Gemma 3's ``sliding_window_pattern`` n of layer_types where every n-th layer is global, the others sliding (none
    where no n gives them). transformers 4 before layer_types reads only n, and where it is absent 6, not layer_types."""
    for every in range(1, len(kinds) + 2):  # n_layers + 1: every layer sliding
        if kinds == [SLIDING if (i + 1) % every else FULL for i in range(len(kinds))]:
            return {"sliding_window_pattern": every}
    return {}


def _number(value: float) -> float | int:
    """An int where the value is whole: transformers' config classes type query_pre_attn_scalar as an int."""
    return int(value) if float(value).is_integer() else value


GEMMA2 = GemmaFamily(model_type="gemma2", family="gemma2", architecture="Gemma2ForCausalLM", target="Gemma 2 (hf export)",
                     qk_norm=False, softcap=True, two_ropes=False, sliding_every=2,
                     defaults={"max_position_embeddings": 8192, "rope_theta": 10000.0, "final_logit_softcapping": 30.0,
                               "attn_logit_softcapping": 50.0})
GEMMA3 = GemmaFamily(model_type="gemma3_text", family="gemma3", architecture="Gemma3ForCausalLM", target="Gemma 3 (hf export)",
                     qk_norm=True, softcap=False, two_ropes=True, sliding_every=6,
                     defaults={"max_position_embeddings": 131_072, "final_logit_softcapping": None,
                               "attn_logit_softcapping": None, "use_bidirectional_attention": False})
