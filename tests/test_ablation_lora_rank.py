"""``experiment=ablation_lora_rank`` (issue 41): LoRA at rank 4, 16, 64 against full fine-tuning, every job from
the same pre-trained run on the shipped instruction set; the LM's test logs what trains, the report's column;
``scripts/ablations.sh`` pre-trains the base once and hands it to the sweep."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from trident.backbone import TransformerConfig
from trident.converters import converter_settings
from trident.runs.pipeline import backbone_options, check_config
from trident.tasks.lm import LanguageModelTask
from trident.training.callbacks import ModelCosts

from .conftest import compose_config
from .test_ablation_presets import run_script_with_a_logging_python, sweeper_params

PRESET = "ablation_lora_rank"


def test_the_sweep_is_lora_at_ranks_4_16_64_and_full_fine_tuning_from_one_base() -> None:
    params = sweeper_params(PRESET)
    assert params["lora_rank"] == ["4", "16", "64", "full"] and params["seed"] == ["1", "2", "3"]
    for rank in params["lora_rank"]:
        cfg = compose_config([f"experiment={PRESET}", "pretrained_run=base/run", f"lora_rank={rank}"])
        check_config(cfg)
        assert (cfg.task.name, cfg.data.name, cfg.init_from) == ("lm", "chat", "base/run")
        settings = converter_settings(cfg, TransformerConfig(**backbone_options(cfg)))["lora"]
        if rank == "full":
            assert settings is None, "full fine-tuning: no adapter, every weight trains"
        else:
            assert settings == {"rank": int(rank), "alpha": 16, "dropout": 0.05, "targets": ["q", "v"]}


def test_the_preset_needs_its_pretrained_run() -> None:
    cfg = compose_config([f"experiment={PRESET}"])
    assert OmegaConf.is_missing(cfg, "pretrained_run")


@pytest.mark.parametrize("lora", [None, {"rank": 4, "alpha": 16, "dropout": 0.0, "targets": ["q", "v"]}])
def test_the_lm_test_stage_logs_the_trainable_parameters(lora: dict | None, monkeypatch: pytest.MonkeyPatch,
                                                         single_thread: None) -> None:
    backbone = {"d_model": 32, "n_heads": 4, "n_layers": 2, "d_ff": 64, "dropout": 0.0, "max_seq_len": 16,
                "pos_encoding": "rope"}
    task = LanguageModelTask(backbone, vocab_size=11, optimizer={}, scheduler={}, lora=lora).eval()
    logged: dict[str, float] = {}
    monkeypatch.setattr(task, "log", lambda name, value, **kwargs: logged.update({name: value}))
    ids = torch.randint(0, 11, (2, 8))  # (B, T): one test batch, so the epoch has a loss to log beside the counts
    task.test_step((ids, ids.roll(-1, dims=1)), 0)
    task.on_test_epoch_end()
    ModelCosts().on_test_epoch_end(None, task)  # type: ignore[arg-type]  # every task=lm run's callbacks.model_costs
    # Full: every (tied) parameter; LoRA r=4 on q and v: 2 layers x 2 slices x (A 4 x 32 + B 32 x 4).
    total = sum(p.numel() for p in task.net.parameters())
    assert logged["test/trainable_params"] == (total if lora is None else 2 * 2 * 2 * 4 * 32)


def test_the_ablations_script_pretrains_the_base_once_and_passes_it(tmp_path: Path) -> None:
    result, calls = run_script_with_a_logging_python(tmp_path, PRESET)
    sweeps, reports = tmp_path / "sweeps", tmp_path / "reports"
    base = sweeps / f"{PRESET}_base"
    assert result.returncode == 0, result.stderr
    assert calls == [
        ("train.py task=lm model=nano data.block_size=512 data.batch_size=8 trainer.max_steps=1200 "
         f"trainer.val_check_interval=300 hydra.run.dir={base}"),
        f"train.py -m experiment={PRESET} budget=steps pretrained_run={base} hydra.sweep.dir={sweeps}/{PRESET}",
        f"-m trident.report {sweeps}/{PRESET} --out {reports}/{PRESET}",
    ]
    base.mkdir(parents=True)
    (base / "status.json").write_text(json.dumps({"status": "completed"}))
    (tmp_path / "calls.log").unlink()
    (tmp_path / "bin").rename(tmp_path / "old_bin")
    result, calls = run_script_with_a_logging_python(tmp_path, PRESET, MAX_SEEDS="8")
    assert result.returncode == 0, result.stderr
    assert calls[0] == (f"-m trident.report.adaptive experiment={PRESET} budget=steps pretrained_run={base} "
                        f"--metric best/val/loss --max-seeds 8 --sweep-dir {sweeps}/{PRESET}"), "a completed base is reused"
