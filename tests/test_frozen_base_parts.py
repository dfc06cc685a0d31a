"""The parts of a LoRA run's checkpoints without their frozen base (trident.weights.frozen_base,
trident.weights.sources.find_base), each on a value that tells a wrong answer apart."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from trident.tasks.frozen_base import FrozenBase
from trident.weights import sources
from trident.weights.frozen_base import fingerprint, frozen_base_of
from trident.weights.pretrained import PretrainedWeights


def test_the_fingerprint_tells_a_reshaped_tensor_with_the_same_bytes_apart() -> None:
    values = torch.arange(12, dtype=torch.float32)
    assert fingerprint({"w": values.reshape(3, 4)}, ["w"]) != fingerprint({"w": values.reshape(4, 3)}, ["w"])
    assert fingerprint({"w": values}, ["w"]) != fingerprint({"w": values.double()}, ["w"])
    assert fingerprint({"w": values}, ["w"]) == fingerprint({"w": values.clone()}, ["w"])


def test_the_base_is_the_frozen_parameters_that_hold_the_source_unchanged() -> None:
    """A trainable parameter equal to the source at the start (a head the run trains) stays in the checkpoints; so
    does a frozen one the source gave otherwise (resampled) or not at all."""
    net = nn.ModuleDict({"frozen": nn.Linear(3, 3), "trained": nn.Linear(3, 3), "resampled": nn.Linear(3, 3),
                         "new": nn.Linear(3, 3)})
    for name in ("frozen", "resampled", "new"):
        net[name].requires_grad_(False)
    weights = {k: v.clone() for k, v in net.state_dict().items() if not k.startswith("new.")}
    weights["resampled.weight"] = weights["resampled.weight"] + 1
    base = frozen_base_of(net, "/source", weights)
    assert base.names == ["frozen.weight", "frozen.bias", "resampled.bias"]
    assert base.fingerprint == fingerprint(weights, base.names) and base.in_net


def test_a_base_is_found_in_the_runs_own_copy_before_the_recorded_source(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """``<run>/init`` (beside the checkpoint) first: the recorded source may have moved or changed since."""
    run = tmp_path / "run"
    (run / "init").mkdir(parents=True)
    (run / "init" / "source.json").write_text(json.dumps({}))
    base = {"w": torch.ones(2)}
    monkeypatch.setenv("TRIDENT_BASE", str(tmp_path / "elsewhere"))  # there, but another base
    (tmp_path / "elsewhere").mkdir()
    read = {str(run / "init"): base, str(tmp_path / "elsewhere"): {"w": torch.zeros(2)}}
    monkeypatch.setattr(sources, "read_init_source", lambda path, n_heads=None: PretrainedWeights(
        source=path, format="trident", task="lm", model={}, pos_encoding="rope", task_options={}, data_options={},
        state_dict=read[path], tokenizer=None))
    wanted = FrozenBase(str(tmp_path / "moved-away"), ["w"], fingerprint(base, ["w"]))
    found = sources.find_base(wanted, run / "checkpoints" / "last.ckpt")
    torch.testing.assert_close(found["w"], base["w"])
