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
        cfg = compose_config([f"task={name}"], output_dir=tmp_path)
        if name == "electra":  # its two losses are the task's own: no objective group (refused: test_electra_task.py)
            assert task.TRAINS_WITH == () and cfg.task.get("objective") is None
            continue
        assert task.TRAINS_WITH and set(task.TRAINS_WITH) <= OBJECTIVES.keys(), name
        assert cfg.task.objective.name == task.TRAINS_WITH[0], name


@pytest.mark.parametrize(("overrides", "message"), [
    (["objective=class_label"], ("objective=class_label does not fit task=lm, whose outputs it cannot train on: "
                                "choose next_token")),
    (["task=translation", "objective=next_token"], "objective=next_token does not fit task=translation"),
    (["task.objective.name=simpo"], ("objective='simpo' is not supported: choose one of next_token, masked_tokens, "
                                    "target_sequence, class_label, dpo, orpo, kto")),
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
                                "on: choose next_token or dpo or orpo or kto")


def test_an_objective_setting_it_does_not_take_is_one_line() -> None:
    with pytest.raises(ConfigError, match=r"task.objective.beta is not a setting of objective=class_label: remove it; "
                                          r"it takes label_smoothing$"):
        build_objective({"name": "class_label", "beta": 0.1}, "vit", ("class_label",))


def test_soft_targets_follow_from_the_targets_not_from_a_setting_that_could_disagree(tmp_path: Path,
                                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Mixup's class probabilities or hard labels: the class_label objective reads which from the targets' shape, so
    the command line cannot set a soft-target loss on labels (a traceback at the first step)."""
    result = run_in_process("train.py", ["task=vit", "+task.objective.soft_targets=true", "logger=none"], tmp_path,
                            monkeypatch)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.last_line == ("error: task.objective.soft_targets is not a setting of objective=class_label: remove "
                                "it; it takes label_smoothing")


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


def _smoothed_cross_entropy_sum(logits: Tensor, targets: Tensor, epsilon: float) -> Tensor:
    """By hand in float64: the summed cross entropy of ``logits`` (N, V) against the smoothed one-hot target
    q = (1 - eps) * one_hot + eps / V of each label (N,) other than IGNORE_INDEX (Szegedy et al. 2016; transformers'
    LabelSmoother and F.cross_entropy(label_smoothing=eps) spread eps over all V classes alike)."""
    keep = targets != IGNORE_INDEX
    log_p = torch.log_softmax(logits.double()[keep], dim=-1)  # (n, V)
    q = F.one_hot(targets[keep], log_p.size(-1)).double() * (1 - epsilon) + epsilon / log_p.size(-1)
    return -(q * log_p).sum()


def _float64(summed: Tensor) -> float:
    return float(summed.detach().double())


def test_each_token_objective_is_its_float64_hand_computation() -> None:
    """next_token on chat-like targets (a prompt of IGNORE_INDEX), masked_tokens, and target_sequence's label
    smoothing: summed loss, count and NLL part against the definitions computed by hand in float64."""
    from trident.tasks.mlm import MaskedLanguageModelTask

    torch.manual_seed(0)
    lm = LanguageModelTask(BACKBONE, 11, {}, {})
    inputs, targets = torch.randint(0, 11, (3, 8)), torch.randint(0, 11, (3, 8))
    targets[0, :6], targets[2, 5:] = IGNORE_INDEX, IGNORE_INDEX  # a prompt, padding
    loss, outputs = lm.objective(lm, (inputs, targets), "train")
    assert int(loss.count) == 24 - 6 - 3
    expected = _smoothed_cross_entropy_sum(lm.net(inputs).flatten(0, 1), targets.flatten(), 0.0)
    assert _float64(loss.summed) == pytest.approx(float(expected), rel=1e-5)

    mlm = MaskedLanguageModelTask(BACKBONE, vocab_size=11, optimizer={}, scheduler={}, mask_id=9, pad_id=10,
                                  num_regular_tokens=9)
    masked, truth = torch.randint(0, 9, (2, 8)), torch.full((2, 8), IGNORE_INDEX)
    truth[0, 1], truth[1, 3], truth[1, 6] = 4, 2, 7
    masked[truth != IGNORE_INDEX] = mlm.mask_id
    loss, _ = mlm.objective(mlm, (masked, truth), "val")
    expected = _smoothed_cross_entropy_sum(mlm.net(masked).flatten(0, 1), truth.flatten(), 0.0)
    assert int(loss.count) == 3 and _float64(loss.summed) == pytest.approx(float(expected), rel=1e-5)

    mt = TranslationTask(BACKBONE, 11, {}, {}, label_smoothing=0.1)
    src, tgt_in, tgt_out = (torch.randint(3, 11, (2, 6)) for _ in range(3))
    tgt_out[0, 4:] = mt.pad_id
    loss, outputs = mt.objective(mt, {"src": src, "tgt_in": tgt_in, "tgt_out": tgt_out}, "train")
    logits, labels = mt.net(src, tgt_in).flatten(0, 1), outputs.targets.flatten()
    assert int(loss.count) == 10
    assert _float64(loss.summed) == pytest.approx(float(_smoothed_cross_entropy_sum(logits, labels, 0.1)), rel=1e-5)
    nll, weight = loss.parts["nll_loss"]
    assert float(nll) * int(weight) == pytest.approx(float(_smoothed_cross_entropy_sum(logits, labels, 0.0)), rel=1e-5)


@pytest.mark.parametrize("mixup", [{}, {"mixup_alpha": 0.8, "cutmix_alpha": 1.0}])
def test_the_class_label_objective_is_its_float64_hand_computation(mixup: dict[str, float]) -> None:
    """vit's training loss: hard labels smoothed by task.label_smoothing, or Mixup / CutMix soft targets (timm's
    SoftTargetCrossEntropy: -sum_c q_c log p_c, averaged over the images), summed over the images; validation the
    plain cross entropy of the hard labels."""
    from trident.models.vit import vit_geometry
    from trident.tasks.vit import ImageClassificationTask

    torch.manual_seed(0)
    vit = ImageClassificationTask({**BACKBONE, **vit_geometry(8, 4, "cls")}, {}, {}, num_classes=5, image_size=8, in_channels=1, patch_size=4,
                                  class_names=list("abcde"), mean=[0.5], std=[0.5], label_smoothing=0.1, mixup=mixup)
    images, labels = torch.randn(4, 1, 8, 8), torch.tensor([0, 3, 3, 1])
    loss, outputs = vit.objective(vit, (images, labels), "train")
    assert int(loss.count) == 4
    if mixup:  # class probabilities (B, C): each row a distribution, no class below the smoothing's eps / C
        assert outputs.targets.shape == (4, 5) and outputs.targets.min() >= 0.1 / 5 - 1e-6
        torch.testing.assert_close(outputs.targets.sum(-1), torch.ones(4))
        expected = -(outputs.targets.double() * torch.log_softmax(outputs.logits.double(), -1)).sum()
    else:
        expected = _smoothed_cross_entropy_sum(outputs.logits, labels, 0.1)
    assert _float64(loss.summed) == pytest.approx(float(expected), rel=1e-5)
    loss, outputs = vit.objective(vit, (images, labels), "val")
    assert _float64(loss.summed) == pytest.approx(float(_smoothed_cross_entropy_sum(vit.net(images), labels, 0.0)),
                                                  rel=1e-5)
