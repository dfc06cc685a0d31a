"""Equal compute (trident.runs.budget): a FLOP budget sets the steps, equal FLOPs within one step's
worth across model sizes, warmup as a fraction, bad values as one error line, the report's sentence."""

from __future__ import annotations

import json
import math
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import DictConfig, OmegaConf

from trident.errors import ConfigError, run_with_clear_errors
from trident.runs.budget import (
    apply_flops_budget,
    check_budget,
    check_training_batches,
    comparison_basis,
    first_batch_flops,
)
from trident.runs.pipeline import build_data_and_task, check_config, train
from trident.training.optim import build_scheduler, check_scheduler_config

BUDGET = ["trainer.max_steps=-1", "budget.flops=1e9"]


def nano_lm_flops_by_hand(d: int, layers: int, d_ff: int, vocab: int, batch: int, length: int) -> int:
    """6 FLOPs per weight and token (forward + backward) for Q, K, V, output, the two feed-forward
    matrices and the output head; 12 d T per query token and layer for QK^T and AV (PaLM's count)."""
    weights = layers * (4 * d * d + 2 * d * d_ff) + d * vocab
    return 6 * weights * batch * length + 12 * layers * d * length * length * batch


def budgeted(cfg: DictConfig) -> DictConfig:
    """``cfg`` with the budget applied as the pipeline applies it (on the task's first batch)."""
    return budgeted_with_vocab(cfg)[0]


def budgeted_with_vocab(cfg: DictConfig) -> tuple[DictConfig, int]:
    datamodule, task = build_data_and_task(cfg, check_config(cfg), "fit")
    apply_flops_budget(cfg, first_batch_flops(task, datamodule))
    return cfg, task.net.vocab_size


def test_two_model_sizes_get_equal_flops_within_one_step(make_config: Callable[..., DictConfig]) -> None:
    nano, vocab = budgeted_with_vocab(make_config(*BUDGET))
    wide = budgeted(make_config(*BUDGET, "model.d_model=128", "model.n_layers=3"))
    # SMALL: the nano model (d_model 64, 2 layers, d_ff 256) on 4 blocks of 32 characters.
    assert nano.budget.flops_per_step == nano_lm_flops_by_hand(64, 2, 256, vocab, 4, 32)
    for cfg in (nano, wide):
        steps, per_step = cfg.budget.steps, cfg.budget.flops_per_step
        assert cfg.trainer.max_steps == steps
        assert steps * per_step <= 1e9 < (steps + 1) * per_step, "the budget is spent to within one step"
        assert cfg.trainer.val_check_interval == max(1, steps // 6)
    assert wide.budget.steps < nano.budget.steps


def test_accumulation_counts_in_the_flops_of_a_step(make_config: Callable[..., DictConfig]) -> None:
    one = budgeted(make_config(*BUDGET))
    two = budgeted(make_config(*BUDGET, "trainer.accumulate_grad_batches=2"))
    assert two.budget.flops_per_step == 2 * one.budget.flops_per_step


def test_a_tiny_budget_trains_at_least_one_step(make_config: Callable[..., DictConfig]) -> None:
    cfg = budgeted(make_config("trainer.max_steps=-1", "budget.flops=1"))
    assert cfg.trainer.max_steps == 1 and cfg.trainer.val_check_interval == 1


@pytest.mark.usefixtures("single_thread")
def test_a_run_on_a_budget_trains_its_steps_and_records_them(make_config: Callable[..., DictConfig]) -> None:
    probe = budgeted(make_config(*BUDGET))
    per_step = probe.budget.flops_per_step
    cfg = make_config("trainer.max_steps=-1", f"budget.flops={2.5 * per_step}", "test=false")
    train(cfg)
    run_dir = Path(cfg.paths.output_dir)
    saved = OmegaConf.load(run_dir / "config_resolved.yaml")
    assert (saved.trainer.max_steps, saved.budget.steps, saved.budget.flops_per_step) == (2, 2, per_step)
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == 2


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.max_steps=-1", "budget.flops=-1e9"], "budget.flops must be a positive number"),
        (["trainer.max_steps=-1", "budget.flops=0"], "budget.flops must be a positive number"),
        (["trainer.max_steps=-1", "budget.flops=lots"], "budget.flops must be a positive number"),
        (["trainer.max_steps=-1", "budget.flops=nan"], "budget.flops must be a positive number"),
        (["trainer.max_steps=-1", "budget.flops=true"], "budget.flops must be a positive number"),
        (["budget.flops=1e9"], "trainer.max_steps=4 and budget.flops=1e+09 both set the length of training"),
        ([*BUDGET, "budget.validations=0"], "budget.validations must be an integer >= 1"),
        ([*BUDGET, "trainer.devices=auto"], "budget.flops needs the number of processes"),
        ([*BUDGET, "scheduler.warmup_steps=1.5"], "scheduler.warmup_steps must be an integer >= 0 (steps) or a fraction"),
    ],
)
def test_bad_budgets_end_in_one_error_line(make_config: Callable[..., DictConfig], capsys: pytest.CaptureFixture[str],
                                           overrides: list[str], message: str) -> None:
    cfg = make_config(*overrides)
    with pytest.raises(SystemExit) as exit_info:
        run_with_clear_errors(lambda: train(cfg))
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: ") and message in error and "\n" not in error
    assert not Path(cfg.paths.output_dir).exists(), "a config error leaves no run directory"


def test_no_budget_keeps_the_steps(make_config: Callable[..., DictConfig]) -> None:
    cfg = make_config()
    assert check_budget(cfg) is None
    apply_flops_budget(cfg, 10**9)
    assert cfg.trainer.max_steps == 4 and "steps" not in cfg.budget


def test_the_equal_compute_preset_replaces_the_steps_of_an_ablation(tmp_path: Path) -> None:
    from .conftest import compose_config

    cfg = compose_config(["experiment=ablation_width", "budget=equal_compute"], tmp_path)
    assert cfg.trainer.max_steps == -1 and cfg.scheduler.warmup_steps == 0.1
    assert check_budget(cfg) == 2e12 and cfg.budget.validations == 6


@pytest.mark.parametrize("preset", ["ablation_width", "ablation_depth", "ablation_ffn", "ablation_heads"])
def test_every_size_axis_composes_at_equal_compute(tmp_path: Path, preset: str) -> None:
    from .conftest import compose_config

    cfg = compose_config([f"experiment={preset}", "budget=equal_compute"], tmp_path)
    check_config(cfg)
    assert check_budget(cfg) == 2e12


def test_the_ablations_script_refuses_an_unknown_budget(tmp_path: Path) -> None:
    from .conftest import ROOT

    out = tmp_path / "ablations"
    result = subprocess.run(["bash", str(ROOT / "scripts" / "ablations.sh"), "ablation_width"], capture_output=True,
                            text=True, env={**os.environ, "ABLATIONS_DIR": str(out), "BUDGET": "flops"},
                            timeout=60, check=False)
    assert result.returncode == 2
    assert result.stderr.splitlines() == ["error: no budget conf/budget/flops.yaml: set BUDGET to one of equal_compute,steps"]
    assert not out.exists()


def test_warmup_as_a_fraction_of_the_steps() -> None:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = build_scheduler(optimizer, {"name": "cosine", "warmup_steps": 0.1, "min_lr_ratio": 0.1}, 50)
    factors = []
    for _ in range(7):
        factors.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    # 10 % of 50 steps: 5 warmup steps rising to the peak, then the cosine begins at its peak.
    assert factors == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0, 1.0, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 45))])
    with pytest.raises(ConfigError, match="warmup_steps must be"):
        check_scheduler_config({"name": "cosine", "warmup_steps": 1.0})


def write_job(job_dir: Path, config: dict[str, object]) -> Path:
    (job_dir / ".hydra").mkdir(parents=True)
    (job_dir / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    return job_dir


def test_the_report_says_equal_steps_or_equal_compute(tmp_path: Path) -> None:
    steps = [write_job(tmp_path / f"s{i}", {"trainer": {"max_steps": 600}, "budget": {"flops": None}}) for i in range(2)]
    assert comparison_basis(steps) == "Equal steps: every job trained 600 steps (trainer.max_steps)."
    flops = [write_job(tmp_path / f"f{i}", {"trainer": {"max_steps": -1}, "budget": {"flops": 2e12}}) for i in range(2)]
    assert comparison_basis(flops).startswith("Equal compute: every job trained on 2e+12 model FLOPs")
    assert comparison_basis([steps[0], flops[0]]).startswith("Unequal training")
    assert comparison_basis([tmp_path / "missing"]) is None


@pytest.mark.parametrize(("trainer", "refused"), [
    ({"devices": 2}, False),  # 10 examples, batches of 4: 2 batches, one a process
    ({"devices": 3}, True),  # floor(10 / (4 x 3)) = 0 batches a process
    ({"devices": 1, "num_nodes": 3}, True),
    ({"devices": 3, "max_steps": 0}, False),  # no training asked for
    ({"devices": 1, "limit_train_batches": 1}, False),
    ({"devices": 1, "limit_train_batches": 0.4}, True),  # int(2 x 0.4) = 0
])
def test_a_split_with_no_batch_per_process_is_refused(trainer: dict[str, float], refused: bool) -> None:
    cfg = OmegaConf.create({"trainer": {"max_steps": 5, "num_nodes": 1, **trainer}, "data": {"batch_size": 4}})
    loader = torch.utils.data.DataLoader(list(range(10)), batch_size=4, drop_last=True)
    if not refused:
        check_training_batches(cfg, loader)
        return
    with pytest.raises(ConfigError, match="no training batch") as caught:
        check_training_batches(cfg, loader)
    fix = "limit_train_batches" if "limit_train_batches" in trainer else f"at most {10 // (trainer['devices'] * trainer.get('num_nodes', 1))}"
    assert fix in str(caught.value)
