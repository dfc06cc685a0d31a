"""train.py end to end on CPU (every positional encoding: one training step each), W&B files read back (each precision: test_precision.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig

from trident.commands.sample import load_lm_checkpoint
from trident.commands.sample import main as sample_main
from trident.tracking.wandb_files import wait_for_offline_runs

from .conftest import one_step


@pytest.mark.parametrize("encoding", ["none", "sinusoidal", "learned", "rope", "alibi", "relative"])
def test_lm_trains_with_each_pos_encoding(encoding: str, make_config: Callable[..., DictConfig]) -> None:
    metrics = one_step(make_config(f"pos_encoding={encoding}"))
    assert torch.isfinite(torch.tensor([metrics["train/loss"], metrics["val/loss"]])).all()


def test_wandb_offline_run_holds_config_metrics_and_samples(lm_reference_run: tuple[Path, dict[str, float]]) -> None:
    run_dir, metrics = lm_reference_run
    runs = wait_for_offline_runs(run_dir)
    assert len(runs) == 1, "exactly one W&B run per job"
    run = runs[0]
    assert run.name == "lm-shakespeare-nano-alibi-seed7" and run.group == "lm-shakespeare"
    assert {"lm", "nano", "alibi", "fp32"} <= set(run.tags)
    # The resolved Hydra config, not just the module's hyperparameters.
    assert run.config["model"]["d_model"] == 64 and run.config["pos_encoding"]["name"] == "alibi"
    assert run.config["seed"] == 7 and run.config["backbone"]["pos_encoding"] == "alibi"
    losses = run.metric("train/loss")
    assert len(losses) == 4 and all(isinstance(v, float) for v in losses)
    assert run.metric("val/loss") and run.metric("val/ppl")
    assert run.summary["test/loss"] == pytest.approx(metrics["test/loss"])
    assert any(k.startswith("samples") for row in run.history for k in row), "samples table logged"
    tables = list(run_dir.rglob("media/table/samples_*.table.json"))
    assert tables and "ROMEO" in tables[0].read_text()


def test_run_directory_keeps_resolved_config_and_checkpoints(lm_reference_run: tuple[Path, dict[str, float]]) -> None:
    run_dir, _ = lm_reference_run
    resolved = (run_dir / "config_resolved.yaml").read_text()
    assert "${" not in resolved and "d_model: 64" in resolved
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    assert '"type": "WordLevel"' in (run_dir / "tokenizer.json").read_text()
    assert list((run_dir / "checkpoints").glob("best-*.ckpt"))
    metrics_csv = next(run_dir.rglob("metrics.csv")).read_text()
    header = metrics_csv.split("\n")[0]
    assert "train/loss" in header and "throughput/tokens_per_sec" in header


def test_checkpoint_samples_from_command_line(lm_reference_run: tuple[Path, dict[str, float]],
                                             capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = lm_reference_run[0] / "checkpoints" / "last.ckpt"
    task = load_lm_checkpoint(ckpt)
    assert task.tokenizer is not None and task.net.vocab_size == task.tokenizer.get_vocab_size()
    # In this process (the installed `trident-sample` command: tests/test_packaging.py).
    sample_main([str(ckpt), "--prompt", "ROMEO:", "--max-new-tokens", "20"])
    out = capsys.readouterr().out
    assert out.startswith("ROMEO:") and len(out.split("\n")[0]) >= len("ROMEO:")
