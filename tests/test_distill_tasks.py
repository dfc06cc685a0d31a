"""Knowledge distillation (``distill=kd``, docs/distillation.md) in each task, through the config and the pipeline's
builders: the teacher read from a trident run, a Hugging Face directory or a timm file, frozen, out of the state dict
and the checkpoints, rebuilt from the run's copy; a teacher of another task or vocabulary refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig
from torch import Tensor
from torch.utils.flop_counter import FlopCounterMode

from trident.data.base import TridentDataModule
from trident.errors import ConfigError
from trident.runs.pipeline import build_data_and_task, build_trainer, check_config
from trident.tasks.base import TridentTask
from trident.tasks.networks import companions_beside
from trident.tasks.teacher import TEACHER, TEACHER_RECORD, TEACHER_WEIGHTS
from trident.weights.checkpoint_files import checkpoint_of
from trident.weights.teacher import stage_teacher

from .conftest import SMALL, compose_config
from .test_translation_train import SMALL_MT
from .test_vit_pipeline import VIT_SMALL


def save_as_run(task: TridentTask, run_dir: Path) -> Path:
    """``task`` written as a train.py run's last checkpoint (what a teacher source reads)."""
    checkpoint = {"state_dict": task.state_dict(), "hyper_parameters": dict(task.hparams)}
    task.on_save_checkpoint(checkpoint)
    (run_dir / "checkpoints").mkdir(parents=True)
    torch.save(checkpoint, run_dir / "checkpoints" / "last.ckpt")
    return run_dir


def built(cfg: DictConfig, run_dir: Path) -> TridentTask:
    """The task of ``cfg`` as train.py builds it: its teacher staged into ``run_dir`` first."""
    return built_with_data(cfg, run_dir)[1]


def built_with_data(cfg: DictConfig, run_dir: Path) -> tuple[TridentDataModule, TridentTask]:
    backbone = check_config(cfg)
    stage_teacher(type_of(cfg), cfg, run_dir, resumed=False)
    with companions_beside(run_dir):
        return build_data_and_task(cfg, backbone, "fit")


def train_steps(cfg: DictConfig, run_dir: Path, steps: int = 2) -> tuple[TridentTask, dict[str, float], dict[str, Tensor]]:
    """``steps`` training steps of the distilling task of ``cfg`` (no validation, no files): the task, its logged
    metrics and its teacher's weights before the steps."""
    datamodule, task = built_with_data(cfg, run_dir)
    before = {k: v.clone() for k, v in task.companions[TEACHER].state_dict().items()}
    trainer = build_trainer(cfg.trainer, max_steps=steps, max_epochs=1, limit_val_batches=0, num_sanity_val_steps=0,
                            logger=False, enable_checkpointing=False, callbacks=[], enable_progress_bar=False,
                            enable_model_summary=False)
    trainer.fit(task, datamodule=datamodule)
    return task, {name: float(value) for name, value in trainer.callback_metrics.items()}, before


def assert_frozen(task: TridentTask, before: dict[str, Tensor]) -> None:
    teacher = task.companions[TEACHER]
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    for name, value in teacher.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert not any("teacher" in name for name in task.state_dict())


def type_of(cfg: DictConfig) -> type[TridentTask]:
    from trident.runs.pipeline import configured_task_class

    return configured_task_class(cfg)


@pytest.fixture(scope="module")
def lm_teacher(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A trident lm run of another size than the students' (3 layers, 32 wide) on the same data and tokenizer."""
    root = tmp_path_factory.mktemp("lm_teacher")
    cfg = compose_config([*SMALL, "model.n_layers=3", "model.d_model=32"], output_dir=root / "run")
    task = build_data_and_task(cfg, check_config(cfg), "fit")[1]
    return save_as_run(task, root / "teacher")


def lm_config(tmp_path: Path, teacher: Path | str, *overrides: str) -> DictConfig:
    return compose_config([*SMALL, "distill=kd", f"distill.teacher={teacher}", *overrides], output_dir=tmp_path / "run")


def test_a_distilling_steps_model_flops_hold_the_teachers_forward(tmp_path: Path) -> None:
    """The FLOPs the Throughput callback and the budget read (flops_per_batch) of a distilling step equal torch's FLOP
    counter over the step: the student's forward and backward and the teacher's forward (a deeper, wider one)."""
    explicit = "model.attn_impl=explicit"  # the FLOP counter has no formula for the CPU flash kernel
    teacher_cfg = compose_config([*SMALL, "model.n_layers=3", "model.d_model=32", explicit],
                                 output_dir=tmp_path / "teacher_run")
    teacher = save_as_run(build_data_and_task(teacher_cfg, check_config(teacher_cfg), "fit")[1], tmp_path / "teacher")
    datamodule, task = built_with_data(lm_config(tmp_path, teacher, explicit), tmp_path / "run")
    batch = next(iter(datamodule.split_loader("train", train=True)))
    with FlopCounterMode(display=False) as counter:
        task.objective(task, batch, "train")[0].summed.backward()
    assert task.flops_per_batch(batch) == counter.get_total_flops()
    student = type_of(lm_config(tmp_path, teacher, explicit)).flops_per_batch
    task.companions = {}  # the student alone counts less by the teacher's forward
    assert student(task, batch) < counter.get_total_flops()


def test_a_distilling_classify_steps_model_flops_equal_the_flop_counter(tmp_path: Path) -> None:
    """task=classify counts what its networks compute: the [CLS] vector a network prepends (task.pool=cls on a text
    without its own class token) is one more position in every layer, and a pooler (task.pooler) one more dense layer;
    the teacher's forward counted by its own settings (a pooler, mean pooling), the student's by its own."""
    from tests.test_classify import CLASSIFY_SMALL

    explicit = "model.attn_impl=explicit"  # the FLOP counter has no formula for the CPU flash kernel
    teacher_cfg = compose_config([*CLASSIFY_SMALL, "model.n_layers=1", "model.d_model=32", "task.pool=mean",
                                  "task.pooler=true", explicit], output_dir=tmp_path / "teacher_run")
    teacher = save_as_run(build_data_and_task(teacher_cfg, check_config(teacher_cfg), "fit")[1], tmp_path / "teacher")
    cfg = compose_config([*CLASSIFY_SMALL, "distill=kd", f"distill.teacher={teacher}", "task.pooler=gelu", explicit],
                         output_dir=tmp_path / "run")
    datamodule, task = built_with_data(cfg, tmp_path / "run")
    assert task.net.prepends_cls and not task.companions[TEACHER].prepends_cls
    batch = next(iter(datamodule.split_loader("train", train=True)))
    with FlopCounterMode(display=False) as counter:
        task.objective(task, batch, "train")[0].summed.backward()
    assert task.flops_per_batch(batch) == counter.get_total_flops()


def test_the_lm_teacher_is_frozen_and_out_of_the_state_dict(tmp_path: Path, lm_teacher: Path) -> None:
    task = built(lm_config(tmp_path, lm_teacher), tmp_path / "run")
    teacher = task.companions[TEACHER]
    assert teacher.cfg.n_layers == 3 and not teacher.training
    assert not any(p.requires_grad for p in teacher.parameters())
    assert not any("teacher" in name for name in task.state_dict())
    source = torch.load(lm_teacher / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    for name, value in teacher.state_dict().items():
        assert torch.equal(value, source[f"net.{name}"])
    assert json.loads((tmp_path / "run" / TEACHER_RECORD).read_text())["task"] == "lm"


@pytest.fixture(scope="module")
def timm_teacher(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """A timm ViT file (random weights) for MNIST: 28-pixel single-channel images in 14-pixel patches (the student's
    are 7), 10 classes, 2 heads of 32 channels (which the file does not record: distill.n_heads=2)."""
    import timm
    from safetensors.torch import save_file

    torch.manual_seed(3)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=28, patch_size=14, in_chans=1,
                              embed_dim=64, depth=1, num_heads=2, num_classes=10).eval()
    path = tmp_path_factory.mktemp("timm_teacher") / "vit.safetensors"
    save_file(model.state_dict(), str(path))
    return path, model


def test_a_vit_distils_from_a_timm_file(tmp_path: Path, timm_teacher: tuple[Path, torch.nn.Module]) -> None:
    path, reference = timm_teacher
    cfg = compose_config([*VIT_SMALL, "distill=kd", f"distill.teacher={path}", "distill.n_heads=2"],
                         output_dir=tmp_path / "run")
    task, metrics, before = train_steps(cfg, tmp_path / "run")
    images = torch.randn(3, 1, 28, 28)
    with torch.no_grad():  # the teacher is timm's network
        torch.testing.assert_close(task.companions[TEACHER](images), reference(images), atol=1e-5, rtol=1e-5)
    assert_frozen(task, before)
    assert {"train/loss", "train/label_loss", "train/distill_loss"} <= metrics.keys()
    assert metrics["train/loss"] == pytest.approx(0.5 * metrics["train/label_loss"] + 0.5 * metrics["train/distill_loss"],
                                                  rel=1e-5)


def test_translation_distils_from_a_trident_run(tmp_path: Path) -> None:
    teacher_cfg = compose_config([*SMALL_MT, "model.n_layers=1"], output_dir=tmp_path / "teacher_run")
    teacher = save_as_run(build_data_and_task(teacher_cfg, check_config(teacher_cfg), "fit")[1], tmp_path / "teacher")
    cfg = compose_config([*SMALL_MT, "distill=kd", f"distill.teacher={teacher}", "distill.weight=0.8"],
                         output_dir=tmp_path / "run")
    task, metrics, before = train_steps(cfg, tmp_path / "run")
    assert task.companions[TEACHER].cfg.n_layers == 1 and task.net.cfg.n_layers == 2
    assert_frozen(task, before)
    assert {"train/label_loss", "train/distill_loss", "train/nll_loss"} <= metrics.keys()
    assert metrics["train/loss"] == pytest.approx(0.2 * metrics["train/label_loss"] + 0.8 * metrics["train/distill_loss"],
                                                  rel=1e-5)


def test_classify_distils_from_a_trident_run_with_hard_labels(tmp_path: Path) -> None:
    from tests.test_classify import CLASSIFY_SMALL

    teacher_cfg = compose_config([*CLASSIFY_SMALL, "model.n_layers=1"], output_dir=tmp_path / "teacher_run")
    teacher = save_as_run(build_data_and_task(teacher_cfg, check_config(teacher_cfg), "fit")[1], tmp_path / "teacher")
    cfg = compose_config([*CLASSIFY_SMALL, "distill=kd", f"distill.teacher={teacher}", "distill.divergence=hard"],
                         output_dir=tmp_path / "run")
    task, metrics, before = train_steps(cfg, tmp_path / "run")
    record = json.loads((tmp_path / "run" / TEACHER_RECORD).read_text())
    assert record["class_names"] == task.class_names and record["vocabulary"] is not None
    assert_frozen(task, before)
    assert metrics["train/loss"] == pytest.approx(0.5 * metrics["train/label_loss"] + 0.5 * metrics["train/distill_loss"],
                                                  rel=1e-5)


def test_an_lm_distils_from_a_hugging_face_directory(tmp_path: Path, lm_teacher: Path) -> None:
    """A GPT-2 directory (random weights, the students' vocabulary size, no tokenizer files: the size alone is
    compared) read by the GPT-2 adapter into the teacher: its logits are transformers'."""
    import transformers

    vocab = int(torch.load(checkpoint_of(lm_teacher), weights_only=True)["hyper_parameters"]["vocab_size"])
    torch.manual_seed(4)
    config = transformers.GPT2Config(vocab_size=vocab, n_positions=64, n_embd=32, n_layer=1, n_head=2)
    reference = transformers.GPT2LMHeadModel(config).eval()
    reference.save_pretrained(tmp_path / "gpt2")
    task, metrics, before = train_steps(lm_config(tmp_path, tmp_path / "gpt2"), tmp_path / "run", steps=1)
    ids = torch.randint(0, vocab, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(task.companions[TEACHER](ids), reference(ids).logits, atol=1e-5, rtol=1e-5)
    assert_frozen(task, before)
    assert metrics["train/distill_loss"] > 0


def refused(cfg: DictConfig, tmp_path: Path) -> str:
    with pytest.raises(ConfigError) as caught:
        built(cfg, tmp_path / "run")
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_a_teacher_of_another_task_is_refused(tmp_path: Path, lm_teacher: Path,
                                              timm_teacher: tuple[Path, torch.nn.Module]) -> None:
    assert "holds a task=vit model: task=lm distils from a lm teacher only" in refused(
        lm_config(tmp_path, timm_teacher[0]), tmp_path)
    vit = compose_config([*VIT_SMALL, "distill=kd", f"distill.teacher={lm_teacher}"], output_dir=tmp_path / "run")
    assert "holds a task=lm model: task=vit distils from a vit teacher only" in refused(vit, tmp_path)


def test_a_teacher_of_another_vocabulary_is_refused(tmp_path: Path, lm_teacher: Path) -> None:
    # The teacher reads characters; this student a byte-level BPE of 300 tokens.
    message = refused(lm_config(tmp_path, lm_teacher, "data.tokenizer=bpe", "data.vocab_size=300"), tmp_path)
    assert "scores" in message and "tokens, the student 300" in message and "data.tokenizer=" in message


@pytest.mark.slow
def test_train_py_distils_an_lm_from_a_trident_run(tmp_path: Path, lm_reference_run: tuple[Path, dict[str, float]]) -> None:
    """train.py, 3 steps, from the shared reference lm run (4 heads, ALiBi) into a 1-layer RoPE student: the losses
    logged apart, the teacher copied into the run and out of its checkpoints; trident.load reads the student alone,
    and a resume of the run (after that load) builds the teacher again from its copy and distils on."""
    import csv

    from safetensors.torch import load_file

    import trident
    from tests.shared_runs import assert_clean, run_script
    from trident.runs.pipeline import train

    teacher_run = lm_reference_run[0]
    teacher = tmp_path / "teacher"  # the shared run, by a name that goes away
    teacher.symlink_to(teacher_run, target_is_directory=True)
    run_dir = tmp_path / "student"
    result = run_script("train.py", *SMALL, "trainer.max_steps=3", "model.n_layers=1", "distill=kd",
                        f"distill.teacher={teacher}", "distill.temperature=1.5", "logger=csv", "test=false",
                        f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert_clean(result)
    rows = [row for path in run_dir.rglob("metrics.csv") for row in csv.DictReader(path.open()) if row.get("train/loss")]
    assert len(rows) == 3
    for row in rows:
        total, label, soft = (float(row[f"train/{name}"]) for name in ("loss", "label_loss", "distill_loss"))
        assert total == pytest.approx(0.5 * label + 0.5 * soft, rel=1e-5) and soft > 0
    source = torch.load(checkpoint_of(teacher_run), weights_only=True)["state_dict"]
    for checkpoint in (run_dir / "checkpoints").glob("*.ckpt"):
        saved = torch.load(checkpoint, weights_only=True)["state_dict"]
        assert saved and all(name.startswith("net.") for name in saved)  # the student's network alone
        assert sum(value.numel() for value in saved.values()) < sum(value.numel() for value in source.values())
    loaded = trident.load(run_dir)
    assert loaded.companions == {} and loaded.net.cfg.n_layers == 1  # evaluation and export: the student alone
    copy = load_file(str(run_dir / TEACHER_WEIGHTS))
    assert copy and all(torch.equal(value, source[f"net.{name}"]) for name, value in copy.items())
    teacher.unlink()  # the source gone: the resume reads the run's copy
    resumed = train(compose_config([*SMALL, "trainer.max_steps=4", "model.n_layers=1", "distill=kd",
                                    f"distill.teacher={teacher}", "distill.temperature=1.5", "test=false",
                                    f"resume={run_dir}"], output_dir=run_dir))
    assert resumed["train/distill_loss"] > 0  # the teacher's term: it was built again
