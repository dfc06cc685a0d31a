"""The decoding step's shortcuts change no result: dropout and stochastic depth still act in training
(they are skipped only outside it, where they return their input), and scaled embeddings stay scaled."""

from __future__ import annotations

import math

import torch
from torch import nn

from trident.backbone import Decoder, TransformerConfig
from trident.backbone.layers import TokenEmbedding


def test_dropout_and_stochastic_depth_run_in_training_only() -> None:
    cfg = TransformerConfig(d_model=16, n_heads=2, n_layers=2, d_ff=32, dropout=0.5, drop_path=0.5, max_seq_len=8)
    stack = Decoder(cfg)
    calls: list[str] = []
    modules = {"embedding dropout": stack.dropout, "block dropout": stack.blocks[1].dropout,
               "drop path": stack.blocks[1].drop_path}
    for name, module in modules.items():
        module.register_forward_hook(lambda _m, _i, _o, name=name: calls.append(name))
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0))
    stack.train()(x)
    assert set(calls) == set(modules)
    calls.clear()
    stack.eval()(x)
    assert calls == []


def test_scaled_embeddings_are_scaled_and_unscaled_ones_are_the_table() -> None:
    ids = torch.tensor([[1, 4, 2]])
    scaled, plain = TokenEmbedding(7, 16, scale=True), TokenEmbedding(7, 16)
    torch.testing.assert_close(scaled(ids), scaled.weight[ids] * math.sqrt(16), rtol=0, atol=0)
    assert torch.equal(plain(ids), plain.weight[ids]) and isinstance(plain, nn.Embedding)
