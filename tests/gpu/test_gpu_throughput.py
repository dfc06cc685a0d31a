"""The Throughput callback on a GPU: MFU is measured against the data-sheet peak of this GPU (looked
up by its name, e.g. an H100 or H200) and lands in (0, 1)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from trident.runs.pipeline import train
from trident.training.flops import gpu_peak_flops

from ..conftest import compose_config
from .runs import TASK_RUNS


@pytest.mark.parametrize("task", ["lm", "vit"])
def test_mfu_uses_the_table_peak_of_this_gpu_and_lies_between_0_and_1(task: str, tmp_path: Path) -> None:
    name = torch.cuda.get_device_name()
    peak = gpu_peak_flops(name, "bf16")
    if peak is None:
        pytest.skip(f"{name!r} is not in trident.training.flops.GPU_PEAK_FLOPS")
    overrides = [*TASK_RUNS[task](tmp_path), "trainer=gpu", "precision=bf16", "compile=false", "logger=csv", "test=false",
                 "trainer.max_steps=13", "trainer.limit_train_batches=13", "callbacks.throughput.window=3"]
    train(compose_config(overrides, output_dir=tmp_path / "run"))
    with next((tmp_path / "run").rglob("metrics.csv")).open() as f:
        rows = [row for row in csv.DictReader(f) if row.get("throughput/mfu")]
    assert rows, "one MFU value per window of 3 steps"
    for row in rows:
        mfu, flops = float(row["throughput/mfu"]), float(row["throughput/flops_per_sec"])
        assert mfu == pytest.approx(flops / peak, rel=1e-5), "MFU is against the table's bf16 peak of this GPU"
        assert 0.0 < mfu < 1.0
