"""Qwen3 (``Qwen3ForCausalLM`` / ``Qwen3Model``) <-> trident's ``CausalLM`` (task=lm): the layout of
``llama_style.py``; q_norm / k_norm over each head before rope (model.qk_norm=true), head_dim independent of the width,
attention_bias on q, k, v and o; use_sliding_window on every layer or none."""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer
from torch import Tensor

from trident.models import CausalLM
from trident.weights.adapters import llama_style
from trident.weights.pretrained import PretrainedWeights

FAMILY = llama_style.Family(model_type="qwen3", architecture="Qwen3ForCausalLM", target="Qwen3 (hf export)",
                            qk_norm=True, attention_bias="config", mlp_bias=False, window="layers")
FORMAT = "hf-qwen3"
MODEL_TYPE = FAMILY.model_type
ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3Model")
NETWORK = CausalLM
TARGET = FAMILY.target
SPECIAL_TOKENS = llama_style.SPECIAL_TOKENS


def to_trident(config: dict[str, Any], state: dict[str, Tensor], tokenizer: Tokenizer | None, source: str) -> PretrainedWeights:
    return llama_style.to_trident(FAMILY, config, state, tokenizer, source)


def from_trident(net: CausalLM) -> tuple[str, dict[str, Any], dict[str, Tensor]]:
    return llama_style.from_trident(FAMILY, net)


def writes(net: CausalLM) -> bool:
    return llama_style.writes(FAMILY, net)
