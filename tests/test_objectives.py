"""Objectives apart from tasks (issue 51 item 2): a task turns a batch into its network's outputs and keeps its
metrics; an objective (trident.objectives), chosen by the ``objective`` config group, turns the outputs into the
summed loss and the trained count that the one token-loss reduction takes. The losses are those the tasks computed
themselves before (tests/test_token_loss.py, test_mlm.py, test_options_act.py hold them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from trident.data.masking import IGNORE_INDEX
from trident.errors import ConfigError
from trident.objectives import OBJECTIVES, Loss, Objective, Outputs, OutputSource, build_objective
from trident.runs.pipeline import check_config
from trident.tasks.lm import LanguageModelTask
from trident.tasks.registry import TASKS
from trident.tasks.translation import TranslationTask
from trident.training.losses import label_smoothed_cross_entropy

from .conftest import CONF_DIR, compose_config
from .entry_points import run_in_process

BACKBONE = {"d_model": 8, "n_heads": 2, "n_layers": 1, "d_ff": 16, "max_seq_len": 8, "pos_encoding": "learned",
            "dropout": 0.0}


def test_the_objective_group_mirrors_the_registry_and_each_task_selects_its_default(tmp_path: Path) -> None:
    assert sorted(p.stem for p in (CONF_DIR / "objective").glob("*.yaml")) == sorted(OBJECTIVES)
    for name, task in TASKS.items():
        assert task.TRAINS_WITH and set(task.TRAINS_WITH) <= OBJECTIVES.keys(), name
        cfg = compose_config([f"task={name}"], output_dir=tmp_path)
        assert cfg.task.objective.name == task.TRAINS_WITH[0], name


@pytest.mark.parametrize(("overrides", "message"), [
    (["objective=class_label"], ("objective=class_label does not fit task=lm, whose outputs it cannot train on: "
                                "choose next_token")),
    (["task=translation", "objective=next_token"], "objective=next_token does not fit task=translation"),
    (["task.objective.name=dpo"], ("objective='dpo' is not supported: choose one of next_token, masked_tokens, "
                                  "target_sequence, class_label")),
])
def test_an_objective_that_does_not_fit_is_one_line_before_any_work(overrides: list[str], message: str,
                                                                    tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        check_config(compose_config(overrides, output_dir=tmp_path))


def test_train_py_refuses_an_objective_of_another_task_in_one_line(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    result = run_in_process("train.py", ["objective=masked_tokens", "logger=none"], tmp_path, monkeypatch)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.last_line == ("error: objective=masked_tokens does not fit task=lm, whose outputs it cannot train "
                                "on: choose next_token")


def test_an_objective_setting_it_does_not_take_is_one_line() -> None:
    with pytest.raises(ConfigError, match=r"task.objective.beta is not a setting of objective=class_label: remove it; "
                                          r"it takes label_smoothing, soft_targets"):
        build_objective({"name": "class_label", "beta": 0.1}, "vit", ("class_label",))


def test_the_choice_is_saved_with_the_hyperparameters_and_a_checkpoint_without_it_gets_the_default() -> None:
    chosen = LanguageModelTask(BACKBONE, 11, {}, {}, objective={"name": "next_token"})
    assert chosen.hparams["objective"] == {"name": "next_token"} and chosen.objective.NAME == "next_token"
    earlier = LanguageModelTask(BACKBONE, 11, {}, {})  # what load_from_checkpoint builds from an older checkpoint
    assert earlier.objective.NAME == "next_token"
    # The objective holds no weight: the state dict is the network's alone.
    assert all(key.startswith("net.") for key in chosen.state_dict())


def test_the_next_token_loss_is_summed_over_the_trained_targets_only() -> None:
    torch.manual_seed(0)
    task = LanguageModelTask(BACKBONE, 11, {}, {})
    inputs, targets = torch.randint(0, 11, (2, 8)), torch.randint(0, 11, (2, 8))
    targets[0, :5] = IGNORE_INDEX  # a chat prompt: trains nothing
    loss, outputs = task.objective(task, (inputs, targets), "val")
    assert outputs.logits.shape == (2, 8, 11) and int(loss.count) == 11
    expected = F.cross_entropy(task.net(inputs)[targets != IGNORE_INDEX], targets[targets != IGNORE_INDEX],
                               reduction="sum")
    torch.testing.assert_close(loss.summed, expected)


def test_translation_padding_is_the_one_ignored_label_and_the_nll_a_part_of_the_loss() -> None:
    torch.manual_seed(0)
    task = TranslationTask(BACKBONE, 11, {}, {}, label_smoothing=0.2)
    src, tgt_in, tgt_out = (torch.randint(3, 11, (2, 6)) for _ in range(3))
    tgt_out[1, 3:] = task.pad_id
    batch = {"src": src, "tgt_in": tgt_in, "tgt_out": tgt_out}
    loss, outputs = task.objective(task, batch, "train")
    assert (outputs.targets == IGNORE_INDEX).sum() == 3 and int(loss.count) == 9
    smoothed, nll, count = label_smoothed_cross_entropy(task.net(src, tgt_in), tgt_out, epsilon=0.2,
                                                        ignore_index=task.pad_id)
    torch.testing.assert_close(loss.summed, smoothed * count)
    torch.testing.assert_close(loss.parts["nll_loss"][0], nll)


class _AgainstAnotherNetwork(Objective):
    """The seam preference tuning takes: an objective that asks its source for a second network's outputs on the
    same batch (here the source's own, twice: a zero loss)."""

    NAME = "against_another_network"

    def forward(self, source: OutputSource, batch: Any, stage: str) -> tuple[Loss, Outputs]:
        trained = source.outputs(batch, stage)
        with torch.no_grad():
            other = source.outputs(batch, stage)
        return self.reduce(Outputs(trained.logits - other.logits, trained.targets), stage), trained

    def reduce(self, outputs: Outputs, stage: str) -> Loss:
        return Loss(outputs.logits.square().sum(), torch.tensor(outputs.targets.numel()))


def test_an_objective_may_ask_the_task_for_outputs_of_its_own() -> None:
    task = LanguageModelTask(BACKBONE, 11, {}, {})
    task.objective = _AgainstAnotherNetwork()
    batch: tuple[Tensor, Tensor] = (torch.randint(0, 11, (2, 8)), torch.randint(0, 11, (2, 8)))
    summed, count = task._loss(batch)
    assert float(summed.detach()) == 0.0 and int(count) == 16
