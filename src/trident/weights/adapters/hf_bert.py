"""BERT (``BertForMaskedLM`` / ``BertModel``) <-> trident's ``MaskedLM`` (a masked-LM encoder).

BERT is a post-norm encoder (LayerNorm eps 1e-12) with learned positions whose summed token,
position and token-type embeddings pass a LayerNorm first (trident's ``model.embedding_norm``).
trident has no token types: every input is type 0, so type 0's vector is folded into the position
table when reading, and zero type vectors are written back. The MLM head (dense -> GELU ->
LayerNorm -> tied decoder with its own bias) is trident's ``transform`` and ``head``.
"""

from __future__ import annotations

from typing import Any

import torch
from tokenizers import Tokenizer
from torch import Tensor

from trident.data.special_tokens import CLS_TOKEN, MASK_TOKEN, PAD_TOKEN, SEP_TOKEN, UNK_TOKEN
from trident.models import MaskedLM
from trident.models.properties import MAX_SEQ_LEN, SCALED_EMBEDDING
from trident.weights.adapters.common import (
    encoder_settings,
    layer_from_hf,
    layer_to_hf,
    require_equivalent,
    require_hf_block,
    require_source,
    strip_prefix,
)
from trident.weights.adapters.outside_network import OutsideNetwork, require_property

FORMAT = "hf-bert"
MODEL_TYPE = "bert"
FAMILY = "bert"  # model.family of the stacks it reads and writes
ARCHITECTURES = ("BertForMaskedLM", "BertModel")
NETWORK = MaskedLM
TARGET = "BERT (hf export)"
TOKEN_TYPES = 2  # BERT's sentence A / sentence B
# Tokenizer attribute -> token, where the run's vocabulary has it (trident's MLM appends [MASK] and [PAD]).
SPECIAL_TOKENS = {"unk_token": UNK_TOKEN, "pad_token": PAD_TOKEN, "cls_token": CLS_TOKEN, "sep_token": SEP_TOKEN,
                  "mask_token": MASK_TOKEN}

_LAYER = {
    "attention.output.dense.weight": "self_attn.out_proj.weight",
    "attention.output.dense.bias": "self_attn.out_proj.bias",
    "attention.output.LayerNorm.weight": "self_attn_norm.weight",
    "attention.output.LayerNorm.bias": "self_attn_norm.bias",
    "intermediate.dense.weight": "ffn.fc_in.weight",
    "intermediate.dense.bias": "ffn.fc_in.bias",
    "output.dense.weight": "ffn.fc_out.weight",
    "output.dense.bias": "ffn.fc_out.bias",
    "output.LayerNorm.weight": "ffn_norm.weight",
    "output.LayerNorm.bias": "ffn_norm.bias",
}
_EMBEDDINGS = {
    "embeddings.word_embeddings.weight": "embed.weight",
    "embeddings.LayerNorm.weight": "encoder.embedding_norm.weight",
    "embeddings.LayerNorm.bias": "encoder.embedding_norm.bias",
}
_HEAD = {
    "cls.predictions.transform.dense.weight": "transform.0.weight",
    "cls.predictions.transform.dense.bias": "transform.0.bias",
    "cls.predictions.transform.LayerNorm.weight": "transform.2.weight",
    "cls.predictions.transform.LayerNorm.bias": "transform.2.bias",
    "cls.predictions.bias": "head.bias",
}
_POSITIONS, _TYPES = "embeddings.position_embeddings.weight", "embeddings.token_type_embeddings.weight"


def to_trident(config: dict[str, Any], state: dict[str, Tensor], tokenizer: Tokenizer | None, source: str) -> OutsideNetwork:
    require_source(config.get("position_embedding_type", "absolute") == "absolute", source,
                   f"position_embedding_type={config.get('position_embedding_type')}")
    require_source(not config.get("is_decoder", False), source, "a causal BERT (is_decoder=true)")
    # The MLM transform is GELU whatever the blocks use, so only GELU blocks are this model.
    require_source(config.get("hidden_act", "gelu") == "gelu", source, f"activation {config.get('hidden_act')!r}")
    n_layers = int(config["num_hidden_layers"])
    backbone = strip_prefix(state, "bert.")
    out = {target: backbone[name] for name, target in _EMBEDDINGS.items()}
    out["encoder.pos_encoding.embedding.weight"] = backbone[_POSITIONS] + backbone[_TYPES][0]  # (T, D) + (D,)
    for i in range(n_layers):
        out |= layer_from_hf(backbone, f"encoder.layer.{i}", f"encoder.blocks.{i}", _LAYER, "attention.self")
    if "cls.predictions.bias" in state:
        out |= {target: state[name] for name, target in _HEAD.items()}
        decoder = state.get("cls.predictions.decoder.weight", out["embed.weight"])
        require_source(torch.equal(decoder, out["embed.weight"]), source, "an MLM decoder not tied to the embedding")
        out["head.weight"] = out["embed.weight"]
    return OutsideNetwork(
        source=source,
        format=FORMAT,
        network=NETWORK,
        model=encoder_settings(config, activation="gelu", norm_first=False, embedding_norm=True),
        pos_encoding="learned",
        properties={SCALED_EMBEDDING: False, MAX_SEQ_LEN: int(config["max_position_embeddings"])},
        state_dict=out,
        tokenizer=tokenizer,
        vocab_size=int(config["vocab_size"]),
    )


def from_trident(net: MaskedLM) -> tuple[str, dict[str, Any], dict[str, Tensor]]:
    """The architecture name, ``BertConfig`` arguments and ``BertForMaskedLM`` state dict of ``net``."""
    cfg = net.cfg
    require_hf_block(cfg, TARGET, norm_first=False, embedding_norm=True)
    require_equivalent(cfg.activation == "gelu", "model.activation", cfg.activation, TARGET,
                       "BERT's blocks and MLM head share one activation, and trident's head is GELU")
    require_property(net.embed.scale == 1.0, NETWORK, SCALED_EMBEDDING, True, TARGET, "BERT does not scale its embeddings")
    config = {
        "vocab_size": net.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "intermediate_size": cfg.d_ff,
        "hidden_act": "gelu",
        "hidden_dropout_prob": cfg.dropout,
        "attention_probs_dropout_prob": cfg.attn_dropout,
        "max_position_embeddings": cfg.max_seq_len,
        "type_vocab_size": TOKEN_TYPES,
        "layer_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": True,
    }
    own = net.state_dict()
    state = {f"bert.{name}": own[target] for name, target in _EMBEDDINGS.items()}
    state[f"bert.{_POSITIONS}"] = own["encoder.pos_encoding.embedding.weight"]
    state[f"bert.{_TYPES}"] = torch.zeros(TOKEN_TYPES, cfg.d_model)
    for i in range(cfg.n_layers):
        state |= layer_to_hf(own, f"encoder.blocks.{i}", f"bert.encoder.layer.{i}", _LAYER, "attention.self")
    state |= {name: own[target] for name, target in _HEAD.items()}
    state["cls.predictions.decoder.weight"] = own["head.weight"]
    state["cls.predictions.decoder.bias"] = own["head.bias"]
    return "BertForMaskedLM", config, state


def writes(net: MaskedLM) -> bool:
    """Every MaskedLM without ALBERT's switches (hf_albert.writes) is written as BERT (its refusals name what BERT
    lacks)."""
    return net.cfg.embedding_dim is None and net.cfg.share_layers in (False, None)
