"""task=vit: exact resume with augmented image batches (like the LM and translation in
test_resume.py), and eval.py on the best checkpoint reproducing the run's own test metrics."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trident.commands.evaluate import evaluate
from trident.runs.pipeline import train

from .conftest import compose_config
from .test_resume import WITH_CSV, train_losses
from .test_vit_pipeline import VIT_SMALL

pytestmark = pytest.mark.usefixtures("single_thread")


def periodic_checkpoints(directory: Path) -> list[str]:
    """Keep a checkpoint every 3 steps (mid-epoch: epochs of 4 batches below)."""
    return ["+callbacks.periodic._target_=lightning.pytorch.callbacks.ModelCheckpoint", f"+callbacks.periodic.dirpath={directory}",
            "+callbacks.periodic.every_n_train_steps=3", "+callbacks.periodic.save_top_k=-1", "+callbacks.periodic.monitor=step",
            "+callbacks.periodic.mode=max"]


def test_augmented_images_resume_step_for_step(tmp_path: Path) -> None:
    """RandAugment, random crops and erasing (Python / torch RNG), Mixup/CutMix (NumPy RNG) and
    dropout: a run resumed from a mid-epoch checkpoint draws the same batches and masks."""
    overrides = [*VIT_SMALL, *WITH_CSV, "augment=mixup", "logger=none", "model.dropout=0.1", "data.batch_size=8",
                 "trainer.max_epochs=null", "trainer.max_steps=6", "trainer.limit_train_batches=4",
                 "trainer.val_check_interval=6", "trainer.check_val_every_n_epoch=null", "test=false",
                 "callbacks.throughput=null", "callbacks.lr_monitor=null"]
    train(compose_config([*overrides, *periodic_checkpoints(tmp_path / "periodic")], output_dir=tmp_path / "a"))
    (mid_epoch,) = (tmp_path / "periodic").glob("*step=3*.ckpt")
    train(compose_config([*overrides, f"ckpt_path='{mid_epoch}'"], output_dir=tmp_path / "b"))
    expected, resumed = train_losses(tmp_path / "a"), train_losses(tmp_path / "b")
    assert sorted(expected) == list(range(6)) and sorted(resumed) == [3, 4, 5]
    assert len({round(loss, 4) for loss in expected.values()}) == 6
    torch.testing.assert_close(resumed, {step: expected[step] for step in resumed}, rtol=0, atol=1e-6)


def test_eval_script_on_the_best_checkpoint_gives_the_runs_test_metrics(tmp_path: Path) -> None:
    run = tmp_path / "run"
    metrics = train(compose_config([*VIT_SMALL, "logger=none", "trainer.max_epochs=2", "trainer.limit_test_batches=3",
                                    "callbacks.throughput=null"], output_dir=run))
    (best,) = (run / "checkpoints").glob("best-*.ckpt")
    scored = evaluate([f"ckpt_path={best}"])
    test_keys = sorted(k for k in metrics if k.startswith("test/"))
    assert test_keys == sorted(k for k in scored if k.startswith("test/")) and "test/acc" in test_keys
    assert {k: scored[k] for k in test_keys} == pytest.approx({k: metrics[k] for k in test_keys}, abs=1e-6)
