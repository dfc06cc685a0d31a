"""``init_new_head=true``: a ViT fine-tuned from an MNIST run on scikit-learn's digits (the same ten
classes) gets the backbone of the source and a head of its own; without it a head of the same size
is kept; a head tied to the token table cannot start anew; bad values are one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trident
from trident.errors import ConfigError
from trident.runs.pipeline import train
from trident.weights.transfer import transfer_weights

from .conftest import compose_config
from .test_init_from import FROZEN, VIT, _first_val_batch, _history, _table, vit_source  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("single_thread")


def test_vit_on_digits_from_an_mnist_run_gets_the_backbone_and_a_new_head(vit_source: Path, tmp_path: Path) -> None:  # noqa: F811
    run = tmp_path / "run"
    train(compose_config([*VIT, *FROZEN, "data=digits", f"init_from={vit_source}", "init_new_head=true"], output_dir=run))
    source, tuned = trident.load(vit_source), trident.load(run)
    assert tuned.hparams.num_classes == 10 and tuned.hparams.patch_size == 7, "the source's patches on 28x28 digits"
    for name, tensor in source.net.state_dict().items():
        if not name.startswith("head."):
            assert torch.equal(tuned.net.state_dict()[name], tensor), name
    assert not torch.allclose(tuned.net.head.weight, source.net.head.weight), "the head is not the source's"
    # A new head starts as the network initialises one: zero bias (lr 1e-30 moves it by ~1e-30 at most).
    torch.testing.assert_close(tuned.net.head.bias, torch.zeros(10), atol=1e-25, rtol=0)
    assert source.net.head.bias.abs().max() > 1e-8, "the source's head bias moved: the two are told apart"

    # The first validation loss is the source's backbone with the new head, computed here by hand.
    images, labels = _first_val_batch(run)
    with torch.no_grad():
        with_source_head = F.cross_entropy(source.net(images), labels).item()
        source.net.head.load_state_dict(tuned.net.head.state_dict())
        expected = F.cross_entropy(source.net(images), labels).item()
    first_val = next(r["val/loss"] for r in _history(run) if "val/loss" in r)
    assert first_val == pytest.approx(expected, rel=1e-6)
    # Both heads are near-random (ln 10); their losses still differ by far more than the tolerance.
    assert abs(first_val - with_source_head) > 10 * 1e-6 * first_val, "the source's head would give another loss"

    rows = {(r["outcome"], r["group"]): r for r in _table(run)}
    assert rows[("new", "head")]["note"] == "init_new_head=true: 10 outputs, initialised anew"
    assert int(rows[("new", "head")]["parameters"]) == 10 * 64 + 10
    assert ("loaded", "head") not in rows and ("dropped", "head") not in rows
    assert int(rows[("loaded", "encoder.blocks")]["tensors"]) == 2 * 12


class Classifier(nn.Module):
    def __init__(self, seed: int, tie: bool = False) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(5, 4)
        self.encoder = nn.Linear(4, 4)
        self.head = nn.Linear(4, 5, bias=False) if tie else nn.Linear(4, 3)
        if tie:
            self.head.weight = self.embed.weight


def _clone(net: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in net.state_dict().items()}


def test_an_equal_class_count_keeps_the_head_unless_init_new_head() -> None:
    source = _clone(Classifier(seed=1))
    kept = Classifier(seed=2)
    rows = {(r.outcome, r.group): r for r in transfer_weights(kept, source, "src")}
    assert all(torch.equal(kept.state_dict()[name], tensor) for name, tensor in source.items())
    assert rows[("loaded", "head")].note == "kept: 3 outputs there and here (init_new_head=true starts it anew)"

    anew = Classifier(seed=2)
    initial = _clone(anew)
    rows = {(r.outcome, r.group): r for r in transfer_weights(anew, source, "src", new_head=True)}
    for name, tensor in anew.state_dict().items():
        assert torch.equal(tensor, initial[name] if name.startswith("head.") else source[name]), name
    assert (rows[("new", "head")].tensors, rows[("new", "head")].parameters) == (2, 3 * 4 + 3)
    assert ("loaded", "head") not in rows


def test_a_head_tied_to_the_token_table_cannot_start_anew() -> None:
    with pytest.raises(ConfigError, match="no head of its own .* drop init_new_head") as caught:
        transfer_weights(Classifier(seed=2, tie=True), _clone(Classifier(seed=1, tie=True)), "src", new_head=True)
    assert "\n" not in str(caught.value)


def test_init_new_head_must_be_true_or_false(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with pytest.raises(ConfigError, match="init_new_head must be true or false, got 'yes'") as caught:
        train(compose_config([*VIT, "init_new_head=yes", "logger=none"], output_dir=run))
    assert "\n" not in str(caught.value) and not (run / "config_resolved.yaml").exists()
