"""Resume and preemption: a SIGKILLed run resumes step for step, signals save and exit cleanly
(also after the last step, with W&B's service ended by the signal),
checkpoints are atomic and read safely, non-finite losses stop or skip."""

from __future__ import annotations

import csv
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig

from trident.data.batching import TokenBudgetBatchSampler
from trident.data.order import EpochShuffleSampler
from trident.errors import ConfigError, DataError, TrainingDiverged, run_with_clear_errors
from trident.launch.requeue import JobStopped, stop_outcome
from trident.runs.command_line import prepare_command_line
from trident.runs.jobs import discard_failed_run_dir, write_status
from trident.runs.pipeline import train
from trident.runs.resume import resume_arguments
from trident.tracking.wandb_files import find_offline_runs, offline_runs_to_sync, read_offline_run
from trident.weights.checkpoints import AtomicCheckpointIO

from .conftest import CONF_DIR, ROOT, SMALL, compose_config
from .entry_points import Result, run_in_process

pytestmark = pytest.mark.usefixtures("single_thread")

# Dropout on, so that the RNG state matters; epochs of 4 batches, so that the run crosses epoch
# boundaries; `last.ckpt` every 3 steps, so that the checkpoint the kill leaves is mid-epoch.
RESUMABLE = [
    *SMALL,
    "model.dropout=0.1",
    "trainer.max_steps=10",
    "trainer.limit_train_batches=4",
    "trainer.val_check_interval=5",
    "trainer.check_val_every_n_epoch=null",
    "callbacks.last_checkpoint.every_n_train_steps=3",
    "callbacks.throughput=null",
    "callbacks.lr_monitor=null",
    "test=false",
]
WITH_CSV = ["+logger.csv._target_=lightning.pytorch.loggers.CSVLogger", "+logger.csv.name=csv"]


def train_losses(run_dir: Path) -> dict[int, float]:
    """Per-step training losses from every CSV log of a run (a resumed run adds a version)."""
    losses = {}
    for metrics in sorted(run_dir.glob("csv/version_*/metrics.csv")):
        for row in csv.DictReader(metrics.open()):
            if row.get("train/loss"):
                losses[int(row["step"])] = float(row["train/loss"])
    return losses


def run_train(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    env.pop("HYDRA_FULL_ERROR", None)
    env.pop("WANDB_SERVICE", None)  # its own W&B service, as a job started from a shell has
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], check=False, capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=300)


def train_here(*args: str, cwd: Path, monkeypatch: pytest.MonkeyPatch) -> Result:
    """``python train.py <args>`` in this process, with the default logger (W&B, offline): for a run whose process
    boundary no test checks (a resume, an extension, a sweep that is not signalled): a fresh one only adds its imports."""
    with monkeypatch.context() as here:
        return run_in_process("train.py", list(args), cwd, here, wandb_mode="offline")


def signal_at(step: int, name: str) -> list[str]:
    return ["+callbacks.signal._target_=tests.resume_helpers.SignalAtStep", f"+callbacks.signal.step={step}",
            f"+callbacks.signal.signal_name={name}"]


def checkpoint_step(path: Path) -> int:
    return int(torch.load(path, map_location="cpu", weights_only=True)["global_step"])


@pytest.mark.slow
def test_sigkilled_run_resumes_step_for_step_in_the_same_wandb_run(tmp_path: Path) -> None:
    overrides = [*RESUMABLE, *WITH_CSV, "logger=wandb"]
    train(compose_config(overrides, output_dir=tmp_path / "uninterrupted"))
    expected = train_losses(tmp_path / "uninterrupted")
    assert sorted(expected) == list(range(10))

    killed = tmp_path / "killed"
    result = run_train(*overrides, *signal_at(7, "SIGKILL"), f"hydra.run.dir={killed}", cwd=tmp_path)
    assert result.returncode == -9, result.stderr[-2000:]
    last = killed / "checkpoints" / "last.ckpt"
    assert checkpoint_step(last) == 6, "killed during step 7: the newest checkpoint is the mid-epoch one of step 6"

    train(compose_config([*overrides, f"resume={killed}"], output_dir=killed))
    assert checkpoint_step(last) == 10
    resumed = {step: loss for step, loss in train_losses(killed).items() if step >= 6}
    assert sorted(resumed) == list(range(6, 10))
    torch.testing.assert_close(resumed, {step: expected[step] for step in resumed}, rtol=0, atol=1e-6)

    run_id = json.loads((killed / "run.json").read_text())["run_id"]
    run_dirs = sorted(killed.glob("wandb/offline-run-*"))
    assert len(run_dirs) == 2 and all(d.name.endswith(f"-{run_id}") for d in run_dirs), "one W&B run, continued"
    assert run_id in {run.run_id for run in find_offline_runs(killed)}  # the SIGKILLed run's record may be cut short


def test_translation_token_budget_batches_resume_exactly(tmp_path: Path) -> None:
    from .test_translation_train import SMALL_MT

    overrides = [*SMALL_MT, *WITH_CSV, "logger=none", "model.dropout=0.1", "trainer.max_steps=6",
                 "trainer.limit_train_batches=4", "trainer.val_check_interval=6", "trainer.check_val_every_n_epoch=null",
                 "test=false", "callbacks.periodic_checkpoint.every_n_train_steps=3",
                 "callbacks.periodic_checkpoint.save_top_k=-1", "callbacks.throughput=null", "callbacks.lr_monitor=null"]
    train(compose_config(overrides, output_dir=tmp_path / "a"))
    mid_epoch = tmp_path / "a" / "checkpoints" / "periodic" / "step3.ckpt"
    train(compose_config([*overrides, f"ckpt_path={mid_epoch}"], output_dir=tmp_path / "b"))
    expected, resumed = train_losses(tmp_path / "a"), train_losses(tmp_path / "b")
    assert sorted(resumed) == [3, 4, 5]
    torch.testing.assert_close(resumed, {step: expected[step] for step in resumed}, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_sigterm_after_the_last_step_stops_cleanly_and_resume_auto_tests_and_finishes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stop signal that comes after the last step's end (here during the last validation) stops the
    job at its final step like one that comes mid-run: saved, exit 0, the test left to the next
    attempt, though W&B's service has ended with the signal, as SLURM's SIGTERM ends it (the test's
    results could no longer reach it). ``resume=auto`` tests and completes the run, in its directory
    and its W&B run. (The signalled run is a process of its own; the two after it run in this one.)"""
    args = [*RESUMABLE, "test=true", f"paths.output_root={tmp_path}"]  # the default logger: W&B, offline
    signal = ["+callbacks.signal._target_=tests.resume_helpers.SignalInStage", "+callbacks.signal.stage=validate",
              "+callbacks.signal.step=10"]
    result = run_train(*args, *signal, cwd=tmp_path)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    (run_dir,) = list(tmp_path.glob("runs/*/*"))
    last = run_dir / "checkpoints" / "last.ckpt"
    assert checkpoint_step(last) == 10
    assert "Stopped by SIGTERM (cancelled)" in (run_dir / "train.log").read_text()
    status = json.loads((run_dir / "status.json").read_text())
    assert (status["status"], status["signal"], status["step"]) == ("cancelled", "SIGTERM", 10)

    resumed = train_here(*args, "resume=auto", "++callbacks.signal=null", cwd=tmp_path, monkeypatch=monkeypatch)
    assert resumed.returncode == 0 and "Traceback" not in resumed.stderr, resumed.stderr[-3000:]
    assert f"resume=auto: continuing {run_dir}" in resumed.stdout
    assert list(tmp_path.glob("runs/*/*")) == [run_dir], "the run goes on in its own directory"
    assert json.loads((run_dir / "status.json").read_text())["status"] == "completed"
    runs = find_offline_runs(run_dir)
    # (A segment whose service the signal ended may lack its run record, hence no id.)
    assert len(runs) == 2 and len({run.run_id for run in runs if run.run_id}) == 1, "one W&B run, continued"
    assert {"test/loss", "test/ppl"} <= set(runs[-1].summary)
    assert [int(row["trainer/global_step"]) for row in runs[-1].history if "train/loss" in row] == list(range(10))
    # Extended by 4 steps: from the final step's last.ckpt, not one saved again at train end (loops past their end:
    # its steps would go on at 11).
    extended = train_here(*args, f"resume={run_dir}", "trainer.max_steps=14", "++callbacks.signal=null", cwd=tmp_path,
                          monkeypatch=monkeypatch)
    assert extended.returncode == 0 and "Traceback" not in extended.stderr, extended.stderr[-3000:]
    history = find_offline_runs(run_dir)[-1].history
    assert [int(row["trainer/global_step"]) for row in history if "train/loss" in row] == list(range(14))
    assert [int(row["trainer/global_step"]) for row in history if "test/loss" in row] == [14]


@pytest.mark.parametrize("name", ["SIGTERM", "SIGUSR1"])
def test_a_stop_signal_during_the_test_stops_the_job_at_its_final_step(name: str, tmp_path: Path) -> None:
    # A test of 2 batches: Lightning's own SIGTERM handler, were it in place, would stop it after the first.
    overrides = [*RESUMABLE, "test=true", "trainer.limit_test_batches=2", "logger=none",
                 "+callbacks.signal._target_=tests.resume_helpers.SignalInStage", "+callbacks.signal.stage=test",
                 f"+callbacks.signal.signal_name={name}", "+callbacks.signal.to_wandb_service=false"]
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(JobStopped) as stopped:
        train(compose_config(overrides, output_dir=tmp_path / "run"))
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert (stopped.value.signal, stopped.value.step, stopped.value.checkpoint) == (name, 10, str(last))
    assert checkpoint_step(last) == 10, "the next attempt resumes at the final step and only tests"
    assert signal.getsignal(signal.SIGTERM) == handler, "the process's own handler is back"


def test_sigusr1_saves_and_stops_cleanly(tmp_path: Path) -> None:
    handler = signal.getsignal(signal.SIGUSR1)
    overrides = [*RESUMABLE, "logger=none", *signal_at(2, "SIGUSR1")]
    with pytest.raises(JobStopped) as stopped:
        train(compose_config(overrides, output_dir=tmp_path / "run"))
    assert (stopped.value.signal, stopped.value.step, stopped.value.outcome) == ("SIGUSR1", 3, "cancelled")
    assert checkpoint_step(tmp_path / "run" / "checkpoints" / "last.ckpt") == 3
    assert signal.getsignal(signal.SIGUSR1) == handler, "the process's own handler is back after fit"


def test_sigterm_at_two_epoch_ends_resumes_step_for_step(tmp_path: Path) -> None:
    """Epochs of 2 steps, stopped by SIGTERM at the end of epochs 0 and 1 (after steps 2 and 4), resumed to 6: the
    uninterrupted run's losses. Lightning counted the epoch after a resumed epoch end as never begun: the second
    resume gave the sampler the epoch before again (trident.runs.attempts.EpochBoundaryResume; the counters, a stop
    mid-epoch after one at an epoch end and extensions: tests/test_epoch_resume.py)."""
    overrides = [*RESUMABLE, *WITH_CSV, "logger=none", "trainer.max_steps=6", "trainer.limit_train_batches=2",
                 "trainer.val_check_interval=6"]
    train(compose_config(overrides, output_dir=tmp_path / "whole"))
    run = tmp_path / "stopped"
    for attempt, step in enumerate((1, 3)):  # the signal as step 2 (4) begins: saved at its end
        resume = [f"resume={run}"] if attempt else []
        with pytest.raises(JobStopped) as stopped:
            train(compose_config([*overrides, *signal_at(step, "SIGTERM"), *resume], output_dir=run))
        assert stopped.value.step == step + 1
    train(compose_config([*overrides, f"resume={run}"], output_dir=run))
    expected, resumed = train_losses(tmp_path / "whole"), train_losses(run)
    assert sorted(resumed) == list(range(6))
    torch.testing.assert_close(resumed, expected, rtol=0, atol=1e-6)


def test_resume_arguments_reuse_the_run_overrides(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text("- model=nano\n- trainer.max_steps=10\n- resume=null\n")
    args = resume_arguments([f"resume={run_dir}", "trainer.max_steps=20"], None, CONF_DIR)
    assert args == ["model=nano", "trainer.max_steps=20", f"hydra.run.dir={run_dir}", f"resume={run_dir}"]
    assert resume_arguments(["model=nano"], None, CONF_DIR) == ["model=nano"]
    with pytest.raises(ConfigError, match="not a run directory of train.py"):
        resume_arguments([f"resume={tmp_path / 'nowhere'}"], None, CONF_DIR)
    with pytest.raises(ConfigError, match="drop -m"):
        resume_arguments(["-m", f"resume={run_dir}"], None, CONF_DIR)
    assert resume_arguments(["resume=auto", "model=nano", f"paths.output_root={tmp_path}"], None, CONF_DIR) == [
        "model=nano", f"paths.output_root={tmp_path}"], "nothing to resume: a new run"


def test_resume_auto_continues_only_a_run_started_with_the_same_settings(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The run name leaves out the learning rate, distillation, the fine-tuning method...: ``resume=auto`` with
    another of those settings starts a new run (and says which run it did not continue, and why) instead of
    continuing one trained otherwise; the settings a resume may change (the step budget, the logger) still match."""
    name = "lm-shakespeare-nano-rope-seed1337"

    def run(when: str, overrides: list[str]) -> Path:
        run_dir = tmp_path / "runs" / "2000-01-01" / f"{when}_{name}"
        (run_dir / ".hydra").mkdir(parents=True)
        (run_dir / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
        (run_dir / "config_resolved.yaml").write_text(f"run_name: {name}\n")
        (run_dir / "checkpoints").mkdir()
        (run_dir / "checkpoints" / "last.ckpt").write_bytes(b"checkpoint")
        return run_dir

    plain = run("00-00-01", ["model=nano", "trainer.max_steps=10"])
    distilled = run("00-00-02", ["model=nano", "distill=kd", "distill.teacher=/teacher"])
    here = ["model=nano", f"paths.output_root={tmp_path}"]
    assert resume_arguments(["resume=auto", *here, "trainer.max_steps=20", "logger=csv"], None, CONF_DIR)[-1] == (
        f"resume={plain.resolve()}"), "the newer, distilled run is not this command line's"
    assert resume_arguments(["resume=auto", *here, "distill=kd", "distill.teacher=/teacher"], None, CONF_DIR)[-1] == (
        f"resume={distilled.resolve()}")
    capsys.readouterr()
    fresh = resume_arguments(["resume=auto", *here, "optimizer.lr=0.1"], None, CONF_DIR)
    assert fresh == here + ["optimizer.lr=0.1"], "other settings: a new run"
    said = capsys.readouterr().out
    assert f"2 run(s) of {name}" in said and "none with these settings" in said and "starting a new run" in said
    assert f"{distilled}: distill=kd there, (default) here" in said, said


def test_atomic_save_never_replaces_a_good_checkpoint_with_a_partial_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    io, path = AtomicCheckpointIO(), tmp_path / "last.ckpt"
    io.save_checkpoint({"global_step": 1, "weight": torch.ones(3)}, path)

    def crash_mid_write(obj: object, file: object) -> None:
        file.write(b"PK\x03\x04 half a checkpoint")  # type: ignore[attr-defined]
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash_mid_write)
    with pytest.raises(OSError, match="disk full"):
        io.save_checkpoint({"global_step": 2, "weight": torch.zeros(3)}, path)
    monkeypatch.undo()
    assert io.load_checkpoint(path)["global_step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"], "no temporary file left behind"


class NotPlainData:
    """Anything torch.load(weights_only=True) must refuse to unpickle."""


def test_truncated_or_foreign_checkpoint_is_one_clear_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    io, path = AtomicCheckpointIO(), tmp_path / "run" / "checkpoints" / "last.ckpt"
    io.save_checkpoint({"global_step": 1, "weight": torch.ones(1000)}, path)
    path.write_bytes(path.read_bytes()[:500])
    cfg = compose_config([*SMALL, "logger=none", f"resume={tmp_path / 'run'}"], output_dir=tmp_path / "run")
    with pytest.raises(SystemExit) as exit_info:
        run_with_clear_errors(lambda: train(cfg), lambda: discard_failed_run_dir(tmp_path / "run"))
    assert exit_info.value.code == 2
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert message.startswith(f"error: cannot read checkpoint '{path}'") and "corrupt or truncated" in message

    torch.save({"state_dict": {}, "payload": NotPlainData()}, path)
    with pytest.raises(DataError, match="pickled Python objects.*weights_only=True"):
        io.load_checkpoint(path)


def nan_config(tmp_path: Path, mode: str, *overrides: str) -> DictConfig:
    return compose_config([*RESUMABLE, "logger=none", "trainer.max_steps=5", "callbacks.last_checkpoint.every_n_train_steps=1",
                           "task._target_=tests.resume_helpers.NaNLossLanguageModel", "+task.nan_at_step=2",
                           f"nonfinite_loss={mode}", *overrides], output_dir=tmp_path / "run")


def finite_weights(path: Path) -> bool:
    state = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
    return all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point())


def test_nonfinite_loss_stops_before_the_bad_step_and_keeps_the_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(TrainingDiverged, match=r"non-finite training loss nan at step 3: lower optimizer.lr") as err:
        train(nan_config(tmp_path, "stop"))
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert str(last) in str(err.value)
    assert checkpoint_step(last) == 2 and finite_weights(last)


def test_nonfinite_loss_skip_drops_only_that_step(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="trident.training.resilience"):
        metrics = train(nan_config(tmp_path, "skip"))
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert skipped == ["non-finite training loss nan at step 3: step skipped (nonfinite_loss=skip)"]
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert checkpoint_step(last) == 5 and finite_weights(last)
    assert torch.isfinite(torch.tensor(metrics["train/loss"]))


def test_a_nonfinite_loss_in_an_earlier_micro_batch_of_the_step_is_named(tmp_path: Path) -> None:
    """Under accumulation the guard checks the loss of every micro-batch of the step, not the last one's alone:
    the first micro-batch's NaN loss (the second's finite) is named as the loss it is. Checking the last one
    alone, only the NaN gradients it left stopped the run here ("non-finite training gradient"); under fp16,
    where gradients are not checked (the scaler skips infinite ones), nothing stopped it."""
    cfg = nan_config(tmp_path, "stop", "trainer.accumulate_grad_batches=2", "+task.nan_micro_batch=0")
    with pytest.raises(TrainingDiverged, match=r"non-finite training loss nan at step 3: lower optimizer.lr"):
        train(cfg)
    assert checkpoint_step(tmp_path / "run" / "checkpoints" / "last.ckpt") == 2


def test_epoch_order_is_a_function_of_seed_and_epoch_and_skips_once() -> None:
    sampler = EpochShuffleSampler(size=20, batch_size=4, seed=3)
    sampler.set_epoch(1)
    epoch_one = list(sampler)
    assert sorted(epoch_one) == list(range(20)) and list(sampler) == epoch_one
    sampler.set_epoch(2)
    assert list(sampler) != epoch_one
    torch.manual_seed(0)  # the global RNG plays no part
    other = EpochShuffleSampler(size=20, batch_size=4, seed=3)
    other.set_epoch(1)
    other.skip_next(2)
    assert list(other) == epoch_one[8:] and list(other) == epoch_one, "the skip applies to the next pass only"


def test_token_budget_batches_skip_ahead_within_an_epoch() -> None:
    lengths = list(range(1, 60))
    sampler = TokenBudgetBatchSampler(lengths, lengths, max_tokens=120, seed=1)
    sampler.set_epoch(4)
    full = list(sampler)
    sampler.set_epoch(4)
    sampler.skip_next(3)
    assert list(sampler) == full[3:]
    assert list(sampler) != full, "the next pass is the next epoch, from its start"


def test_a_ddp_ranks_resumed_share_continues_where_it_stopped() -> None:
    shares = []
    for rank in (0, 1):
        full = list(EpochShuffleSampler(21, batch_size=2, seed=3, num_replicas=2, rank=rank))
        resumed = EpochShuffleSampler(21, batch_size=2, seed=3, num_replicas=2, rank=rank)
        resumed.skip_next(3)
        assert list(resumed) == full[6:], "three of this rank's batches of 2 skipped, not three of the shared order"
        assert list(resumed) == full, "the skip holds for one pass only"
        shares.append(full)
    order = EpochShuffleSampler(21, batch_size=2, seed=3).permutation(0).tolist()
    assert shares[0][:10] == order[0:20:2] and shares[1][:10] == order[1:20:2], "rank r takes every other index"


@pytest.mark.parametrize(("restarts", "outcome"), [(1, "requeued"), (0, "cancelled")])
def test_sigterm_under_slurm_is_a_requeue_when_slurm_counted_a_restart(
    restarts: int, outcome: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    scontrol = tmp_path / "scontrol"  # what `scontrol show job -o <id>` prints, in part
    scontrol.write_text(f"#!/bin/sh\necho 'JobId=12 JobState=COMPLETING Requeue=1 Restarts={restarts} BatchFlag=1'\n")
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "12")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    assert stop_outcome("SIGTERM") == outcome
    assert stop_outcome("SIGUSR1") == "requeued", "SIGUSR1/SIGUSR2 ask for a requeue"


def test_status_of_a_requeued_job_keeps_its_stops(tmp_path: Path) -> None:
    cfg = compose_config(SMALL)
    write_status(tmp_path, cfg, "requeued", **JobStopped("SIGTERM", 7, "last.ckpt", "requeued", "12").record())
    write_status(tmp_path, cfg, "completed", metrics={"val/loss": 1.0})
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["status"] == "completed"
    assert status["requeues"] == [{"signal": "SIGTERM", "step": 7, "slurm_job": "12"}]


@pytest.mark.slow
def test_a_sweep_job_extended_by_its_directory_continues_step_for_step_in_its_sweep(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 30-step sweep job (its last step no periodic checkpoint's: last.ckpt is of the final step), extended
    by 10 steps with ``resume=<job dir>``: the newest W&B attempt, which the upload command picks, holds steps
    0-39 once each and one test row, in the sweep's group, job type and tags; metrics.jsonl and the CSV
    logs say the same steps; status.json keeps the sweep and setting."""
    sweep_dir = tmp_path / "sweep"
    common = [*SMALL, "trainer.val_check_interval=10", "data.sample_prompts=[]", "callbacks.throughput=null", *WITH_CSV]
    first = train_here("-m", *common, "trainer.max_steps=30", "optimizer.lr=choice(0.003)", f"paths.output_root={tmp_path}",
                       f"hydra.sweep.dir={sweep_dir}", cwd=tmp_path, monkeypatch=monkeypatch)
    assert first.returncode == 0, first.stderr[-3000:]
    job_dir = next(sweep_dir.glob("0_*"))
    status = json.loads((job_dir / "status.json").read_text())
    (first_attempt,) = find_offline_runs(job_dir)
    assert first_attempt.group.endswith("/optimizer.lr=0.003") and first_attempt.job_type == status["sweep"]

    extended = train_here(f"resume={job_dir}", "trainer.max_steps=40", cwd=tmp_path, monkeypatch=monkeypatch)
    assert extended.returncode == 0, extended.stderr[-3000:]
    resumed = json.loads((job_dir / "status.json").read_text())
    assert (resumed["sweep"], resumed["setting"]) == (status["sweep"], status["setting"]) == (
        first_attempt.job_type, "optimizer.lr=0.003")
    (upload,) = offline_runs_to_sync([sweep_dir])
    assert len(list(job_dir.glob("wandb/offline-run-*"))) == 2 and upload == max(job_dir.glob("wandb/offline-run-*"))
    run = read_offline_run(next(upload.glob("run-*.wandb")))
    assert (run.run_id, run.group, run.job_type, run.tags) == (
        first_attempt.run_id, first_attempt.group, first_attempt.job_type, first_attempt.tags)
    assert [row["trainer/global_step"] for row in run.history if "train/loss" in row] == list(range(40))
    # The same step for the same event in W&B, metrics.jsonl (below) and the checkpoint names, across the attempts.
    assert [row["trainer/global_step"] for row in run.history if "val/loss" in row] == [10, 20, 30, 40]
    assert [row["trainer/global_step"] for row in run.history if "test/loss" in row] == [40]
    rows = [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["stage"]) for r in rows] == [(10, "validate"), (20, "validate"), (30, "validate"),
                                                       (40, "validate"), (40, "test")]
    assert sorted(train_losses(job_dir)) == list(range(40))
    assert sorted(p.name for p in (job_dir / "checkpoints").iterdir()) == ["best-step40.ckpt", "last.ckpt"]


@pytest.mark.slow
def test_a_sweep_job_resumed_by_a_sweep_that_sweeps_more_keys_keeps_its_group(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job left unfinished (its last.ckpt, no status.json, as a kill leaves it) and found again by a sweep continued
    with one more swept key (model.dropout, one of the job's own overrides): resumed in its directory, it keeps its
    first attempt's W&B group and status.json setting (named by the new keys, the resumed run changed group)."""
    sweep_dir = tmp_path / "sweep"
    common = [*SMALL, "trainer.max_steps=2", "data.sample_prompts=[]", "callbacks.throughput=null", "optimizer.lr=choice(0.003)",
              f"paths.output_root={tmp_path}", f"hydra.sweep.dir={sweep_dir}"]
    first = train_here("-m", *common, "model.dropout=0.0", cwd=tmp_path, monkeypatch=monkeypatch)
    assert first.returncode == 0, first.stderr[-3000:]
    job_dir = next(sweep_dir.glob("0_*"))
    status = json.loads((job_dir / "status.json").read_text())
    (job_dir / "status.json").unlink()
    again = train_here("-m", *common, "model.dropout=choice(0.0)", cwd=tmp_path, monkeypatch=monkeypatch)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "continuing the unfinished job" in again.stdout + again.stderr and [d.name for d in sweep_dir.glob("*_*")] == [job_dir.name]
    attempts = [read_offline_run(next(d.glob("run-*.wandb"))) for d in sorted(job_dir.glob("wandb/offline-run-*"))]
    assert len(attempts) == 2 and len({(run.run_id, run.group, run.job_type, tuple(run.tags)) for run in attempts}) == 1
    assert attempts[0].group.endswith("/optimizer.lr=0.003")
    resumed = json.loads((job_dir / "status.json").read_text())
    assert (resumed["status"], resumed["sweep"], resumed["setting"]) == ("completed", status["sweep"], status["setting"])


def test_a_resume_may_set_keys_of_the_groups_the_run_chose(tmp_path: Path) -> None:
    """``resume=<run dir> callbacks.early_stopping.patience=100`` (what the early stop's warning advises) is
    checked against the run's config, which callbacks=early_stopping gave that key; a misspelt key still fails."""
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "overrides.yaml").write_text("- model=nano\n- callbacks=early_stopping\n")
    arguments = prepare_command_line([f"resume={tmp_path}", "callbacks.early_stopping.patience=100"], CONF_DIR)
    assert arguments[:3] == ["model=nano", "callbacks=early_stopping", "callbacks.early_stopping.patience=100"]
    with pytest.raises(SystemExit):
        prepare_command_line([f"resume={tmp_path}", "callbacks.early_stopping.patiense=100"], CONF_DIR)
