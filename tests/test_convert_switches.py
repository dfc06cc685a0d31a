"""The backbone switches added for exact conversion: ``model.activation=gelu_tanh`` and
``model.embedding_norm``; off by default, so that earlier models keep their tensors."""

from __future__ import annotations

import math

import pytest
import torch

from trident.backbone import ACTIVATIONS, Encoder, TransformerConfig
from trident.errors import ConfigError

SMALL = {"d_model": 16, "n_heads": 2, "n_layers": 1, "d_ff": 32, "dropout": 0.0, "pos_encoding": "learned", "max_seq_len": 8}


def test_gelu_tanh_is_the_tanh_approximation() -> None:
    x = torch.linspace(-5, 5, 101, dtype=torch.float64)
    by_hand = 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))  # GPT-2's gelu_new
    torch.testing.assert_close(ACTIVATIONS["gelu_tanh"](x), by_hand)
    assert not torch.allclose(ACTIVATIONS["gelu"](x), by_hand)  # the exact GELU differs


def test_embedding_norm_normalises_the_summed_embeddings_and_is_off_by_default() -> None:
    plain = Encoder(TransformerConfig(**SMALL))
    assert not any("embedding_norm" in name for name in plain.state_dict())  # default: no new tensors
    torch.manual_seed(0)
    normed = Encoder(TransformerConfig(**SMALL, embedding_norm=True, norm_first=False))
    x = torch.randn(2, 5, 16) * 3 + 1
    summed = x + normed.pos_encoding.embedding.weight[:5]
    first_block_input = []
    normed.blocks[0].register_forward_pre_hook(lambda _, args: first_block_input.append(args[0]))
    normed(x)
    expected = (summed - summed.mean(-1, keepdim=True)) / torch.sqrt(summed.var(-1, unbiased=False, keepdim=True) + 1e-5)
    torch.testing.assert_close(first_block_input[0], expected, atol=1e-5, rtol=1e-5)


def test_embedding_norm_must_be_a_boolean() -> None:
    with pytest.raises(ConfigError, match="model.embedding_norm must be true or false, got 'yes'"):
        TransformerConfig(**SMALL, embedding_norm="yes")  # type: ignore[arg-type]
