"""Knowledge distillation (``distill=kd``, docs/distillation.md): the loss against a hand computation in float64, an
accumulated (and a 2-rank DDP) step equal to one on the global batch with the teacher unmoved, and the bad settings,
one line each. The teacher inside each task, built from its sources: tests/test_distill_tasks.py."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from trident.backbone import TransformerConfig
from trident.errors import ConfigError
from trident.models import CausalLM
from trident.objectives import ClassLabel, NextToken, Outputs, TargetSequence
from trident.objectives.distillation import Distillation, DistillSettings, TaughtOutputs
from trident.runs.pipeline import check_config
from trident.tasks.networks import companions_beside
from trident.tasks.teacher import TEACHER, TEACHER_RECORD, TEACHER_WEIGHTS

from .conftest import SMALL, compose_config
from .test_vit_pipeline import VIT_SMALL

IGNORE = -100


def settings(divergence: str = "forward_kl", temperature: float = 2.0, weight: float = 0.3) -> DistillSettings:
    return DistillSettings("teacher", temperature, weight, divergence)


def hand_kl(student: torch.Tensor, teacher: torch.Tensor, temperature: float, reverse: bool = False) -> torch.Tensor:
    """KL(p || q) * T^2 per row, written out: p the teacher's tempered softmax (reverse: the student's)."""
    p_t = torch.softmax(teacher.double() / temperature, -1)
    p_s = torch.softmax(student.double() / temperature, -1)
    p, q = (p_s, p_t) if reverse else (p_t, p_s)
    return (p * (p.log() - q.log())).sum(-1) * temperature**2


@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl"])
def test_token_loss_equals_a_hand_computation(divergence: str) -> None:
    torch.manual_seed(0)
    student, teacher = torch.randn(2, 5, 7, dtype=torch.float64), torch.randn(2, 5, 7, dtype=torch.float64)
    targets = torch.randint(0, 7, (2, 5))
    targets[0, :2] = IGNORE  # a chat prompt's tokens
    targets[1, 4] = IGNORE  # padding
    chosen = settings(divergence)
    loss = Distillation(NextToken(), chosen).reduce(TaughtOutputs(student, targets, teacher=teacher), "train")
    kept = targets.ne(IGNORE)
    nll = F.cross_entropy(student[kept], targets[kept], reduction="sum")
    soft = hand_kl(student[kept], teacher[kept], 2.0, reverse=divergence == "reverse_kl").sum()
    assert int(loss.count) == int(kept.sum()) == 7
    # The teacher's term in float64 as given; next_token's cross entropy is float32 (its logits cast up, not down).
    torch.testing.assert_close(loss.parts["distill_loss"][0], soft / 7, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(loss.parts["label_loss"][0].double(), nll / 7, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(loss.summed.double(), 0.7 * nll + 0.3 * soft, rtol=1e-6, atol=1e-6)
    # Validation scores the labels alone: the number compared with a student trained without a teacher.
    torch.testing.assert_close(Distillation(NextToken(), chosen).reduce(
        TaughtOutputs(student, targets, teacher=teacher), "val").summed.double(), nll, rtol=1e-6, atol=1e-6)


def test_translation_loss_keeps_its_label_smoothing_and_nll() -> None:
    torch.manual_seed(1)
    student, teacher = torch.randn(3, 4, 9, dtype=torch.float64), torch.randn(3, 4, 9, dtype=torch.float64)
    targets = torch.randint(0, 9, (3, 4))
    targets[2, 2:] = IGNORE
    label = TargetSequence(label_smoothing=0.1)
    loss = Distillation(label, settings(weight=0.5)).reduce(TaughtOutputs(student, targets, teacher=teacher), "train")
    plain = label.reduce(Outputs(student, targets), "train")
    kept = targets.ne(IGNORE)
    torch.testing.assert_close(loss.summed, 0.5 * plain.summed + 0.5 * hand_kl(student[kept], teacher[kept], 2.0).sum())
    assert "nll_loss" in loss.parts


def test_example_loss_equals_a_hand_computation_with_hard_labels_and_mixup() -> None:
    torch.manual_seed(2)
    student, teacher = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    labels = torch.tensor([0, 2, 1, 2])
    loss = Distillation(ClassLabel(), settings(temperature=4.0, weight=0.9)).reduce(
        TaughtOutputs(student, labels, teacher=teacher), "train")
    expected = 0.1 * F.cross_entropy(student, labels, reduction="sum") + 0.9 * hand_kl(student, teacher, 4.0).sum()
    torch.testing.assert_close(loss.summed, expected)
    assert int(loss.count) == 4
    # Mixup's class probabilities: every example trains.
    soft = torch.softmax(torch.randn(4, 3, dtype=torch.float64), -1)
    mixed = Distillation(ClassLabel(), settings(weight=1.0)).reduce(TaughtOutputs(student, soft, teacher=teacher), "train")
    torch.testing.assert_close(mixed.summed, hand_kl(student, teacher, 2.0).sum())
    # DeiT's hard distillation, through a second head (the distillation token's): the teacher's argmax as its label.
    taught = torch.randn(4, 3, dtype=torch.float64)
    hard = Distillation(ClassLabel(), settings("hard", weight=0.5)).reduce(
        TaughtOutputs(student, labels, teacher=teacher, taught=taught), "train")
    expected = 0.5 * F.cross_entropy(student, labels, reduction="sum") + 0.5 * F.cross_entropy(
        taught, teacher.argmax(-1), reduction="sum")
    torch.testing.assert_close(hard.summed, expected)


def hand_staged_teacher(folder: Path, vocab: int) -> CausalLM:
    """A random lm teacher (2 layers, 24 wide) recorded in ``folder`` as a run stages one (trident.weights.teacher)."""
    from safetensors.torch import save_file

    from tests.test_token_loss import BACKBONE

    backbone = {**BACKBONE, "d_model": 24, "n_layers": 2, "d_ff": 48}
    torch.manual_seed(5)
    teacher = CausalLM(TransformerConfig(**backbone), vocab, tie_embeddings=True)
    (folder / "init").mkdir(parents=True, exist_ok=True)
    save_file({k: v.clone().contiguous() for k, v in teacher.state_dict().items()}, str(folder / TEACHER_WEIGHTS))
    record = {"task": "lm", "builder": "trident.tasks.lm.LanguageModelTask", "backbone": vars(TransformerConfig(**backbone)),
              "settings": {"vocab_size": vocab, "tie_embeddings": True, "scale_embeddings": False},
              "vocab_size": vocab, "vocabulary": None, "num_classes": None, "class_names": None}
    (folder / TEACHER_RECORD).write_text(json.dumps(record))
    return teacher.eval()


def test_an_accumulated_step_is_the_mean_over_the_global_batch_and_the_teacher_never_moves(tmp_path: Path) -> None:
    """Micro-batches of 1 and 16 trained tokens, accumulated, step as plain autograd on the mean over the 17 of
    (1 - w) * cross entropy + w * T^2 * KL (SGD at lr 1: the step is minus the gradient); the teacher is unchanged."""
    from tests.test_token_loss import BACKBONE, VOCAB, SGDLanguageModel, micro_batches, one_step

    expected_teacher = hand_staged_teacher(tmp_path, VOCAB)
    distill = {"name": "kd", "teacher": "a run", "temperature": 2.0, "weight": 0.25, "divergence": "forward_kl"}
    torch.manual_seed(0)
    with companions_beside(tmp_path):
        task = SGDLanguageModel(BACKBONE, VOCAB, {"lr": 1.0}, {"name": "constant"}, distill=distill)
    teacher = task.companions[TEACHER]
    first, second = micro_batches()
    inputs, targets = torch.cat([first[0], second[0]]), torch.cat([first[1], second[1]])
    reference = copy.deepcopy(task)
    logits, kept = reference.net(inputs), targets.ne(IGNORE)
    with torch.no_grad():
        teacher_logits = expected_teacher(inputs)
    soft = (torch.softmax(teacher_logits[kept] / 2, -1) * (torch.log_softmax(teacher_logits[kept] / 2, -1)
            - torch.log_softmax(logits[kept] / 2, -1))).sum(-1) * 4
    (0.75 * F.cross_entropy(logits[kept], targets[kept]) + 0.25 * soft.mean()).backward()
    stepped = one_step(task, [first, second], 2)
    for name, param in reference.net.named_parameters():
        expected = param.detach() - param.grad
        torch.testing.assert_close(stepped[name], expected, rtol=1e-4, atol=1e-6 * float(param.grad.abs().max()))
    whole = one_step(copy.deepcopy(reference), [(inputs, targets)], 1)
    assert float(stepped["train/loss"]) == pytest.approx(float(whole["train/loss"]), rel=1e-5)
    for name, value in expected_teacher.state_dict().items():
        assert torch.equal(teacher.state_dict()[name], value), name
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    assert not any(name.startswith("companions") or "teacher" in name for name in task.state_dict())


def test_a_teacher_of_the_same_size_but_other_tokens_is_refused(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models

    from tests.test_token_loss import BACKBONE, VOCAB, SGDLanguageModel

    hand_staged_teacher(tmp_path, VOCAB)
    record = json.loads((tmp_path / TEACHER_RECORD).read_text())
    (tmp_path / TEACHER_RECORD).write_text(json.dumps({**record, "vocabulary": "another tokenizer's"}))
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    with companions_beside(tmp_path), pytest.raises(ConfigError, match="has another tokenizer than the student's"):
        SGDLanguageModel(BACKBONE, VOCAB, {"lr": 1.0}, {"name": "constant"}, tokenizer_json=tokenizer.to_str(),
                         distill={"name": "kd", "teacher": "a run"})


def test_a_teacher_of_other_classes_is_refused(tmp_path: Path) -> None:
    from trident.tasks.teacher import check_classes

    with pytest.raises(ConfigError, match="scores 5 classes, the student 10"):
        check_classes("t", {"num_classes": 5}, [str(i) for i in range(10)])
    with pytest.raises(ConfigError, match="other classes than the student's \\(class 1: 'b', the student's 'x'\\)"):
        check_classes("t", {"num_classes": 2, "class_names": ["a", "b"]}, ["a", "x"])


@pytest.mark.parametrize(("overrides", "match"), [
    ([*SMALL, "distill=kd"], "distill=kd needs its teacher: set distill.teacher="),
    ([*SMALL, "distill.teacher=x"], "distill.teacher=x is set but distillation is off: add distill=kd"),
    ([*VIT_SMALL, "distill=kd", "distill.teacher=x", "distill.divergence=reverse_kl"],
     "distill.divergence=reverse_kl is for task=lm, not task=vit: choose forward_kl or hard"),
    ([*SMALL, "distill=kd", "distill.teacher=x", "distill.divergence=hard"],
     "distill.divergence=hard is for task=classify or task=vit, not task=lm: choose forward_kl or reverse_kl"),
    ([*SMALL, "distill=kd", "distill.teacher=x", "distill.weight=1.5"], r"distill.weight=1.5 must lie in \[0, 1\]"),
    ([*SMALL, "distill=kd", "distill.teacher=x", "distill.temperature=0"], "distill.temperature=0 must be a positive"),
    ([*SMALL, "distill=kd", "distill.teacher=x", "+distill.alpha=1"], "distill.alpha is not a setting of distill=kd"),
    (["task=mlm", "model=nano", "distill=kd", "distill.teacher=x"],
     "distill=kd is for task=lm, classify, vit and translation, not task=mlm"),
    (["model=nano", "data=preference", "objective=orpo", "distill=kd", "distill.teacher=x"],
     "adds a teacher's term to the task's label loss, not to objective=orpo"),
])
def test_bad_distill_settings_are_refused_before_any_work(overrides: list[str], match: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=match):
        check_config(compose_config(overrides, output_dir=tmp_path / "run"))


@pytest.mark.slow
def test_two_ddp_ranks_of_1_and_16_tokens_step_like_one_process_on_the_17(tmp_path: Path) -> None:
    """2 gloo ranks, one micro-batch each (1 and 16 trained tokens): the distilled step equals one process's on both
    as one batch (the teacher's term, like the labels', a mean over the global batch's tokens, not of rank means)."""
    import lightning as L
    from torch.utils.data import DataLoader

    from tests.test_token_loss import BACKBONE, VOCAB, RankBatches, SGDLanguageModel, micro_batches, one_step

    hand_staged_teacher(tmp_path, VOCAB)
    distill = {"name": "kd", "teacher": "a run", "temperature": 2.0, "weight": 0.25, "divergence": "reverse_kl"}
    torch.manual_seed(0)
    with companions_beside(tmp_path):
        task = SGDLanguageModel(BACKBONE, VOCAB, {"lr": 1.0}, {"name": "constant"}, distill=distill)
    first, second = micro_batches()
    expected = one_step(copy.deepcopy(task), [(torch.cat([first[0], second[0]]), torch.cat([first[1], second[1]]))], 1)
    ranks = copy.deepcopy(task)
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, accelerator="cpu", devices=2,
                        strategy="ddp_spawn", use_distributed_sampler=False)
    trainer.fit(ranks, DataLoader(RankBatches([[first], [second]]), batch_size=None, shuffle=False))
    start = task.net.state_dict()
    for name, value in ranks.net.state_dict().items():  # ddp_spawn hands rank 0's weights back
        step = expected[name] - start[name]
        torch.testing.assert_close(value - start[name], step, rtol=1e-4, atol=1e-6 * float(step.abs().max()) + 1e-12)
