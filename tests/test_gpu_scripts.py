"""The GPU check's scripts, as far as a CPU can run them: both shell scripts parse, the dry run
lists every stage, the training matrix composes into valid configs, the metrics and the summary
are read back from a real (CPU) run, and the translation extract reads back as the same pairs."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from types import ModuleType

import datasets
import pytest

from trident.bench.workloads import WORKLOADS
from trident.data.translation import load_pairs
from trident.runs.pipeline import check_config, train

from .conftest import ROOT, SMALL, compose_config

SCRIPTS = ROOT / "scripts"


def load_gpu_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPTS / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


gpu_check = load_gpu_check()


@pytest.mark.parametrize("script", ["gpu_bundle.sh", "gpu_check.sh"])
def test_shell_scripts_parse(script: str) -> None:
    result = subprocess.run(["bash", "-n", str(SCRIPTS / script)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


def bash_list(script: str, name: str) -> set[str]:
    """The words of the bash array ``name=( ... )`` in ``scripts/<script>``."""
    body = re.search(rf"^{name}=\((.*?)\)", (SCRIPTS / script).read_text(), re.MULTILINE | re.DOTALL)
    assert body, f"{script} has no {name}=( ... )"
    return set(body.group(1).split())


def test_the_bundle_accounts_for_every_core_dependency() -> None:
    """A core dependency the device lacks and the bundle does not carry stops every test and training
    there at import (submitit did, on the first GPU run)."""
    pyproject = tomllib.loads((SCRIPTS.parent / "pyproject.toml").read_text())
    names = {re.split(r"[<>=!~ ;\[]", requirement, maxsplit=1)[0].lower() for requirement in pyproject["project"]["dependencies"]}
    on_device, carried = bash_list("gpu_bundle.sh", "ON_DEVICE"), bash_list("gpu_bundle.sh", "PACKAGES")
    assert "submitit" in carried and not on_device & carried
    assert names - on_device - carried == set(), "classify each in scripts/gpu_bundle.sh: ON_DEVICE or PACKAGES"


def run_check(*args: str, out: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OUT": str(out), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    return subprocess.run(["bash", str(SCRIPTS / "gpu_check.sh"), *args], capture_output=True, text=True, env=env,
                          check=False, timeout=120)


def test_dry_run_lists_every_stage_without_running_it(tmp_path: Path) -> None:
    result = run_check("--dry-run", out=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert any(line.startswith("+ python3 -m pip install -q --no-index --no-deps") for line in lines)
    assert any("python3 -m pytest -m gpu" in line and f"--junitxml={tmp_path}/junit.xml" in line for line in lines)
    assert any("python3 -m trident.bench --device cuda" in line for line in lines)
    speed = [line for line in lines if "-m trident.bench.speed --device cuda" in line]
    assert [line.split("--task ")[1].split()[0] for line in speed] == list(gpu_check.TASKS)
    assert all("--record /tmp/gpu_check_logs/speed.json --out /tmp/gpu_check_logs/speed.md" in line for line in speed)
    stages = [line.split()[1] for line in lines if line.startswith("== ")]
    assert stages == ["tests", "speed", "bench", "train"]  # the speed table right after the standing check
    trainings = [line for line in lines if "train.py" in line]
    assert len(trainings) == len(gpu_check.trainings(200, tmp_path)) == 14
    assert not any(tmp_path.iterdir()), "a dry run writes nothing"


def test_gpu_check_trainings_picks_the_trainings_by_name_pattern(tmp_path: Path) -> None:
    env = {"GPU_CHECK_TRAININGS": "translation-* *-fsdp"}
    result = subprocess.run(["bash", str(SCRIPTS / "gpu_check.sh"), "--dry-run", "train"], capture_output=True,
                            text=True, env={**os.environ, "OUT": str(tmp_path), **env}, check=False, timeout=120)
    assert result.returncode == 0, result.stderr
    names = [line.rsplit("/", 1)[-1] for line in result.stdout.splitlines() if "train.py" in line]
    assert names == ["lm-bf16-fsdp", "translation-fp32", "translation-fp16", "translation-bf16",
                     "translation-bf16-fsdp", "vit-bf16-fsdp"]


def test_gpu_check_speed_passes_the_row_patterns_to_one_process_per_task(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "GPU_CHECK_SPEED": "lm-* *-fsdp*"}
    result = subprocess.run(["bash", str(SCRIPTS / "gpu_check.sh"), "--dry-run", "--budget", "300", "speed"],
                            capture_output=True, text=True, env=env, check=False, timeout=120)
    assert result.returncode == 0, result.stderr
    commands = [shlex.split(line) for line in result.stdout.splitlines() if "trident.bench.speed" in line]
    assert [c[c.index("--task") + 1] for c in commands] == ["lm", "translation", "vit"]
    assert all(c[c.index("--only") + 1:c.index("--record")] == ["lm-*", "*-fsdp*"] for c in commands)
    deadlines = [float(c[c.index("--deadline") + 1]) for c in commands]
    assert deadlines == sorted(deadlines) and deadlines[-1] <= time.time() + 300 - 20  # shares of the stage's time


def test_speed_stage_shares_the_time_left_and_stops_at_the_deadline(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Each task may start rows until an equal share of what is left (the time one leaves goes to the next); each
    process is killed at the stage's deadline at the latest; under 30 s left none starts; a failed process's last
    lines are printed (the device tool returns the output's tail)."""
    clock = [1000.0]
    calls: list[tuple[list[str], float | None]] = []

    def run(command: list[str], timeout: float | None = None, **kwargs: object) -> subprocess.CompletedProcess[str]:
        calls.append((command, timeout))
        clock[0] += 50  # each task takes 50 s
        failed = "vit" in command
        if failed:
            kwargs["stdout"].write("ModuleNotFoundError: No module named 'hydra'\n")  # type: ignore[attr-defined]
        return subprocess.CompletedProcess(command, int(failed))

    monkeypatch.setattr(gpu_check.time, "time", lambda: clock[0])
    monkeypatch.setattr(gpu_check.subprocess, "run", run)
    assert gpu_check.run_speed(tmp_path, deadline=1300.0, dry_run=False) == 1  # vit's process failed
    printed = capsys.readouterr().out
    assert printed.startswith("speed lm: exit status 0 in 50 s\nspeed translation: exit status 0 in 50 s\nspeed vit: ")
    assert printed.endswith("\nModuleNotFoundError: No module named 'hydra'\n")
    shares = [float(command[command.index("--deadline") + 1]) for command, _ in calls]
    assert shares == [1100.0, 1050.0 + 250 / 2, 1300.0]  # 300 s / 3; then 250 s / 2; then the rest
    assert [timeout for _, timeout in calls] == [300.0, 250.0, 200.0]
    assert (tmp_path / "logs" / "speed-vit.log").read_text().startswith(shlex.join(calls[-1][0]))
    calls.clear()
    assert gpu_check.run_speed(tmp_path, deadline=clock[0] + 29, dry_run=False) == 0 and calls == []


def test_the_speed_stage_runs_the_tasks_the_bench_measures() -> None:
    assert gpu_check.TASKS == tuple(kind.KEY for kind in WORKLOADS)


def test_unknown_argument_is_one_error_line(tmp_path: Path) -> None:
    result = run_check("benchmark", out=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().startswith("error: unknown argument 'benchmark'")


@pytest.mark.parametrize("trainer", list(gpu_check.TRAINERS))
@pytest.mark.parametrize("task", ["lm", "translation", "vit"])
def test_training_overrides_compose_into_valid_configs(task: str, trainer: str, tmp_path: Path) -> None:
    cfg = compose_config([*gpu_check.task_overrides(task, 200), *gpu_check.TRAINERS[trainer], *gpu_check.COMMON],
                         output_dir=tmp_path)
    check_config(cfg)  # fails like train.py would on a bad key or value
    assert cfg.trainer.accelerator == "gpu" and cfg.trainer.max_steps == 200 and cfg.logger is not None
    assert ("strategy" in cfg.trainer and cfg.trainer.devices == 1) == (trainer == "-fsdp")


def test_metrics_and_summary_are_read_back_from_a_real_run(tmp_path: Path, single_thread: None) -> None:
    overrides = [*SMALL, "logger=csv", "test=false", "callbacks.throughput.window=1", "trainer.max_steps=4",
                 *[o for o in gpu_check.COMMON if o.startswith("+callbacks.device_stats")]]
    train(compose_config(overrides, output_dir=tmp_path / "run"))
    rates, peak_memory, final = gpu_check.read_metrics(tmp_path)
    assert rates["throughput/tokens_per_sec"] > 0 and "throughput/mfu" in rates
    assert peak_memory is None  # CUDA memory statistics only
    assert set(final) >= {"val/loss"}
    out = tmp_path / "out"
    out.mkdir()
    run = gpu_check.Training("lm-bf16", ["train.py"], "ok", 12.5, rates, 3.25, final)
    (out / "trainings.json").write_text(json.dumps([gpu_check.asdict(run)]))
    (out / "junit.xml").write_text(
        '<testsuites><testsuite tests="2" failures="1" errors="0" skipped="0">'
        '<testcase classname="tests.gpu.test_gpu_sdpa" name="test_a" time="1.5">'
        '<properties><property name="cudnn" value="ran"/></properties></testcase>'
        '<testcase classname="tests.gpu.test_gpu_sdpa" name="test_b" time="0.5"><failure message="x"/></testcase>'
        "</testsuite></testsuites>"
    )
    summary = gpu_check.write_summary(out).read_text()
    assert "2 tests, 1 failures, 0 errors, 0 skipped" in summary
    assert "- passed: tests.gpu.test_gpu_sdpa::test_a (1.5 s) (cudnn: ran)" in summary
    assert "- failure: tests.gpu.test_gpu_sdpa::test_b (0.5 s)" in summary
    row = next(line for line in summary.splitlines() if line.startswith("| lm-bf16 |"))
    assert "| ok | 12.5 |" in row and "tokens/s" in row and "| 3.2 |" in row
    assert "not run (no bench.md)" in summary and "not recorded" in summary
    assert "## Issue #57: speed at model=base (python -m trident.bench.speed)\n\nnot run (no speed.md)" in summary
    (out / "speed.md").write_text("| run | batch |\n|---|---|\n| lm-bf16 | 64 |\n")
    assert "(python -m trident.bench.speed)\n\n| run | batch |\n|---|---|\n| lm-bf16 | 64 |\n" in gpu_check.write_summary(out).read_text()


def test_translation_extract_reads_back_as_the_same_pairs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pairs = {"train": [("He said, \"Go.\"", "Er sprach: »Geh.«"), ("NA", "nicht\tverfügbar")],
             "validation": [("a  b\nc", "d")], "test": [("x", "y")]}
    fake = datasets.DatasetDict({split: datasets.Dataset.from_dict({"src": [s for s, _ in rows], "tgt": [t for _, t in rows]})
                                 for split, rows in pairs.items()})
    monkeypatch.setattr("trident.data.translation.bible_pairs", lambda *args: fake)
    gpu_check.extract_translation(tmp_path)
    files = {split: str(tmp_path / f"{split}.tsv") for split in gpu_check.SPLITS}
    read, _ = load_pairs("files", {"files": files}, "en", "de", [0.96, 0.02, 0.02])
    assert read["train"]["src"] == ["He said, \"Go.\"", "NA"] and read["train"]["tgt"] == ["Er sprach: »Geh.«", "nicht verfügbar"]
    assert read["validation"][0] == {"src": "a b c", "tgt": "d"}  # whitespace runs become one space


def test_a_spent_budget_runs_no_stage(tmp_path: Path) -> None:
    """Under 30 s left a stage does not start (``timeout 0`` would run it without any limit)."""
    result = run_check("--dry-run", "--budget", "40", "tests", "bench", out=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "== tests: not run, the budget is spent" in result.stdout
    assert "== bench: not run, the budget is spent" in result.stdout
    assert "pytest" not in result.stdout and "trident.bench" not in result.stdout
