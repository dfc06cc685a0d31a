"""T5 (``T5ForConditionalGeneration``, v1.0 and v1.1) and mT5 (``MT5ForConditionalGeneration``) <-> trident's
``EncoderDecoder`` (task=translation).

T5 is the backbone's pre-norm encoder-decoder with these settings (Raffel et al. 2020; transformers' modeling_t5):
- relative positions (``pos_encoding=relative``): one learned bias per head and bucket, held by the first layer of each
  stack and shared by all its layers (trident's stack computes it once), bidirectional buckets in the encoder and
  past-only ones in the decoder, none in cross-attention; ``relative_attention_num_buckets`` / ``_max_distance``;
- unscaled attention logits (no 1/sqrt(d_kv): ``model.attn_scale_dim=1``), heads of ``d_kv`` (``model.head_dim``);
- RMSNorm without mean or bias (``layer_norm_epsilon``), no bias in any linear, no embedding scale;
- the feed-forward of ``feed_forward_proj``: ReLU (v1.0), GELU, or gated (v1.1's ``gated-gelu``: gelu_new(wi_0 x) * wi_1 x,
  trident's ``geglu_tanh`` with ``fc_in`` rows ``[wi_0; wi_1]``);
- one token embedding (``shared``) for encoder and decoder; the output layer tied to it (v1.0, ``task.tie_embeddings=all``)
  or its own ``lm_head`` (v1.1, ``embeddings``); v1.0 scales the decoder's output by d_model**-0.5 before it
  (``task.rescale_head``; transformers' ``scale_decoder_outputs``, which older configs say by ``tie_word_embeddings``);
- the decoder starts from ``decoder_start_token_id`` (T5's ``<pad>``: ``data.decoder_start``).

mT5 (Xue et al. 2021) is T5 v1.1 on a larger vocabulary, its files the same (``model_type`` ``mt5``, read as
``model.family=mt5`` and written back as mT5): its output layer its own (``lm_head``) or the embedding, never scaled
(transformers 5's MT5 has no ``scale_decoder_outputs``), so a network that rescales it is one line at export; the
export states ``tie_word_embeddings`` false with its ``lm_head``, as the hub's mT5 files do (transformers 5 writes
true whatever the head, and 4 would read true as a tied, scaled head).

Dropout is not part of the weights: T5 also drops inside its feed-forward and after the final norms, which trident does
not (training differs there; inference is equal).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from tokenizers import Tokenizer
from torch import Tensor

from trident.data.special_tokens import SEQ_END_TOKEN, SEQ_PAD_TOKEN, SEQ_START_TOKEN
from trident.models.properties import DECODER_START, RESCALED_HEAD, SCALED_EMBEDDING, SHARED_EMBEDDINGS
from trident.models.seq2seq import EncoderDecoder
from trident.weights.adapters.base import ModelTypeNames
from trident.weights.adapters.common import require_equivalent, require_source, require_unshared
from trident.weights.adapters.outside_network import OutsideNetwork, require_property

UNK = "<unk>"
# Tokenizer attribute -> token: T5's SentencePiece vocabulary has <pad> (0), </s> (1), <unk> (2) and no <s>; a run of
# trident's own BPE has <s>, which its decoder starts from (export's decoder_start_token_id, :func:`with_run`).
SPECIAL_TOKENS = {"eos_token": SEQ_END_TOKEN, "pad_token": SEQ_PAD_TOKEN, "unk_token": UNK, "bos_token": SEQ_START_TOKEN}
# feed_forward_proj -> model.activation (transformers' T5Config: gated-gelu is gelu_new, the tanh approximation).
ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_new": "gelu_tanh", "gated-gelu": "geglu_tanh", "gated-silu": "swiglu"}
# T5Config's defaults for the settings read: a config.json that leaves one out reads as transformers reads it.
DEFAULTS: dict[str, Any] = {"d_kv": 64, "d_ff": 2048, "num_layers": 6, "num_decoder_layers": None, "num_heads": 8,
                            "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128,
                            "layer_norm_epsilon": 1e-6, "feed_forward_proj": "relu", "dropout_rate": 0.1,
                            "pad_token_id": 0, "eos_token_id": 1, "decoder_start_token_id": None}
# trident block tensor <- T5's (after ``<stack>.block.<i>.layer.``): the self-attention sub-layer is layer 0 in both
# stacks, the feed-forward layer 1 in the encoder and 2 in the decoder (layer 1 is its cross-attention).
_ATTENTION = {"self_attn.out_proj.weight": "0.SelfAttention.o.weight", "self_attn_norm.weight": "0.layer_norm.weight"}
_CROSS = {"cross_attn.q_proj.weight": "1.EncDecAttention.q.weight", "cross_attn.out_proj.weight": "1.EncDecAttention.o.weight",
          "cross_attn_norm.weight": "1.layer_norm.weight"}


def _ffn(layer: int) -> dict[str, str]:
    return {"ffn.fc_out.weight": f"{layer}.DenseReluDense.wo.weight", "ffn_norm.weight": f"{layer}.layer_norm.weight"}


def _table(stack: str) -> dict[str, str]:
    """The one-to-one block tensors of ``stack`` (trident <- T5)."""
    return _ATTENTION | (_CROSS | _ffn(2) if stack == "decoder" else _ffn(1))


def _gate_names(gated: bool) -> tuple[str, ...]:
    return ("wi_0", "wi_1") if gated else ("wi",)


def model_settings(config: dict[str, Any], source: str) -> dict[str, Any]:
    """The ``model`` values of a T5 config: every attention-shape setting stated, resolved."""
    layers, decoder_layers = int(config["num_layers"]), config["num_decoder_layers"]
    require_source(decoder_layers in (None, layers), source,
                   f"num_decoder_layers={decoder_layers} beside num_layers={layers} (trident's encoder and decoder have "
                   "one model.n_layers)")
    projection = config["feed_forward_proj"]
    require_source(projection in ACTIVATIONS, source,
                   f"feed_forward_proj={projection!r} (trident has {', '.join(ACTIVATIONS)})")
    heads = int(config["num_heads"])
    return {"d_model": int(config["d_model"]), "n_heads": heads, "n_kv_heads": heads, "head_dim": int(config["d_kv"]),
            "n_layers": layers, "d_ff": int(config["d_ff"]), "activation": ACTIVATIONS[projection], "norm": "rmsnorm",
            "norm_first": True, "norm_eps": float(config["layer_norm_epsilon"]), "embedding_norm": False, "bias": False,
            "qkv_bias": False, "attn_out_bias": False, "mlp_bias": False, "qk_norm": False, "attn_scale_dim": 1.0}


def rescaled_head(config: dict[str, Any]) -> bool:
    """Whether the decoder's output is scaled by d_model**-0.5: transformers 5's ``scale_decoder_outputs``, which it
    derives from ``tie_word_embeddings`` (true unless false) where older configs state only that."""
    if "scale_decoder_outputs" in config:
        return bool(config["scale_decoder_outputs"])
    return config.get("tie_word_embeddings", True) is not False


def state_from_hf(state: dict[str, Tensor], model: dict[str, Any], source: str) -> tuple[dict[str, Tensor], str]:
    """A T5 state dict in trident's names, and the tie mode it shows: ``all`` where the output layer is the embedding
    (no ``lm_head.weight``, or an equal one), ``embeddings`` where it is its own."""
    require_source("decoder.final_layer_norm.weight" in state, source, "a T5 encoder without its decoder (T5EncoderModel)")
    shared = state["shared.weight"]
    head = state.get("lm_head.weight")
    tie = "all" if head is None or torch.equal(head, shared) else "embeddings"
    out = {"src_embed.weight": shared, "tgt_embed.weight": shared, "head.weight": shared if head is None else head}
    gated = model["activation"] in ("geglu_tanh", "swiglu")
    for stack in ("encoder", "decoder"):
        out[f"{stack}.pos_encoding.bias.weight"] = state[f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"]
        out[f"{stack}.final_norm.weight"] = state[f"{stack}.final_layer_norm.weight"]
        ffn = 2 if stack == "decoder" else 1
        for i in range(model["n_layers"]):
            hf, ours = f"{stack}.block.{i}.layer.", f"{stack}.blocks.{i}."
            out |= {ours + name: state[hf + theirs] for name, theirs in _table(stack).items()}
            out[ours + "self_attn.qkv_proj.weight"] = torch.cat([state[f"{hf}0.SelfAttention.{p}.weight"] for p in "qkv"])
            out[ours + "ffn.fc_in.weight"] = torch.cat([state[f"{hf}{ffn}.DenseReluDense.{p}.weight"] for p in _gate_names(gated)])
            if stack == "decoder":
                out[ours + "cross_attn.kv_proj.weight"] = torch.cat([state[f"{hf}1.EncDecAttention.{p}.weight"] for p in "kv"])
    return out, tie


def state_to_hf(own: dict[str, Tensor], cfg: Any, tie: str) -> dict[str, Tensor]:
    """The inverse of :func:`state_from_hf` (``lm_head.weight`` written where the output layer is its own)."""
    state = {"shared.weight": own["src_embed.weight"]}
    if tie != "all":
        state["lm_head.weight"] = own["head.weight"]
    gated = cfg.activation in ("geglu_tanh", "swiglu")
    for stack in ("encoder", "decoder"):
        state[f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] = own[f"{stack}.pos_encoding.bias.weight"]
        state[f"{stack}.final_layer_norm.weight"] = own[f"{stack}.final_norm.weight"]
        ffn = 2 if stack == "decoder" else 1
        for i in range(cfg.n_layers):
            hf, ours = f"{stack}.block.{i}.layer.", f"{stack}.blocks.{i}."
            state |= {hf + theirs: own[ours + name] for name, theirs in _table(stack).items()}
            q_width, kv_width = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
            parts = own[ours + "self_attn.qkv_proj.weight"].split([q_width, kv_width, kv_width])
            state |= {f"{hf}0.SelfAttention.{p}.weight": part for p, part in zip("qkv", parts, strict=True)}
            fc_in = own[ours + "ffn.fc_in.weight"].chunk(2 if gated else 1)
            state |= {f"{hf}{ffn}.DenseReluDense.{p}.weight": part for p, part in zip(_gate_names(gated), fc_in, strict=True)}
            if stack == "decoder":
                kv = own[ours + "cross_attn.kv_proj.weight"].chunk(2)
                state |= {f"{hf}1.EncDecAttention.{p}.weight": part for p, part in zip("kv", kv, strict=True)}
    return {name: tensor.contiguous() for name, tensor in state.items()}


def _require_t5(net: EncoderDecoder, target: str) -> None:
    """One line for each setting of ``net`` a T5 config cannot state."""
    cfg = net.cfg
    require_unshared(cfg, target)
    require_equivalent(cfg.pos_encoding == "relative", "pos_encoding", cfg.pos_encoding, target,
                       "it has relative position buckets only (train with pos_encoding=relative)")
    require_equivalent(cfg.norm == "rmsnorm", "model.norm", cfg.norm, target, "it uses RMSNorm (model.norm=rmsnorm)")
    require_equivalent(cfg.norm_first, "model.norm_first", cfg.norm_first, target, "it is pre-norm")
    require_equivalent(cfg.activation in ACTIVATIONS.values(), "model.activation", cfg.activation, target,
                       f"its feed-forward is one of {', '.join(ACTIVATIONS.values())}")
    require_equivalent(cfg.attn_scale_dim == 1.0, "model.attn_scale_dim", cfg.attn_scale_dim, target,
                       "its attention logits are unscaled (train with model.attn_scale_dim=1)")
    require_equivalent(cfg.n_kv_heads == cfg.n_heads, "model.n_kv_heads", cfg.n_kv_heads, target,
                       "it has a key/value head per query head")
    for name in ("bias", "qkv_bias", "attn_out_bias", "mlp_bias", "qk_norm", "embedding_norm", "sandwich_norm"):
        require_equivalent(not getattr(cfg, name), f"model.{name}", getattr(cfg, name), target,
                           f"it has no {name.replace('_', ' ')} (train with model.{name}=false)")
    for name in ("layer_scale_init", "attn_softcap", "attention_window", "layers"):
        require_equivalent(getattr(cfg, name) is None, f"model.{name}", getattr(cfg, name), target,
                           f"it has none (train with model.{name}=null)")
    require_equivalent(cfg.attention == "softmax", "model.attention", cfg.attention, target, "it computes softmax attention")
    require_property(net.src_embed.scale == 1.0, EncoderDecoder, SCALED_EMBEDDING, True, target,
                     "it does not scale its embeddings")
    require_property(net.tie_embeddings in ("all", "embeddings"), EncoderDecoder, SHARED_EMBEDDINGS, net.tie_embeddings,
                     target, "its encoder and decoder share one token embedding (all or embeddings)")
    require_property(net.head_scale == 1.0 or net.tie_embeddings == "all", EncoderDecoder, RESCALED_HEAD, True, target,
                     "it scales the decoder's output only before a tied output layer (T5 v1.0)")


@dataclass(frozen=True)
class T5Family(ModelTypeNames):
    """T5 both ways (the Adapter interface of base.py, registered in registry.ADAPTERS)."""

    model_type: str  # config.json's "model_type": "t5"
    architecture: str  # the transformers class: "T5ForConditionalGeneration"
    name: str  # how error lines name it: "T5"
    # Whether its config states a decoder output scaled before the output layer (T5 v1.0's; mT5 never scales it).
    scales_head: bool = True
    # Whether it writes an encoder-decoder that declares no family, by its settings (T5), or declared ones only (mT5).
    writes_undeclared: bool = True

    NETWORK: ClassVar[type[EncoderDecoder]] = EncoderDecoder
    SPECIAL_TOKENS: ClassVar[dict[str, str]] = SPECIAL_TOKENS

    @property
    def ARCHITECTURES(self) -> tuple[str, ...]:
        return (self.architecture,)

    @property
    def TARGET(self) -> str:
        return f"{self.name} (hf export)"

    def to_trident(self, config: dict[str, Any], state: dict[str, Tensor], tokenizer: Tokenizer | None,
                   source: str) -> OutsideNetwork:
        config = DEFAULTS | config
        model = model_settings(config, source)
        out, tie = state_from_hf(state, model, source)
        start = config["decoder_start_token_id"]
        start = int(config["pad_token_id"] if start is None else start)
        start_token = tokenizer.id_to_token(start) if tokenizer is not None else None
        require_source(tokenizer is None or start_token is not None, source,
                       f"decoder_start_token_id={start}, a token its tokenizer does not have")
        return OutsideNetwork(
            source=source, format=self.FORMAT, network=EncoderDecoder, model=model, pos_encoding="relative",
            pos_encoding_options={"num_buckets": int(config["relative_attention_num_buckets"]),
                                  "max_distance": int(config["relative_attention_max_distance"])},
            properties={SHARED_EMBEDDINGS: tie, SCALED_EMBEDDING: False,
                        RESCALED_HEAD: self.scales_head and rescaled_head(config),
                        DECODER_START: start_token or SEQ_PAD_TOKEN},
            state_dict=out, tokenizer=tokenizer, vocab_size=int(config["vocab_size"]),
        )

    def from_trident(self, net: EncoderDecoder) -> tuple[str, dict[str, Any], dict[str, Tensor]]:
        _require_t5(net, self.TARGET)
        require_property(self.scales_head or net.head_scale == 1.0, EncoderDecoder, RESCALED_HEAD, True, self.TARGET,
                         "it never scales the decoder's output")
        cfg = net.cfg
        projection = next(name for name, activation in ACTIVATIONS.items() if activation == cfg.activation)
        # tie_word_embeddings says both tying and scaling to transformers 4; 5 reads it as scale_decoder_outputs and
        # unties an lm_head the file holds. An untied head (written out) without scaling reads alike in both.
        rescaled = net.head_scale != 1.0
        tie = "all" if rescaled else "embeddings"
        config = {"vocab_size": net.vocab_size, "d_model": cfg.d_model, "d_kv": cfg.head_dim, "d_ff": cfg.d_ff,
                  "num_layers": cfg.n_layers, "num_decoder_layers": cfg.n_layers, "num_heads": cfg.n_heads,
                  "relative_attention_num_buckets": net.encoder.pos_encoding.num_buckets,
                  "relative_attention_max_distance": net.encoder.pos_encoding.max_distance,
                  "dropout_rate": cfg.dropout, "layer_norm_epsilon": cfg.norm_eps, "feed_forward_proj": projection,
                  "tie_word_embeddings": rescaled, "is_encoder_decoder": True}
        return self.architecture, config, state_to_hf(net.state_dict(), cfg, tie)

    def writes(self, net: EncoderDecoder) -> bool:
        """An encoder-decoder of relative positions and RMSNorm that declares no family is written as T5 (mT5 writes
        only those declared model.family=mt5)."""
        return self.writes_undeclared and net.cfg.pos_encoding == "relative" and net.cfg.norm == "rmsnorm"

    @staticmethod
    def with_run(settings: dict[str, Any], state: dict[str, Tensor]) -> tuple[dict[str, Any], dict[str, Tensor]]:
        """The decoder's start from the run's tokenizer: its <s> where it has one (trident's BPE), else its padding (T5's
        own vocabulary); its padding id 0 where it has none."""
        pad = settings.get("pad_token_id")
        pad = 0 if pad is None else pad
        start = settings.get("bos_token_id")
        return settings | {"pad_token_id": pad, "decoder_start_token_id": pad if start is None else start}, state


T5 = T5Family(model_type="t5", architecture="T5ForConditionalGeneration", name="T5")
MT5 = T5Family(model_type="mt5", architecture="MT5ForConditionalGeneration", name="mT5", scales_head=False,
               writes_undeclared=False)
