"""Llama (``LlamaForCausalLM`` / ``LlamaModel``) <-> trident's ``CausalLM`` (task=lm): the layout of
``llama_style.py``; attention_bias (biases on q, k, v and o) and mlp_bias read and written; no sliding window, no QK-norm."""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer
from torch import Tensor

from trident.models import CausalLM
from trident.weights.adapters import llama_style
from trident.weights.pretrained import PretrainedWeights

FAMILY = llama_style.Family(model_type="llama", architecture="LlamaForCausalLM", target="Llama (hf export)",
                            qk_norm=False, attention_bias="config", mlp_bias=True, window="none")
FORMAT = "hf-llama"
MODEL_TYPE = FAMILY.model_type
ARCHITECTURES = ("LlamaForCausalLM", "LlamaModel")
NETWORK = CausalLM
TARGET = FAMILY.target
SPECIAL_TOKENS = llama_style.SPECIAL_TOKENS


def to_trident(config: dict[str, Any], state: dict[str, Tensor], tokenizer: Tokenizer | None, source: str) -> PretrainedWeights:
    return llama_style.to_trident(FAMILY, config, state, tokenizer, source)


def from_trident(net: CausalLM) -> tuple[str, dict[str, Any], dict[str, Tensor]]:
    return llama_style.from_trident(FAMILY, net)


def writes(net: CausalLM) -> bool:
    return llama_style.writes(FAMILY, net)
