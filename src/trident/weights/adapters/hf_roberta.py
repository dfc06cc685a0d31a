"""RoBERTa (``RobertaForMaskedLM`` / ``RobertaModel``) <-> trident's ``MaskedLM``.

RoBERTa is BERT's encoder (the same layer names, post-norm, the embedding LayerNorm) with two differences:
- positions start past the padding id: transformers numbers a row's real tokens ``padding_idx + 1, padding_idx + 2,
  ...`` (``create_position_ids_from_input_ids``: the running count of non-padding tokens plus ``padding_idx``).
  trident's text tasks pad on the right, where that is row t of the table at position ``t + padding_idx + 1``: the
  table is read from row ``padding_idx + 1`` on (the rows before it serve only padding, whose outputs no one reads)
  and written back behind ``padding_idx + 1`` zero rows. A left-padded row, which trident's text tasks never feed,
  would be numbered from its first slot instead.
- one token type (``type_vocab_size`` 1), folded into the position table as BERT's type 0.
The MLM head (``lm_head``: dense -> GELU -> LayerNorm -> decoder tied to the embedding, its own bias) is BERT's.
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
    encoder_settings,
    layer_from_hf,
    layer_to_hf,
    require_equivalent,
    require_hf_block,
    require_source,
    strip_prefix,
)
from trident.weights.adapters.hf_bert import _LAYER
from trident.weights.adapters.hf_classifier import ClassifierAdapter
from trident.weights.adapters.outside_network import OutsideNetwork, require_property

FORMAT = "hf-roberta"
MODEL_TYPE = "roberta"
FAMILY = "roberta"  # model.family of the stacks it reads and writes
ARCHITECTURES = ("RobertaForMaskedLM", "RobertaModel", "RobertaForSequenceClassification")
NETWORK = MaskedLM
TARGET = "RoBERTa (hf export)"
PAD_ID = 1  # RobertaConfig's pad_token_id: <pad> of its byte-level BPE (<s>=0, <pad>=1, </s>=2)
# Tokenizer attribute -> token, where the run's vocabulary has it: trident's MLM tokens (a run read from RoBERTa names
# its own, <pad> and <mask>, in tokenizer_settings, which take precedence).
SPECIAL_TOKENS = {"unk_token": UNK_TOKEN, "pad_token": PAD_TOKEN, "cls_token": CLS_TOKEN, "sep_token": SEP_TOKEN,
                  "mask_token": MASK_TOKEN}

_EMBEDDINGS = {
    "embeddings.word_embeddings.weight": "embed.weight",
    "embeddings.LayerNorm.weight": "encoder.embedding_norm.weight",
    "embeddings.LayerNorm.bias": "encoder.embedding_norm.bias",
}
_HEAD = {
    "lm_head.dense.weight": "transform.0.weight",
    "lm_head.dense.bias": "transform.0.bias",
    "lm_head.layer_norm.weight": "transform.2.weight",
    "lm_head.layer_norm.bias": "transform.2.bias",
    "lm_head.bias": "head.bias",
}
_POSITIONS, _TYPES = "embeddings.position_embeddings.weight", "embeddings.token_type_embeddings.weight"
_POSITIONS_KEY = "encoder.pos_encoding.embedding.weight"


def backbone_from_hf(config: dict[str, Any], backbone: dict[str, Tensor], source: str) -> tuple[dict[str, Any], dict[str, Tensor], int]:
    """The ``model`` settings, the embedding and encoder tensors (trident's names) of a ``RobertaModel`` state, and
    its context (the position rows past the padding id)."""
    require_source(config.get("position_embedding_type", "absolute") == "absolute", source,
                   f"position_embedding_type={config.get('position_embedding_type')}")
    require_source(not config.get("is_decoder", False), source, "a causal RoBERTa (is_decoder=true)")
    # The MLM head is GELU whatever the blocks use (as BERT's), so only GELU blocks are this model.
    require_source(config.get("hidden_act", "gelu") == "gelu", source, f"activation {config.get('hidden_act')!r}")
    first = int(config.get("pad_token_id", PAD_ID)) + 1  # the row of a row's first token
    out = {target: backbone[name] for name, target in _EMBEDDINGS.items()}
    out[_POSITIONS_KEY] = backbone[_POSITIONS][first:] + backbone[_TYPES][0]  # (T, D) + (D,)
    for i in range(int(config["num_hidden_layers"])):
        out |= layer_from_hf(backbone, f"encoder.layer.{i}", f"encoder.blocks.{i}", _LAYER, "attention.self")
    model = encoder_settings(config, activation="gelu", norm_first=False, embedding_norm=True)
    return model, out, int(config["max_position_embeddings"]) - first


def to_trident(config: dict[str, Any], state: dict[str, Tensor], tokenizer: Tokenizer | None, source: str) -> OutsideNetwork:
    if "classifier.out_proj.weight" in state:  # RobertaForSequenceClassification
        return CLASSIFIER.to_trident(config, state, tokenizer, source)
    model, out, context = backbone_from_hf(config, strip_prefix(state, "roberta."), source)
    if "lm_head.bias" in state:
        out |= {target: state[name] for name, target in _HEAD.items()}
        decoder = state.get("lm_head.decoder.weight", out["embed.weight"])
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
    """The ``RobertaConfig`` arguments of a stack, its positions past :data:`PAD_ID` (:func:`with_run` moves them)."""
    require_hf_block(cfg, target, norm_first=False, embedding_norm=True)
    require_equivalent(cfg.activation == "gelu", "model.activation", cfg.activation, target,
                       "RoBERTa's blocks and MLM head share one activation, and trident's head is GELU")
    return {
        "vocab_size": vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "intermediate_size": cfg.d_ff,
        "hidden_act": "gelu",
        "hidden_dropout_prob": cfg.dropout,
        "attention_probs_dropout_prob": cfg.attn_dropout,
        "max_position_embeddings": cfg.max_seq_len + PAD_ID + 1,
        "type_vocab_size": 1,
        "layer_norm_eps": cfg.norm_eps,
        "pad_token_id": PAD_ID,  # the run's, where it has a tokenizer (with_run)
    }


def backbone_to_hf(own: dict[str, Tensor], cfg: Any, prefix: str) -> dict[str, Tensor]:
    """The embedding and encoder tensors of ``own`` (a trident state dict) in ``RobertaModel``'s names under ``prefix``."""
    state = {f"{prefix}{name}": own[target] for name, target in _EMBEDDINGS.items()}
    state[f"{prefix}{_POSITIONS}"] = _behind_padding(own[_POSITIONS_KEY], PAD_ID)
    state[f"{prefix}{_TYPES}"] = torch.zeros(1, cfg.d_model)
    for i in range(cfg.n_layers):
        state |= layer_to_hf(own, f"encoder.blocks.{i}", f"{prefix}encoder.layer.{i}", _LAYER, "attention.self")
    return state


def _behind_padding(table: Tensor, pad_id: int) -> Tensor:
    """trident's position table (T, D) behind ``pad_id + 1`` zero rows, where transformers' RoBERTa looks it up."""
    return torch.cat((table.new_zeros(pad_id + 1, table.size(1)), table))  # (pad_id + 1 + T, D)


def with_run(settings: dict[str, Any], state: dict[str, Tensor]) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """``settings`` and ``state`` of :func:`from_trident` once the run's entries are in ``settings``: the position
    table moved behind the run's padding id (its own tokenizer's; :data:`PAD_ID` for a network exported alone). A
    tokenizer without a padding token is one line: transformers would take some real token for padding."""
    pad_id = settings["pad_token_id"]
    require_equivalent(pad_id is not None, "the run's tokenizer", "without a padding token", TARGET,
                       f"RoBERTa numbers its positions past the padding id: train with a tokenizer that has "
                       f"{SPECIAL_TOKENS['pad_token']} (a masked LM's own tokenizer has one), or export as BERT (model.family=bert)")
    pad_id = int(pad_id)
    name = next(name for name in state if name.endswith(_POSITIONS))
    table = state[name][PAD_ID + 1:]  # (T, D)
    return (settings | {"pad_token_id": pad_id, "max_position_embeddings": table.size(0) + pad_id + 1},
            state | {name: _behind_padding(table, pad_id)})


def from_trident(net: MaskedLM) -> tuple[str, dict[str, Any], dict[str, Tensor]]:
    """The architecture name, ``RobertaConfig`` arguments and ``RobertaForMaskedLM`` state dict of ``net``."""
    cfg = net.cfg
    config = config_from_trident(cfg, net.vocab_size, TARGET) | {"tie_word_embeddings": True}
    require_property(net.embed.scale == 1.0, NETWORK, SCALED_EMBEDDING, True, TARGET, "RoBERTa does not scale its embeddings")
    own = net.state_dict()
    state = backbone_to_hf(own, cfg, "roberta.")
    state |= {name: own[target] for name, target in _HEAD.items()}
    state["lm_head.decoder.weight"] = own["head.weight"]
    state["lm_head.decoder.bias"] = own["head.bias"]
    return "RobertaForMaskedLM", config, state


def writes(net: MaskedLM) -> bool:
    """A MaskedLM that declares no family is BERT's (hf_bert.writes): RoBERTa is written where declared only."""
    return False


# RobertaForSequenceClassification: its classification head (dense + tanh on <s>, then out_proj).
CLASSIFIER = ClassifierAdapter(sys.modules[__name__], "RobertaForSequenceClassification", "classifier.dense",
                               "classifier.out_proj", backbone_from_hf, backbone_to_hf, config_from_trident)
