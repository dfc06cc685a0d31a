"""BART (``BartForConditionalGeneration`` / ``BartModel``) <-> trident's ``EncoderDecoder`` (task=translation).

BART is the 2017 Transformer with learned positions, post-norm blocks with biases and GELU, and one embedding matrix
shared by the encoder, the decoder and the output layer; what trident holds besides its backbone settings:
- positions start at row 2 of each stack's table (``BartLearnedPositionalEmbedding``'s offset): position t is row
  t + 2, so the table is read from row 2 on and written back behind two zero rows (rows 0 and 1 serve nothing);
- ``layernorm_embedding``: a LayerNorm of the summed embeddings in each stack (``model.embedding_norm``);
- ``scale_embedding``: embeddings times sqrt(d_model) (``task.scale_embeddings``: false for bart-base and -large);
- ``final_logits_bias``: a (1, V) buffer added to the logits (``task.logits_bias``: a buffer here too, never trained);
- ``decoder_start_token_id`` (its </s>): the decoder's input is ``</s> <s> tokens``, and generate forces ``<s>`` first
  (``forced_bos_token_id``) and ``</s>`` at the length limit (``forced_eos_token_id``): ``task.decoder_start_id``, with
  which ``task.scoring=auto`` scores beams as generate does (trident.models.decoding).
The encoder and the decoder share one TransformerConfig: a BART whose stacks differ in depth, width of the
feed-forward or heads is one line, as is mBART's pre-norm variant (``normalize_before``, the stacks' final
``layer_norm``) and an untied output layer.
"""

from __future__ import annotations

from typing import Any

import torch
from tokenizers import Tokenizer
from torch import Tensor

from trident.data.special_tokens import SEQ_END_TOKEN, SEQ_MASK_TOKEN, SEQ_PAD_TOKEN, SEQ_START_TOKEN
from trident.models import EncoderDecoder
from trident.models.properties import (
    LOGITS_BIAS,
    MAX_SEQ_LEN,
    SCALED_EMBEDDING,
    SHARED_EMBEDDINGS,
    SOURCE_BOS,
    START_BEFORE_BOS,
)
from trident.weights.adapters.common import (
    activation_from_hf,
    activation_to_hf,
    fuse_qkv,
    hf_model_settings,
    require_equivalent,
    require_hf_block,
    require_source,
    split_qkv,
)
from trident.weights.adapters.outside_network import OutsideNetwork, require_property

FORMAT = "hf-bart"
MODEL_TYPE = "bart"
FAMILY = "bart"
ARCHITECTURES = ("BartForConditionalGeneration", "BartModel")
NETWORK = EncoderDecoder
TARGET = "BART (hf export)"
SPECIAL_TOKENS = {"bos_token": SEQ_START_TOKEN, "eos_token": SEQ_END_TOKEN, "pad_token": SEQ_PAD_TOKEN,
                  "unk_token": "<unk>", "mask_token": SEQ_MASK_TOKEN}
OFFSET = 2  # BartLearnedPositionalEmbedding: position t is row t + 2
BOS_ID, EOS_ID = 0, 2  # BartConfig's defaults: a network exported without its run's tokenizer has them
# Inside ``model.{encoder,decoder}.layers.<i>.`` -> inside ``{encoder,decoder}.blocks.<i>.``, weights and biases.
LAYER = {"self_attn.out_proj": "self_attn.out_proj", "self_attn_layer_norm": "self_attn_norm", "fc1": "ffn.fc_in",
         "fc2": "ffn.fc_out", "final_layer_norm": "ffn_norm"}
CROSS = {"encoder_attn.out_proj": "cross_attn.out_proj", "encoder_attn.q_proj": "cross_attn.q_proj",
         "encoder_attn_layer_norm": "cross_attn_norm"}
STACKS = ("encoder", "decoder")
KINDS = ("weight", "bias")


def _config_checks(config: dict[str, Any], source: str) -> None:
    """One line for each setting of ``config`` that one trident EncoderDecoder cannot hold."""
    for key in ("layers", "ffn_dim", "attention_heads"):
        require_source(config[f"encoder_{key}"] == config[f"decoder_{key}"], source,
                       f"encoder_{key}={config[f'encoder_{key}']} and decoder_{key}={config[f'decoder_{key}']} differ "
                       "(trident's encoder and decoder share one model config)")
    require_source(not config.get("normalize_before", False), source,
                   "normalize_before=true (mBART's pre-norm blocks and final layer_norm; BART is post-norm)")
    require_source(not config.get("add_final_layer_norm", False), source, "add_final_layer_norm=true (mBART's)")
    require_source(not config.get("add_bias_logits", False), source, "add_bias_logits=true (a trained logits bias)")
    require_source(config.get("tie_word_embeddings", True), source,
                   "tie_word_embeddings=false (an output layer apart from the encoder's and decoder's shared embedding)")


def to_trident(config: dict[str, Any], state: dict[str, Tensor], tokenizer: Tokenizer | None, source: str) -> OutsideNetwork:
    """``config.json`` and the state dict of a BART as an EncoderDecoder's settings and state dict."""
    _config_checks(config, source)
    state = {name.removeprefix("model."): tensor for name, tensor in state.items()}
    embedding = state["shared.weight"]  # (V, D)
    for name in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"):
        require_source(name not in state or torch.equal(state[name], embedding), source, f"{name} not tied to shared.weight")
    out = {key: embedding for key in ("src_embed.weight", "tgt_embed.weight", "head.weight")}
    for stack in STACKS:
        out[f"{stack}.pos_encoding.embedding.weight"] = state[f"{stack}.embed_positions.weight"][OFFSET:]  # (T, D)
        for kind in KINDS:
            out[f"{stack}.embedding_norm.{kind}"] = state[f"{stack}.layernorm_embedding.{kind}"]
        for i in range(int(config[f"{stack}_layers"])):
            out |= _layer_from_hf(state, f"{stack}.layers.{i}", f"{stack}.blocks.{i}", stack == "decoder")
    bias = state.get("final_logits_bias")  # (1, V)
    if bias is not None:
        out["logits_bias"] = bias[0]
    model = hf_model_settings(int(config["d_model"]), int(config["encoder_attention_heads"]),
                              int(config["encoder_layers"]), int(config["encoder_ffn_dim"]),
                              activation=activation_from_hf(config.get("activation_function", "gelu"), source),
                              norm_first=False, norm_eps=1e-5, embedding_norm=True)
    model |= {"dropout": float(config.get("dropout", 0.1)), "attn_dropout": float(config.get("attention_dropout", 0.0))}
    properties = {SHARED_EMBEDDINGS: "all", SCALED_EMBEDDING: bool(config.get("scale_embedding", False)),
                  MAX_SEQ_LEN: int(config["max_position_embeddings"]), LOGITS_BIAS: bias is not None,
                  START_BEFORE_BOS: int(config.get("decoder_start_token_id", EOS_ID)),
                  # BART was pre-trained on `<s> tokens </s>`, and its tokenizer (the export's too) encodes so.
                  SOURCE_BOS: True}
    return OutsideNetwork(source=source, format=FORMAT, network=EncoderDecoder, model=model, pos_encoding="learned",
                          properties=properties, state_dict=out, tokenizer=tokenizer, vocab_size=int(config["vocab_size"]))


def _layer_from_hf(state: dict[str, Tensor], hf: str, trident: str, cross: bool) -> dict[str, Tensor]:
    """One encoder or decoder layer of BART in trident's names: q/k/v fused (cross-attention: k/v)."""
    table = LAYER | (CROSS if cross else {})
    out = {f"{trident}.{target}.{kind}": state[f"{hf}.{name}.{kind}"] for name, target in table.items() for kind in KINDS}
    for kind in KINDS:
        out[f"{trident}.self_attn.qkv_proj.{kind}"] = fuse_qkv(
            *(state[f"{hf}.self_attn.{role}_proj.{kind}"] for role in ("q", "k", "v")))
        if cross:
            out[f"{trident}.cross_attn.kv_proj.{kind}"] = torch.cat(
                [state[f"{hf}.encoder_attn.{role}_proj.{kind}"] for role in ("k", "v")])
    return out


def _layer_to_hf(own: dict[str, Tensor], trident: str, hf: str, cross: bool) -> dict[str, Tensor]:
    """The inverse of :func:`_layer_from_hf`."""
    table = LAYER | (CROSS if cross else {})
    out = {f"{hf}.{name}.{kind}": own[f"{trident}.{target}.{kind}"] for name, target in table.items() for kind in KINDS}
    for kind in KINDS:
        for role, part in zip(("q", "k", "v"), split_qkv(own[f"{trident}.self_attn.qkv_proj.{kind}"]), strict=True):
            out[f"{hf}.self_attn.{role}_proj.{kind}"] = part.contiguous()
        if cross:
            for role, part in zip(("k", "v"), own[f"{trident}.cross_attn.kv_proj.{kind}"].chunk(2), strict=True):
                out[f"{hf}.encoder_attn.{role}_proj.{kind}"] = part.contiguous()
    return out


def from_trident(net: EncoderDecoder) -> tuple[str, dict[str, Any], dict[str, Tensor]]:
    """The architecture name, ``BartConfig`` arguments and state dict of ``net``."""
    cfg = net.cfg
    require_hf_block(cfg, TARGET, norm_first=False, embedding_norm=True)
    require_property(net.tie_embeddings == "all", EncoderDecoder, SHARED_EMBEDDINGS, net.tie_embeddings, TARGET,
                     "its encoder, decoder and output layer share one matrix (train with all of them tied)")
    own = net.state_dict()
    embedding = own["head.weight"]
    state = {"model.shared.weight": embedding, "lm_head.weight": embedding}
    for stack in STACKS:
        state[f"model.{stack}.embed_tokens.weight"] = embedding
        table = own[f"{stack}.pos_encoding.embedding.weight"]  # (T, D)
        state[f"model.{stack}.embed_positions.weight"] = torch.cat((table.new_zeros(OFFSET, table.size(1)), table))
        for kind in KINDS:
            state[f"model.{stack}.layernorm_embedding.{kind}"] = own[f"{stack}.embedding_norm.{kind}"]
        for i in range(cfg.n_layers):
            state |= _layer_to_hf(own, f"{stack}.blocks.{i}", f"model.{stack}.layers.{i}", stack == "decoder")
    bias = own.get("logits_bias")
    state["final_logits_bias"] = (bias if bias is not None else embedding.new_zeros(net.vocab_size))[None]  # (1, V)
    config = {
        "vocab_size": net.vocab_size, "d_model": cfg.d_model, "max_position_embeddings": cfg.max_seq_len,
        "encoder_layers": cfg.n_layers, "decoder_layers": cfg.n_layers, "encoder_ffn_dim": cfg.d_ff,
        "decoder_ffn_dim": cfg.d_ff, "encoder_attention_heads": cfg.n_heads, "decoder_attention_heads": cfg.n_heads,
        "activation_function": activation_to_hf(cfg.activation, TARGET), "dropout": cfg.dropout,
        "attention_dropout": cfg.attn_dropout, "scale_embedding": net.src_embed.scale != 1.0,
        "tie_word_embeddings": True, "decoder_start_token_id": net.decoder_start_id,
    }
    require_equivalent(cfg.norm_eps == 1e-5, "model.norm_eps", cfg.norm_eps, TARGET, "its LayerNorms use eps 1e-5")
    return ARCHITECTURES[0], config, state


def with_run(settings: dict[str, Any], state: dict[str, Tensor]) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """What generate reads of the run: a network without a decoder start of its own (trident's convention) starts
    from the run's BOS, which is then not forced again; BART's convention (``</s> <s> ...``) forces its BOS first."""
    start = settings["decoder_start_token_id"]
    bos, eos = settings.get("bos_token_id", BOS_ID), settings.get("eos_token_id", EOS_ID)
    forced = {"forced_bos_token_id": bos if start is not None else None, "forced_eos_token_id": eos}
    return settings | forced | {"decoder_start_token_id": bos if start is None else start}, state


def writes(net: EncoderDecoder) -> bool:
    """An EncoderDecoder that declares no family is trident's own (sinusoids, scaled embeddings): written where it
    declares BART (read from BART, model.family=bart) only."""
    return False
