"""ALBERT (``AlbertForMaskedLM`` / ``AlbertModel``) <-> trident's ``MaskedLM`` with ALBERT's two switches.

ALBERT (Lan et al. 2020) is BERT's post-norm encoder with two changes, both trident backbone switches:
- a factorised embedding: token, position and token-type vectors of width E (``embedding_size``), normalised at E,
  then projected to the width (``embedding_hidden_mapping_in``): ``model.embedding_dim`` and the stack's
  ``embedding_projection``; the MLM head projects back to E (dense -> the blocks' activation -> LayerNorm) before
  the decoder tied to the E-wide embedding;
- cross-layer sharing: ``num_hidden_groups`` sets of weights, group g serving layers g * L/G .. (g + 1) * L/G - 1:
  ``model.share_layers`` (true for one group, the published models; the group count otherwise). A group of several
  distinct layers (``inner_group_num`` > 1, in no published model) is refused.
As for BERT, trident has no token types: type 0's vector is folded into the position table when reading, and zero
type vectors are written back.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from tokenizers import Tokenizer
from torch import Tensor

from trident.data.special_tokens import CLS_TOKEN, MASK_TOKEN, PAD_TOKEN, SEP_TOKEN, UNK_TOKEN
from trident.models import MaskedLM
from trident.models.properties import MAX_SEQ_LEN, SCALED_EMBEDDING
from trident.weights.adapters.common import (
    activation_from_hf,
    activation_to_hf,
    encoder_settings,
    layer_from_hf,
    layer_to_hf,
    require_equivalent,
    require_hf_block,
    require_source,
    strip_prefix,
)
from trident.weights.adapters.hf_classifier import ClassifierAdapter
from trident.weights.adapters.outside_network import OutsideNetwork, require_property

FORMAT = "hf-albert"
MODEL_TYPE = "albert"
FAMILY = "albert"  # model.family of the stacks it reads and writes
ARCHITECTURES = ("AlbertForMaskedLM", "AlbertModel", "AlbertForPreTraining", "AlbertForSequenceClassification")
NETWORK = MaskedLM
TARGET = "ALBERT (hf export)"
TOKEN_TYPES = 2  # ALBERT's sentence A / sentence B
# Tokenizer attribute -> token, where the run's vocabulary has it: trident's MLM tokens (a run read from ALBERT names
# its own, <pad> and <unk>, in tokenizer_settings, which take precedence).
SPECIAL_TOKENS = {"unk_token": UNK_TOKEN, "pad_token": PAD_TOKEN, "cls_token": CLS_TOKEN, "sep_token": SEP_TOKEN,
                  "mask_token": MASK_TOKEN}

# Inside ``albert_layer_groups.<g>.albert_layers.0.`` -> inside ``encoder.blocks.<g>.``.
_LAYER = {
    "attention.dense.weight": "self_attn.out_proj.weight",
    "attention.dense.bias": "self_attn.out_proj.bias",
    "attention.LayerNorm.weight": "self_attn_norm.weight",
    "attention.LayerNorm.bias": "self_attn_norm.bias",
    "ffn.weight": "ffn.fc_in.weight",
    "ffn.bias": "ffn.fc_in.bias",
    "ffn_output.weight": "ffn.fc_out.weight",
    "ffn_output.bias": "ffn.fc_out.bias",
    "full_layer_layer_norm.weight": "ffn_norm.weight",
    "full_layer_layer_norm.bias": "ffn_norm.bias",
}
_EMBEDDINGS = {
    "embeddings.word_embeddings.weight": "embed.weight",
    "embeddings.LayerNorm.weight": "encoder.embedding_norm.weight",
    "embeddings.LayerNorm.bias": "encoder.embedding_norm.bias",
    "encoder.embedding_hidden_mapping_in.weight": "encoder.embedding_projection.weight",
    "encoder.embedding_hidden_mapping_in.bias": "encoder.embedding_projection.bias",
}
_HEAD = {
    "predictions.dense.weight": "transform.0.weight",
    "predictions.dense.bias": "transform.0.bias",
    "predictions.LayerNorm.weight": "transform.2.weight",
    "predictions.LayerNorm.bias": "transform.2.bias",
    "predictions.bias": "head.bias",
}
_POSITIONS, _TYPES = "embeddings.position_embeddings.weight", "embeddings.token_type_embeddings.weight"


def _group(g: int) -> str:
    return f"encoder.albert_layer_groups.{g}.albert_layers.0"


def share_layers_of(config: dict[str, Any], source: str) -> bool | int:
    """``model.share_layers`` of an ALBERT config: true for one group, false for a group per layer, else the count."""
    layers, groups = int(config["num_hidden_layers"]), int(config.get("num_hidden_groups", 1))
    require_source(int(config.get("inner_group_num", 1)) == 1, source,
                   f"inner_group_num={config.get('inner_group_num')} (several distinct layers per shared group)")
    require_source(layers % groups == 0, source, f"num_hidden_groups={groups} not dividing num_hidden_layers={layers}")
    return True if groups == 1 else False if groups == layers else groups


def backbone_from_hf(config: dict[str, Any], backbone: dict[str, Tensor], source: str) -> tuple[dict[str, Any], dict[str, Tensor], int]:
    """The ``model`` settings, the embedding and encoder tensors (trident's names) of an ``AlbertModel`` state, and its
    context (the rows of its position table)."""
    require_source(config.get("position_embedding_type", "absolute") == "absolute", source,
                   f"position_embedding_type={config.get('position_embedding_type')}")
    share = share_layers_of(config, source)
    groups = int(config.get("num_hidden_groups", 1))
    out = {target: backbone[name] for name, target in _EMBEDDINGS.items()}
    out["encoder.pos_encoding.embedding.weight"] = backbone[_POSITIONS] + backbone[_TYPES][0]  # (T, E) + (E,)
    for g in range(groups):
        out |= layer_from_hf(backbone, _group(g), f"encoder.blocks.{g}", _LAYER, "attention")
    model = encoder_settings(config, activation=activation_from_hf(config.get("hidden_act", "gelu_new"), source),
                             norm_first=False, embedding_norm=True)
    settings = model | {"share_layers": share, "embedding_dim": int(config.get("embedding_size", 128))}
    return settings, out, int(config["max_position_embeddings"])


def to_trident(config: dict[str, Any], state: dict[str, Tensor], tokenizer: Tokenizer | None, source: str) -> OutsideNetwork:
    if "classifier.weight" in state:  # AlbertForSequenceClassification
        return CLASSIFIER.to_trident(config, state, tokenizer, source)
    model, out, context = backbone_from_hf(config, strip_prefix(state, "albert."), source)
    if "predictions.bias" in state:
        out |= {target: state[name] for name, target in _HEAD.items()}
        decoder = state.get("predictions.decoder.weight", out["embed.weight"])
        require_source(torch.equal(decoder, out["embed.weight"]), source, "an MLM decoder not tied to the embedding")
        out["head.weight"] = out["embed.weight"]
    return OutsideNetwork(
        source=source,
        format=FORMAT,
        network=NETWORK,
        model=model,
        pos_encoding="learned",
        properties={SCALED_EMBEDDING: False, MAX_SEQ_LEN: context},
        state_dict=out,
        tokenizer=tokenizer,
        vocab_size=int(config["vocab_size"]),
    )


def config_from_trident(cfg: Any, vocab_size: int, target: str) -> dict[str, Any]:
    """The ``AlbertConfig`` arguments of a stack (ALBERT's refusals named for ``target``)."""
    require_hf_block(cfg, target, norm_first=False, embedding_norm=True, shared=True)
    require_equivalent(cfg.embedding_dim is not None, "model.embedding_dim", cfg.embedding_dim, target,
                       "ALBERT projects a factorised embedding to the width (train with model.embedding_dim, e.g. 128)")
    return {
        "vocab_size": vocab_size,
        "embedding_size": cfg.embedding_dim,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_hidden_groups": cfg.block_of_layer[-1] + 1,
        "inner_group_num": 1,
        "num_attention_heads": cfg.n_heads,
        "intermediate_size": cfg.d_ff,
        "hidden_act": activation_to_hf(cfg.activation, target),
        "hidden_dropout_prob": cfg.dropout,
        "attention_probs_dropout_prob": cfg.attn_dropout,
        "max_position_embeddings": cfg.max_seq_len,
        "type_vocab_size": TOKEN_TYPES,
        "layer_norm_eps": cfg.norm_eps,
    }


def backbone_to_hf(own: dict[str, Tensor], cfg: Any, prefix: str) -> dict[str, Tensor]:
    """The embedding and encoder tensors of ``own`` (a trident state dict) in ``AlbertModel``'s names under ``prefix``."""
    state = {f"{prefix}{name}": own[target] for name, target in _EMBEDDINGS.items()}
    state[f"{prefix}{_POSITIONS}"] = own["encoder.pos_encoding.embedding.weight"]
    state[f"{prefix}{_TYPES}"] = torch.zeros(TOKEN_TYPES, cfg.embedding_dim)
    for g in range(cfg.block_of_layer[-1] + 1):
        state |= layer_to_hf(own, f"encoder.blocks.{g}", f"{prefix}{_group(g)}", _LAYER, "attention")
    return state


def from_trident(net: MaskedLM) -> tuple[str, dict[str, Any], dict[str, Tensor]]:
    """The architecture name, ``AlbertConfig`` arguments and ``AlbertForMaskedLM`` state dict of ``net``."""
    cfg = net.cfg
    config = config_from_trident(cfg, net.vocab_size, TARGET) | {"tie_word_embeddings": True}
    require_property(net.embed.scale == 1.0, NETWORK, SCALED_EMBEDDING, True, TARGET, "ALBERT does not scale its embeddings")
    own = net.state_dict()
    state = backbone_to_hf(own, cfg, "albert.")
    state |= {name: own[target] for name, target in _HEAD.items()}
    state["predictions.decoder.weight"] = own["head.weight"]
    state["predictions.decoder.bias"] = own["head.bias"]
    return "AlbertForMaskedLM", config, state


def writes(net: MaskedLM) -> bool:
    """A MaskedLM whose stack declares no family is ALBERT where it has ALBERT's switches (else BERT)."""
    return net.cfg.embedding_dim is not None or net.cfg.share_layers not in (False, None)


# AlbertForSequenceClassification: the pooler (dense + tanh on [CLS]) and the classifier.
CLASSIFIER = ClassifierAdapter(sys.modules[__name__], "AlbertForSequenceClassification", "albert.pooler", "classifier",
                               backbone_from_hf, backbone_to_hf, config_from_trident)
