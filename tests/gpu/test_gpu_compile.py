"""``compile=true`` on a GPU: one LM and one ViT training run compile and train (the speed-up
against eager is measured by `python -m trident.bench --device cuda --only compile mfu`, not asserted)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trident.runs.pipeline import train

from ..conftest import compose_config
from .probes import TrainingProbe
from .runs import TASK_RUNS


@pytest.mark.parametrize("task", ["lm", "vit"])
def test_compiled_network_trains_on_the_gpu(task: str, tmp_path: Path) -> None:
    overrides = [*TASK_RUNS[task](tmp_path), "trainer=gpu", "precision=bf16", "compile=true", "logger=none",
                 "test=false", "trainer.max_steps=3", "+callbacks.probe._target_=tests.gpu.probes.TrainingProbe"]
    TrainingProbe.last = None
    train(compose_config(overrides, output_dir=tmp_path))
    probe = TrainingProbe.last
    assert probe is not None and probe.device is not None and probe.device.type == "cuda"
    assert probe.compiled
    assert len(probe.losses) == 3 and probe.weights_finite
