"""The trainer presets, composed as ``python train.py`` composes them: the GPU ones (gpu, ddp, fsdp) fast by default
(bf16, compile=blocks, loader workers, pinned memory, translation's GPU token budget and length buckets), every
setting yielding to the command line; the CPU ones (cpu, default, ddp_cpu, fsdp_cpu) as they were."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from omegaconf import DictConfig

from trident.runs import compose
from trident.runs.compose import loader_workers

from .conftest import compose_config

SHARDED = "trident.parallel.fsdp.ShardedStrategy"
# preset -> (trainer.accelerator, trainer.devices, trainer.strategy or its _target_)
PRESETS = {"gpu": ("gpu", 1, None), "ddp": ("gpu", -1, "ddp"), "fsdp": ("gpu", -1, SHARDED),
           "cpu": ("cpu", 1, None), "default": ("auto", 1, None), "ddp_cpu": ("cpu", 2, "ddp"),
           "fsdp_cpu": ("cpu", 2, SHARDED)}
GPU_PRESETS = ("gpu", "ddp", "fsdp")


def settings(cfg: DictConfig) -> dict[str, Any]:
    strategy = cfg.trainer.get("strategy")
    return {"accelerator": cfg.trainer.accelerator, "devices": cfg.trainer.devices,
            "strategy": strategy.get("_target_") if isinstance(strategy, DictConfig) else strategy,
            "precision": (cfg.precision_name, cfg.trainer.precision), "compile": cfg.compile,
            "workers": cfg.data.num_workers, "pin_memory": cfg.data.pin_memory,
            "budget": (cfg.data.max_tokens, cfg.data.length_multiple)}


@pytest.mark.parametrize("preset", PRESETS)
def test_each_preset_resolves_to_its_settings(preset: str) -> None:
    accelerator, devices, strategy = PRESETS[preset]
    got = settings(compose_config([f"trainer={preset}", "task=translation"]))
    if preset in GPU_PRESETS:
        fast = {"precision": ("bf16", "bf16-mixed"), "compile": "blocks", "workers": loader_workers(devices),
                "pin_memory": True, "budget": (16384, 16)}
    else:
        fast = {"precision": ("fp32", "32-true"), "compile": False, "workers": 0, "pin_memory": False,
                "budget": (2048, None)}
    assert got == {"accelerator": accelerator, "devices": devices, "strategy": strategy, **fast}


@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_the_command_line_wins_over_a_gpu_preset(preset: str) -> None:
    cfg = compose_config(["precision=fp32", f"trainer={preset}", "compile=false", "trainer.devices=2",
                          "data.pin_memory=false", "task=translation", "data.max_tokens=4096", "data.length_multiple=null"])
    assert settings(cfg) | {"strategy": None} == {
        "accelerator": "gpu", "devices": 2, "strategy": None, "precision": ("fp32", "32-true"), "compile": False,
        "workers": loader_workers(2), "pin_memory": False, "budget": (4096, None)}
    assert compose_config([f"trainer={preset}", "data.num_workers=0"]).data.num_workers == 0


def test_an_experiment_that_picks_a_precision_composes_with_a_gpu_preset() -> None:
    """conf/experiment/shakespeare_small.yaml overrides the precision group too: no clash, the command line wins."""
    assert compose_config(["trainer=gpu", "experiment=shakespeare_small", "precision=fp16"]).precision_name == "fp16"
    assert compose_config(["trainer=gpu", "experiment=shakespeare_small"]).precision_name == "bf16"


@pytest.mark.parametrize(("cpus", "devices", "gpus", "workers"), [
    (32, 1, 0, 8),  # capped at 8
    (32, 8, 0, 4),  # a node's CPUs shared by its devices
    (3, 1, 0, 3),
    (6, 8, 0, 1),  # at least one
    (32, -1, 4, 8),  # all GPUs: counted
    (16, "auto", 4, 4),
])
def test_loader_workers_share_the_cpus_among_the_devices(cpus: int, devices: int | str, gpus: int, workers: int,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compose.os, "sched_getaffinity", lambda pid: set(range(cpus)), raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert loader_workers(devices) == workers
