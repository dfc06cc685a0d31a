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

from typing import Any

import torch
from torch import Tensor

from trident.models import MaskedLM
from trident.weights.adapters import bert_like
from trident.weights.adapters.bert_like import POSITIONS, POSITIONS_KEY, Classifier, EncoderFamily, MlmHead
from trident.weights.adapters.common import require_equivalent

NAME = "RoBERTa"
PAD_ID = 1  # RobertaConfig's pad_token_id: <pad> of its byte-level BPE (<s>=0, <pad>=1, </s>=2)
HEAD = MlmHead("lm_head.dense", "lm_head.layer_norm", "lm_head.bias", "lm_head.decoder")


def backbone_from_hf(config: dict[str, Any], backbone: dict[str, Tensor], source: str) -> tuple[dict[str, Any], dict[str, Tensor], int]:
    """The ``model`` settings, the embedding and encoder tensors (trident's names) of a ``RobertaModel`` state, and
    its context (the position rows past the padding id)."""
    first = int(config.get("pad_token_id", PAD_ID)) + 1  # the row of a row's first token
    return bert_like.bert_backbone_from_hf(config, backbone, source, name=NAME, first=first)


def config_from_trident(cfg: Any, vocab_size: int, target: str) -> dict[str, Any]:
    """The ``RobertaConfig`` arguments of a stack, its positions past :data:`PAD_ID` (:func:`with_run` moves them)."""
    config = bert_like.bert_config(cfg, vocab_size, target, name=NAME, positions=cfg.max_seq_len + PAD_ID + 1, types=1)
    return config | {"pad_token_id": PAD_ID}  # the run's, where it has a tokenizer (with_run)


def backbone_to_hf(own: dict[str, Tensor], cfg: Any, prefix: str) -> dict[str, Tensor]:
    """The embedding and encoder tensors of ``own`` (a trident state dict) in ``RobertaModel``'s names under ``prefix``."""
    return bert_like.bert_backbone_to_hf(own, cfg, prefix, _behind_padding(own[POSITIONS_KEY], PAD_ID), 1)


def _behind_padding(table: Tensor, pad_id: int) -> Tensor:
    """trident's position table (T, D) behind ``pad_id + 1`` zero rows, where transformers' RoBERTa looks it up."""
    return torch.cat((table.new_zeros(pad_id + 1, table.size(1)), table))  # (pad_id + 1 + T, D)


def with_run(settings: dict[str, Any], state: dict[str, Tensor]) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """``settings`` and ``state`` of :func:`from_trident` once the run's entries are in ``settings``: the position
    table moved behind the run's padding id (its own tokenizer's; :data:`PAD_ID` for a network exported alone). A
    tokenizer without a padding token is one line: transformers would take some real token for padding."""
    pad_id = settings["pad_token_id"]
    require_equivalent(pad_id is not None, "the run's tokenizer", "without a padding token", ADAPTER.TARGET,
                       f"RoBERTa numbers its positions past the padding id: train with a tokenizer that has "
                       f"{bert_like.SPECIAL_TOKENS['pad_token']} (a masked LM's own tokenizer has one), or export as BERT (model.family=bert)")
    pad_id = int(pad_id)
    name = next(name for name in state if name.endswith(POSITIONS))
    table = state[name][PAD_ID + 1:]  # (T, D)
    return (settings | {"pad_token_id": pad_id, "max_position_embeddings": table.size(0) + pad_id + 1},
            state | {name: _behind_padding(table, pad_id)})


def writes(net: MaskedLM) -> bool:
    """A MaskedLM that declares no family is BERT's (hf_bert.writes): RoBERTa is written where declared only."""
    return False


ADAPTER = EncoderFamily(
    model_type="roberta", name=NAME,
    architectures=("RobertaForMaskedLM", "RobertaModel", "RobertaForSequenceClassification"), head=HEAD,
    backbone_from_hf=backbone_from_hf, backbone_to_hf=backbone_to_hf, config_from_trident=config_from_trident,
    writes=writes, with_run=with_run,
    # Its sequence classifier: the classification head (dense + tanh on <s>, then out_proj).
    classifier=Classifier("RobertaForSequenceClassification", "classifier.dense", "classifier.out_proj"),
)
