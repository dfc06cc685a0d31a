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

from typing import Any

from torch import Tensor

from trident.models import MaskedLM
from trident.weights.adapters import bert_like
from trident.weights.adapters.bert_like import POSITIONS_KEY, Classifier, EncoderFamily, MlmHead
from trident.weights.adapters.common import (
    activation_from_hf,
    activation_to_hf,
    encoder_settings,
    layer_from_hf,
    layer_to_hf,
    require_equivalent,
    require_hf_block,
    require_source,
)

NAME = "ALBERT"
TOKEN_TYPES = 2  # ALBERT's sentence A / sentence B
HEAD = MlmHead("predictions.dense", "predictions.LayerNorm", "predictions.bias", "predictions.decoder")

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
# The factorised embedding's projection to the width beside BERT's embedding tensors.
_EMBEDDINGS = bert_like.EMBEDDINGS | {
    "encoder.embedding_hidden_mapping_in.weight": "encoder.embedding_projection.weight",
    "encoder.embedding_hidden_mapping_in.bias": "encoder.embedding_projection.bias",
}


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
    bert_like.require_absolute(config, source)
    share = share_layers_of(config, source)
    groups = int(config.get("num_hidden_groups", 1))
    out = bert_like.embeddings_from_hf(backbone, _EMBEDDINGS)
    for g in range(groups):
        out |= layer_from_hf(backbone, _group(g), f"encoder.blocks.{g}", _LAYER, "attention")
    model = encoder_settings(config, activation=activation_from_hf(config.get("hidden_act", "gelu_new"), source),
                             norm_first=False, embedding_norm=True)
    settings = model | {"share_layers": share, "embedding_dim": int(config.get("embedding_size", 128))}
    return settings, out, int(config["max_position_embeddings"])


def config_from_trident(cfg: Any, vocab_size: int, target: str) -> dict[str, Any]:
    """The ``AlbertConfig`` arguments of a stack (ALBERT's refusals named for ``target``)."""
    require_hf_block(cfg, target, norm_first=False, embedding_norm=True, shared=True)
    require_equivalent(cfg.embedding_dim is not None, "model.embedding_dim", cfg.embedding_dim, target,
                       "ALBERT projects a factorised embedding to the width (train with model.embedding_dim, e.g. 128)")
    config = bert_like.encoder_config(cfg, vocab_size, activation=activation_to_hf(cfg.activation, target),
                                      positions=cfg.max_seq_len, types=TOKEN_TYPES)
    return config | {"embedding_size": cfg.embedding_dim, "num_hidden_groups": cfg.block_of_layer[-1] + 1,
                     "inner_group_num": 1}


def backbone_to_hf(own: dict[str, Tensor], cfg: Any, prefix: str) -> dict[str, Tensor]:
    """The embedding and encoder tensors of ``own`` (a trident state dict) in ``AlbertModel``'s names under ``prefix``."""
    state = bert_like.embeddings_to_hf(own, _EMBEDDINGS, prefix, own[POSITIONS_KEY], TOKEN_TYPES)
    for g in range(cfg.block_of_layer[-1] + 1):
        state |= layer_to_hf(own, f"encoder.blocks.{g}", f"{prefix}{_group(g)}", _LAYER, "attention")
    return state


def writes(net: MaskedLM) -> bool:
    """A MaskedLM whose stack declares no family is ALBERT where it has ALBERT's switches (else BERT)."""
    return net.cfg.embedding_dim is not None or net.cfg.share_layers not in (False, None)


ADAPTER = EncoderFamily(
    model_type="albert", name=NAME,
    architectures=("AlbertForMaskedLM", "AlbertModel", "AlbertForPreTraining", "AlbertForSequenceClassification"),
    head=HEAD, backbone_from_hf=backbone_from_hf, backbone_to_hf=backbone_to_hf,
    config_from_trident=config_from_trident, writes=writes,
    # Its sequence classifier: the pooler (dense + tanh on [CLS]) and the classifier.
    classifier=Classifier("AlbertForSequenceClassification", "albert.pooler", "classifier"),
)
