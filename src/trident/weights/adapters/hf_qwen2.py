"""Qwen2 (``Qwen2ForCausalLM`` / ``Qwen2Model``) <-> trident's ``CausalLM`` (task=lm): the layout of
``llama_style.py``; biases on q, k and v, none on o (model.qkv_bias=true, model.attn_out_bias=false); use_sliding_window on every
layer or none (a window in some layers only is one line)."""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer
from torch import Tensor

from trident.models import CausalLM
from trident.weights.adapters import llama_style
from trident.weights.pretrained import PretrainedWeights

FAMILY = llama_style.Family(model_type="qwen2", architecture="Qwen2ForCausalLM", target="Qwen2 (hf export)",
                            qk_norm=False, attention_bias="qkv", mlp_bias=False, window="layers")
FORMAT = "hf-qwen2"
MODEL_TYPE = FAMILY.model_type
ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen2Model")
NETWORK = CausalLM
TARGET = FAMILY.target
SPECIAL_TOKENS = llama_style.SPECIAL_TOKENS


def to_trident(config: dict[str, Any], state: dict[str, Tensor], tokenizer: Tokenizer | None, source: str) -> PretrainedWeights:
    return llama_style.to_trident(FAMILY, config, state, tokenizer, source)


def from_trident(net: CausalLM) -> tuple[str, dict[str, Any], dict[str, Tensor]]:
    return llama_style.from_trident(FAMILY, net)


def writes(net: CausalLM) -> bool:
    return llama_style.writes(FAMILY, net)
