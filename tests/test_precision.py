"""Precision that tells the truth: what each ``precision=`` option really runs, the fp16-on-CPU
line, and the warning where bf16 is emulated (rates injected: this CPU may have bf16 units)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import lightning as L
import pytest
import torch
from omegaconf import DictConfig, OmegaConf

from trident.runs.pipeline import train
from trident.tracking.wandb_files import wait_for_offline_runs
from trident.training import precision
from trident.training.flops import measured_peak_flops
from trident.training.precision import check_precision, cpu_matmul_rates

from .probes import LinearOutputDtypes


@pytest.mark.parametrize(
    ("option", "runs_as", "matmul_dtype"),
    [("fp32", "32-true", torch.float32), ("bf16", "bf16-mixed", torch.bfloat16), ("fp16", "bf16-mixed", torch.bfloat16)],
)
def test_each_precision_option_records_what_ran(
    option: str, runs_as: str, matmul_dtype: torch.dtype, make_config: Callable[..., DictConfig], tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    LinearOutputDtypes.seen.clear()
    cfg = make_config("debug=fast_dev_run", f"precision={option}", "+callbacks.dtypes._target_=tests.probes.LinearOutputDtypes")
    with caplog.at_level(logging.WARNING, logger="trident.training.precision"):
        metrics = train(cfg)
    assert torch.isfinite(torch.tensor(metrics["train/loss"])) and "test/loss" in metrics
    assert LinearOutputDtypes.seen == {matmul_dtype}, "the dtype the model's matrix products ran in"
    saved = OmegaConf.load(tmp_path / "run" / "config_resolved.yaml")
    assert saved.precision_name == option and saved.precision_used == runs_as
    (run,) = wait_for_offline_runs(tmp_path / "run")
    assert run.config["precision_used"] == runs_as
    said = [r.getMessage() for r in caplog.records if "runs as" in r.getMessage()]
    expected = [("trainer.precision=16-mixed runs as bf16-mixed on cpu (Lightning has no fp16 autocast there); "
                "recorded as precision_used")]
    assert said == (expected if option == "fp16" else [])


def _bf16_warnings(caplog: pytest.LogCaptureFixture, running: str) -> list[str]:
    trainer = L.Trainer(accelerator="cpu", precision=running, logger=False, enable_checkpointing=False)  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="trident.training.precision"):
        assert check_precision(trainer, running) == running
    return [r.getMessage() for r in caplog.records if "emulated" in r.getMessage()]


def test_bf16_on_a_cpu_without_bf16_units_warns_once_with_both_measured_rates(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Measured on an AMD EPYC without AVX512-BF16: 1024^2 matmuls, 0.6 GFLOP/s bf16 against 47 fp32.
    rates = {"bf16": 0.6e9, "fp32": 47e9}
    monkeypatch.setattr(precision, "measured_peak_flops", lambda device, dtype, size, repeats: rates[dtype])
    assert _bf16_warnings(caplog, "bf16-mixed") == [
        ("bf16 is emulated on this CPU: a matmul runs at 0.6 GFLOP/s in bf16 against 47 GFLOP/s in fp32, "
        "so training in bf16-mixed is much slower: use precision=fp32")
    ]


def test_bf16_with_native_units_or_fp32_says_nothing(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # Measured on an AMD EPYC with AVX512-BF16: bf16 ~385 GFLOP/s, fp32 ~117.
    rates = {"bf16": 385e9, "fp32": 117e9}
    monkeypatch.setattr(precision, "measured_peak_flops", lambda device, dtype, size, repeats: rates[dtype])
    assert _bf16_warnings(caplog, "bf16-mixed") == []
    monkeypatch.setattr(precision, "measured_peak_flops", lambda *args: pytest.fail("fp32 runs measure nothing"))
    assert _bf16_warnings(caplog, "32-true") == []


def test_cpu_matmul_rates_are_measured_once_per_process() -> None:
    bf16, fp32 = cpu_matmul_rates()
    assert bf16 > 0 and fp32 > 0
    hits = measured_peak_flops.cache_info().hits
    assert cpu_matmul_rates() == (bf16, fp32)
    assert measured_peak_flops.cache_info().hits == hits + 2, "the second call measures nothing"
