"""Model EMA (``callbacks=ema``, Lightning's EMAWeightAveraging): the average follows the raw
weights step by step, validation, the test and eval.py use it, checkpoints carry both, resume is
exact, and a bad setting is one line. Under DDP: tests/test_ddp_matrix.py (its LM runs average)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import Tensor

from trident.commands.evaluate import evaluate
from trident.runs.pipeline import train

from .conftest import SMALL, compose_config
from .test_bad_inputs import run_in_process

pytestmark = pytest.mark.usefixtures("single_thread")

DECAY = 0.5  # far from 1, so that a few steps move the average well away from the raw weights
EMA_RUN = [
    *SMALL,
    "callbacks=ema",
    f"callbacks.ema.decay={DECAY}",
    "model.dropout=0.1",  # the random state matters for resume
    "trainer.max_steps=6",
    "trainer.val_check_interval=3",
    "callbacks.throughput=null",
    "callbacks.lr_monitor=null",
    "logger=none",
    "+callbacks.weights._target_=tests.test_ema.RecordWeights",
    # A checkpoint at step 3 to resume from.
    "+callbacks.periodic._target_=lightning.pytorch.callbacks.ModelCheckpoint",
    "+callbacks.periodic.dirpath='${paths.output_dir}/checkpoints/periodic'",
    "+callbacks.periodic.filename='step{step}'",
    "+callbacks.periodic.auto_insert_metric_name=false",
    "+callbacks.periodic.every_n_train_steps=3",
    "+callbacks.periodic.save_top_k=-1",
    "+callbacks.periodic.monitor=step",
    "+callbacks.periodic.mode=max",
]


class RecordWeights(L.Callback):
    """Saves (to ``<run dir>/weights.pt``) the raw weights after every optimizer step and the
    weights the model holds while it validates."""

    def __init__(self) -> None:
        self.after_step: list[dict[str, Tensor]] = []
        self.validating: dict[int, dict[str, Tensor]] = {}

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.after_step.append(_floats(pl_module))
        self._save(trainer)

    def on_validation_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if not trainer.sanity_checking:
            self.validating[trainer.global_step] = _floats(pl_module)
            self._save(trainer)

    def _save(self, trainer: L.Trainer) -> None:
        recorded = {"after_step": self.after_step, "validating": self.validating}
        torch.save(recorded, Path(trainer.default_root_dir) / "weights.pt")


def _floats(module: L.LightningModule) -> dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items() if v.is_floating_point()}


def hand_ema(steps: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """The EMA after ``steps``: the first step's weights, then ema = decay * ema + (1 - decay) * w."""
    ema = dict(steps[0])
    for weights in steps[1:]:
        ema = {k: DECAY * ema[k] + (1 - DECAY) * weights[k] for k in ema}
    return ema


def assert_weights_close(actual: dict[str, Tensor], expected: dict[str, Tensor]) -> None:
    torch.testing.assert_close({k: actual[k] for k in expected}, expected, rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def ema_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, float]]:
    run_dir = tmp_path_factory.mktemp("ema") / "run"
    return run_dir, train(compose_config(EMA_RUN, output_dir=run_dir))


def test_ema_follows_the_raw_weights_and_validation_uses_it(ema_run: tuple[Path, dict[str, float]]) -> None:
    run_dir, _ = ema_run
    recorded = torch.load(run_dir / "weights.pt", weights_only=True)
    raw = recorded["after_step"]
    assert len(raw) == 6
    last = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    expected = hand_ema(raw)
    assert_weights_close(last["state_dict"], expected)  # what eval.py and sampling load
    assert_weights_close(last["current_model_state"], raw[-1])  # what training continues from
    gap = max((expected[k] - raw[-1][k]).abs().max().item() for k in expected)
    assert gap > 1e-5, "the EMA differs from the raw weights"
    # Both validations (after steps 3 and 6) ran on the EMA of the steps so far.
    assert sorted(recorded["validating"]) == [3, 6]
    assert_weights_close(recorded["validating"][3], hand_ema(raw[:3]))
    assert_weights_close(recorded["validating"][6], expected)


def test_test_and_eval_use_the_ema_weights(ema_run: tuple[Path, dict[str, float]], tmp_path: Path) -> None:
    run_dir, metrics = ema_run
    (best,) = (run_dir / "checkpoints").glob("best-*.ckpt")
    assert evaluate([f"ckpt_path={best}"])["test/loss"] == pytest.approx(metrics["test/loss"], abs=1e-6)
    # The same checkpoint with the raw weights in state_dict scores differently.
    checkpoint = torch.load(best, weights_only=True)
    checkpoint["state_dict"] = checkpoint["current_model_state"]
    raw = best.parent / "raw.ckpt"
    torch.save(checkpoint, raw)
    assert evaluate([f"ckpt_path={raw}"])["test/loss"] != pytest.approx(metrics["test/loss"], abs=1e-4)


def test_resume_continues_the_ema_exactly(ema_run: tuple[Path, dict[str, float]], tmp_path: Path) -> None:
    run_dir, _ = ema_run
    step3 = run_dir / "checkpoints" / "periodic" / "step3.ckpt"
    train(compose_config([*EMA_RUN, f"ckpt_path={step3}"], output_dir=tmp_path / "resumed"))
    straight = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    resumed = torch.load(tmp_path / "resumed" / "checkpoints" / "last.ckpt", weights_only=True)
    assert resumed["global_step"] == straight["global_step"] == 6
    for key in ("state_dict", "current_model_state", "averaging_state"):
        torch.testing.assert_close(resumed[key], straight[key], rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("callbacks.ema.decay=1.0", "callbacks.ema.decay must be a number in (0, 1), got 1.0"),
        ("callbacks.ema.decay=0", "callbacks.ema.decay must be a number in (0, 1), got 0"),
        ("callbacks.ema.decay=high", "callbacks.ema.decay must be a number in (0, 1), got 'high'"),
        ("callbacks.ema.update_every_n_steps=0", "callbacks.ema.update_every_n_steps must be an integer >= 1"),
        ("trainer=fsdp", "callbacks=ema does not work with FSDP"),
    ],
)
def test_bad_ema_setting_is_one_line(
    override: str, named: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = ["callbacks=ema", override, "model=nano", "print_config=false"]
    result = run_in_process("train.py", args, tmp_path, monkeypatch)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and named in lines[0], result.stderr
