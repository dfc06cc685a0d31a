"""The ablation presets' sweeps (``hydra.sweeper.params``): the job counts docs/sweeps.md states, and
every swept setting composes into a valid config."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser

from trident.errors import ConfigError
from trident.runs.pipeline import backbone_options, check_config

from .conftest import CONF_DIR, ROOT, SWEEPS_PAGE, compose_config

PRESETS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("ablation_*.yaml"))
# Values only the user (or scripts/ablations.sh) can give: the pre-trained run a fine-tuning preset starts from.
REQUIRED = {"ablation_lora_rank": ["pretrained_run=run"]}
# | command | axis | jobs | (measured wall time) |
PRESET_ROW = re.compile(
    r"^\| `python train\.py -m experiment=(ablation_\w+)` \| (.+?) \| (\d+) \|(?: [^|]+ \|)?$", re.MULTILINE
)


def sweeper_config(preset: str) -> tuple[dict[str, list[str]], list[set[str]]]:
    """``hydra.sweeper.params`` of ``experiment=<preset>`` as Hydra composes it, each key with its values,
    and its ``hydra.sweeper.exclude`` (the excluding sweeper's combinations left out)."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        cfg = compose("train", overrides=[f"experiment={preset}"], return_hydra_config=True)
    GlobalHydra.instance().clear()
    params = dict(cfg.hydra.sweeper.params or {})
    parsed = OverridesParser.create().parse_overrides([f"{key}={value}" for key, value in params.items()])
    exclude = [set(rule) for rule in cfg.hydra.sweeper.get("exclude") or []]
    return {o.key_or_group: list(o.sweep_string_iterator()) for o in parsed}, exclude


def sweeper_params(preset: str) -> dict[str, list[str]]:
    return sweeper_config(preset)[0]


def swept_settings(preset: str) -> tuple[list[list[str]], list[list[str]]]:
    """(the settings the sweep runs, those it excludes), each a list of overrides, seeds left out."""
    params, exclude = sweeper_config(preset)
    axes = {key: values for key, values in params.items() if key != "seed"}
    combinations = [[f"{key}={value}" for key, value in zip(axes, values)] for values in itertools.product(*axes.values())]
    excluded = [c for c in combinations if any(rule <= set(c) for rule in exclude)]
    return [c for c in combinations if c not in excluded], excluded


def stated_rows() -> dict[str, tuple[str, int]]:
    return {name: (axis, int(jobs)) for name, axis, jobs in PRESET_ROW.findall(SWEEPS_PAGE.read_text())}


def test_every_preset_is_in_the_sweeps_page_table() -> None:
    assert PRESETS and sorted(stated_rows()) == PRESETS


@pytest.mark.parametrize("preset", PRESETS)
def test_the_sweep_has_the_jobs_the_sweeps_page_states(preset: str) -> None:
    params = sweeper_params(preset)
    axis, jobs = stated_rows()[preset]
    assert params.get("seed") == ["1", "2", "3"], "every ablation runs seeds 1, 2, 3"
    run, _ = swept_settings(preset)
    assert len(run) * len(params["seed"]) == jobs
    swept = [key for key in params if key != "seed"]
    assert all(f"`{key}`" in axis for key in swept), f"docs/sweeps.md names the swept key(s) {swept}"


@pytest.mark.parametrize("preset", PRESETS)
def test_every_swept_setting_is_a_valid_config_and_every_excluded_one_is_refused(preset: str) -> None:
    run, excluded = swept_settings(preset)  # seeds change no shape
    required = REQUIRED.get(preset, [])
    for overrides in run:
        check_config(compose_config([f"experiment={preset}", *required, *overrides]))
    for overrides in excluded:  # left out because the task refuses it, not to hide a failure
        with pytest.raises(ConfigError):
            check_config(compose_config([f"experiment={preset}", *required, *overrides]))


def test_the_ablations_script_checks_every_name_before_running_a_sweep(tmp_path: Path) -> None:
    out = tmp_path / "ablations"
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "ablations.sh"), "ablation_base", "ablation_nope"],
        capture_output=True, text=True, env={**os.environ, "ABLATIONS_DIR": str(out)}, timeout=60, check=False,
    )
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"error: no preset conf/experiment/ablation_nope.yaml: choose among {' '.join(PRESETS)}"
    ]
    assert not out.exists(), "no sweep ran, not even the valid one listed first"


def run_script_with_a_logging_python(tmp_path: Path, *presets: str, **env: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """scripts/ablations.sh with a stand-in ``python`` first on PATH that only logs its arguments."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(f'#!/bin/sh\necho "$*" >> {log}\n')
    (bin_dir / "python").chmod(0o755)
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "ablations.sh"), *presets], capture_output=True, text=True, timeout=60,
        check=False, env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
                          "ABLATIONS_DIR": str(tmp_path / "sweeps"), "REPORTS_DIR": str(tmp_path / "reports"), **env})
    return result, log.read_text().splitlines() if log.exists() else []


def test_the_ablations_script_writes_the_reports_after_every_sweep(tmp_path: Path) -> None:
    """A report overwrites tracked files under docs/results/: written between two sweeps, it would mark
    every job of the later sweeps git_dirty."""
    result, calls = run_script_with_a_logging_python(tmp_path, "ablation_norm", "ablation_label_smoothing")
    sweeps, reports = tmp_path / "sweeps", tmp_path / "reports"
    assert result.returncode == 0, result.stderr
    assert calls == [
        f"train.py -m experiment=ablation_norm budget=steps hydra.sweep.dir={sweeps}/ablation_norm",
        f"train.py -m experiment=ablation_label_smoothing budget=steps hydra.sweep.dir={sweeps}/ablation_label_smoothing",
        f"-m trident.report {sweeps}/ablation_norm --out {reports}/ablation_norm",
        (f"-m trident.report {sweeps}/ablation_label_smoothing --out {reports}/ablation_label_smoothing "
         "--compare best/val/bleu test/bleu test/ppl"),
    ]


def test_max_seeds_runs_the_adaptive_loop_on_the_first_compared_metric(tmp_path: Path) -> None:
    result, calls = run_script_with_a_logging_python(tmp_path, "ablation_label_smoothing", "ablation_heads",
                                                     MAX_SEEDS="8", BUDGET="equal_compute")
    sweeps = tmp_path / "sweeps"
    assert result.returncode == 0, result.stderr
    assert calls[:2] == [
        ("-m trident.report.adaptive experiment=ablation_label_smoothing budget=equal_compute --metric best/val/bleu "
         f"--max-seeds 8 --sweep-dir {sweeps}/ablation_label_smoothing_equal_compute"),
        ("-m trident.report.adaptive experiment=ablation_heads budget=equal_compute --metric best/val/loss "
         f"--max-seeds 8 --sweep-dir {sweeps}/ablation_heads_equal_compute"),
    ]


@pytest.mark.parametrize(("presets", "max_seeds", "error"), [
    (["ablation_heads"], "eight", ("error: MAX_SEEDS=eight is not a number of seeds: set e.g. MAX_SEEDS=8, "
                                   "or unset it for the presets' seeds")),
    (["ablation_heads", "ablation_pos_encoding_tasks"], "8",
     ("error: ablation_pos_encoding_tasks sweeps task, whose comparisons MAX_SEEDS cannot add seeds to: "
      "run it without MAX_SEEDS")),
])
def test_the_ablations_script_refuses_max_seeds_it_cannot_use(tmp_path: Path, presets: list[str], max_seeds: str,
                                                              error: str) -> None:
    result, calls = run_script_with_a_logging_python(tmp_path, *presets, MAX_SEEDS=max_seeds)
    assert (result.returncode, result.stderr.splitlines(), calls) == (2, [error], [])


def test_kv_heads_preset_sweeps_key_value_heads_from_n_heads_down_to_one_at_equal_compute() -> None:
    """Issue 40: every divisor of the nano LM's query heads, multi-head first; each composes at equal compute
    into a backbone with that many key/value heads (fewer: a cheaper step, so more steps on the same FLOPs)."""
    params = sweeper_params("ablation_kv_heads")
    cfg = compose_config(["experiment=ablation_kv_heads"])
    n_heads = cfg.model.n_heads
    assert params["model.n_kv_heads"] == [str(n) for n in range(n_heads, 0, -1) if n_heads % n == 0]
    for n in params["model.n_kv_heads"]:
        cfg = compose_config(["experiment=ablation_kv_heads", "budget=equal_compute", f"model.n_kv_heads={n}"])
        check_config(cfg)
        options = backbone_options(cfg)
        assert options["n_kv_heads"] == int(n) and options["pos_encoding"] == "rope"
        assert cfg.budget.flops == 2.0e12 and cfg.trainer.max_steps == -1
