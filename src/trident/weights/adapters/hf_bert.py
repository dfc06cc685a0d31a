"""BERT (``BertForMaskedLM`` / ``BertModel``) <-> trident's ``MaskedLM`` (a masked-LM encoder).

BERT is a post-norm encoder (LayerNorm eps 1e-12) with learned positions whose summed token,
position and token-type embeddings pass a LayerNorm first (trident's ``model.embedding_norm``).
trident has no token types: every input is type 0, so type 0's vector is folded into the position
table when reading, and zero type vectors are written back. The MLM head (dense -> GELU ->
LayerNorm -> tied decoder with its own bias) is trident's ``transform`` and ``head``.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from trident.models import MaskedLM
from trident.weights.adapters import bert_like
from trident.weights.adapters.bert_like import EncoderFamily, MlmHead

NAME = "BERT"
TOKEN_TYPES = 2  # BERT's sentence A / sentence B
HEAD = MlmHead("cls.predictions.transform.dense", "cls.predictions.transform.LayerNorm", "cls.predictions.bias",
               "cls.predictions.decoder")


def backbone_from_hf(config: dict[str, Any], backbone: dict[str, Tensor], source: str) -> tuple[dict[str, Any], dict[str, Tensor], int]:
    """The ``model`` settings, the embedding and encoder tensors (trident's names) of a ``BertModel`` state, and its
    context."""
    return bert_like.bert_backbone_from_hf(config, backbone, source, name=NAME)


def backbone_to_hf(own: dict[str, Tensor], cfg: Any, prefix: str) -> dict[str, Tensor]:
    """The embedding and encoder tensors of ``own`` (a trident state dict) in ``BertModel``'s names under ``prefix``."""
    return bert_like.bert_backbone_to_hf(own, cfg, prefix, own[bert_like.POSITIONS_KEY], TOKEN_TYPES)


def config_from_trident(cfg: Any, vocab_size: int, target: str) -> dict[str, Any]:
    """The ``BertConfig`` arguments of a stack (BERT's refusals named for ``target``)."""
    return bert_like.bert_config(cfg, vocab_size, target, name=NAME, positions=cfg.max_seq_len, types=TOKEN_TYPES)


def writes(net: MaskedLM) -> bool:
    """Every MaskedLM without ALBERT's switches (hf_albert.writes) is written as BERT (its refusals name what BERT
    lacks)."""
    return net.cfg.embedding_dim is None and net.cfg.share_layers in (False, None)


ADAPTER = EncoderFamily(model_type="bert", name=NAME, architectures=("BertForMaskedLM", "BertModel"), head=HEAD,
                        backbone_from_hf=backbone_from_hf, backbone_to_hf=backbone_to_hf,
                        config_from_trident=config_from_trident, writes=writes)
