"""Optimizer groups and learning-rate schedules."""

from __future__ import annotations

import math

import pytest
import torch

from trident.backbone import TransformerConfig
from trident.errors import ConfigError
from trident.models import CausalLM
from trident.training.optim import (
    build_optimizer,
    build_scheduler,
    check_optimizer_config,
    inverse_sqrt,
    optimizer_by_name,
    warmup_cosine,
)


def test_weight_decay_only_on_matrices() -> None:
    model = CausalLM(TransformerConfig(d_model=32, n_heads=4, n_layers=1, d_ff=64, pos_encoding="learned"), 20)
    opt = build_optimizer(
        model, {"name": "adamw", "lr": 1e-3, "weight_decay": 0.1},
        {"decoder.pos_encoding.embedding.weight"},
    )
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim == 2 for p in decay["params"])
    assert model.decoder.pos_encoding.embedding.weight in no_decay["params"]
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == sum(p.numel() for p in model.parameters())


def test_negative_learning_rate_is_rejected() -> None:
    with pytest.raises(ConfigError, match="optimizer.lr"):
        build_optimizer(torch.nn.Linear(2, 2), {"name": "adamw", "lr": -1.0})


def test_warmup_cosine_shape() -> None:
    f = warmup_cosine(10, 110, min_lr_ratio=0.1)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.55) and f(110) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)


def test_inverse_sqrt_matches_the_paper_up_to_scale() -> None:
    warmup, d_model = 4000, 512
    f = inverse_sqrt(warmup)
    peak = d_model**-0.5 * warmup**-0.5
    for step in (1, 100, 3999, 4000, 10000, 100000):
        paper = d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)
        assert f(step - 1) * peak == pytest.approx(paper)
    assert max(f(s) for s in range(20000)) == pytest.approx(1.0)


def test_scheduler_names() -> None:
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
    sched = build_scheduler(opt, {"name": "cosine", "warmup_steps": 2}, total_steps=10)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5)
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1.0)
    with pytest.raises(ConfigError, match="scheduler.name"):
        build_scheduler(opt, {"name": "linear"}, total_steps=10)
    assert math.isclose(build_scheduler(opt, {"name": "constant"}, 10).get_last_lr()[0], 1.0)


def test_optimizer_is_chosen_by_name_from_one_table() -> None:
    model = torch.nn.Linear(2, 2)
    assert type(build_optimizer(model, {"name": "sgd", "lr": 0.1, "momentum": 0.9})) is torch.optim.SGD
    with pytest.raises(ConfigError, match=r"optimizer.name='lion' is not supported: choose one of adamw, adam, sgd"):
        build_optimizer(model, {"name": "lion", "lr": 1e-3})
    with pytest.raises(ConfigError, match="optimizer=adamw: .*momentum.*remove that optimizer"):
        build_optimizer(model, {"name": "adamw", "lr": 1e-3, "momentum": 0.9})


def test_an_optimizer_saved_by_its_class_maps_to_its_name() -> None:
    assert optimizer_by_name({"_target_": "torch.optim.Adam", "lr": 0.1}) == {"name": "adam", "lr": 0.1}
    assert optimizer_by_name({"name": "sgd", "lr": 0.1}) == {"name": "sgd", "lr": 0.1}
    with pytest.raises(ConfigError, match="optimizer.name='my.Optimizer'.*adamw"):
        check_optimizer_config(optimizer_by_name({"_target_": "my.Optimizer"}))
