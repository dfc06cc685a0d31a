"""trident on a real SLURM cluster: two nodes on this machine (``scripts/slurm_cluster.sh``).

Every job goes through the launcher command of docs/scaling.md with the default logger (W&B, offline):
2-node DDP jobs of each task train step for step like 2 processes on one node; a 2-seed sweep is
2 SLURM jobs that ``python -m trident.report`` reads; a job requeued mid-run twice (at its time
limit's signal, then by a preemption) and one cancelled with ``scancel`` each end exactly like the
uninterrupted job. The nodes have one CPU each, so jobs are tiny and runs are shared (:class:`Runs`).
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from trident.tracking.wandb_files import OfflineRun, find_offline_runs

from .conftest import ROOT
from .shared_runs import TASK_RUNS, one_node_run
from .slurm_jobs import CHECKPOINT_S, Job, env, finish, run_until, start, submitted_job, sweep_end

CLUSTER = ROOT / "scripts" / "slurm_cluster.sh"


def _cluster_ready() -> bool:
    try:
        return subprocess.run([str(CLUSTER), "status"], capture_output=True, timeout=30, check=False).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


pytestmark = [
    pytest.mark.slurm,
    pytest.mark.slow,
    pytest.mark.skipif(not _cluster_ready(), reason="no SLURM cluster here: start one with `sudo scripts/slurm_cluster.sh start`"),
]

# docs/scaling.md's command for a CPU cluster: one rank per node on two nodes.
SLURM = ["-m", "hydra/launcher=slurm", "trainer=ddp_cpu", "trainer.devices=1", "trainer.num_nodes=2",
         "hydra.launcher.cpus_per_task=1"]
# The LM's run (tests/shared_runs.py, shared with tests/test_ddp_matrix.py): 24 steps, a checkpoint every 2, so that
# a job is interrupted soon after one, well before the last validation (at 24). (A SIGTERM during it, which
# ends W&B's service too, stops the job at its final step: tests/test_resume.py.)
LM = TASK_RUNS["lm"]
TASKS = TASK_RUNS
# Slow steps (0.25 s) leave time to interrupt a job mid-run, between validations; they change no number.
SLOW = ["+callbacks.slow._target_=tests.resume_helpers.SlowSteps", "+callbacks.slow.seconds=0.25"]
CHECKPOINT = "multirun/*/*/*/checkpoints/last.ckpt"


def _sweep_jobs(root: Path) -> list[Path]:
    (sweep,) = list((root / "multirun").glob("*/*"))
    return sorted((p for p in sweep.iterdir() if (p / ".hydra").is_dir()), key=lambda p: int(p.name.split("_")[0]))


def _status(job_dir: Path) -> dict:
    return json.loads((job_dir / "status.json").read_text())


@functools.cache  # read once (a process per file) when several tests compare with a run, once it has ended
def _wandb(run_dir: Path) -> OfflineRun:
    """The run's one W&B id, and its newest attempt's offline run: a requeued or resumed job adds
    one, which holds the whole history (the earlier rows sent again, since SLURM's SIGTERM can end
    W&B's service before it writes them)."""
    runs = [run for run in find_offline_runs(run_dir) if run.run_id]
    assert len({run.run_id for run in runs}) == 1, [run.path for run in runs]
    return runs[-1]


def _losses(run: OfflineRun) -> dict[int, float]:
    """Per-step training loss (W&B's ``trainer/global_step`` counts the steps done, so step s's loss has s+1)."""
    steps = [row["trainer/global_step"] for row in run.history if "train/loss" in row]
    assert len(steps) == len(set(steps)), f"a step was logged twice: {steps}"
    return {row["trainer/global_step"]: row["train/loss"] for row in run.history if "train/loss" in row}


def _validations(run_dir: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(row["step"], row["val/loss"]) for row in rows if row["stage"] == "validate"]


def _no_traceback(root: Path) -> None:
    logs = [*root.glob("multirun/*/*/.submitit/*/*_log.*"), *root.glob("**/train.log")]
    assert logs
    for log in logs:
        assert "Traceback" not in log.read_text(), f"{log}:\n{log.read_text()[-3000:]}"


def _status_is(run_dir: Path, status: str) -> bool:
    try:
        return _status(run_dir)["status"] == status
    except (FileNotFoundError, json.JSONDecodeError):  # not written yet, or being written
        return False


def _checkpoint_step(root: Path) -> int:
    """The training step of the newest checkpoint of the (one) job of a sweep under ``root``; 0 before the first."""
    found = list(root.glob(CHECKPOINT))
    return _saved_step(found[0], found[0].stat().st_mtime_ns) if found else 0


@functools.cache
def _saved_step(checkpoint: Path, mtime_ns: int) -> int:
    """A checkpoint's training step, read once per version of the file (each written atomically)."""
    return torch.load(checkpoint, weights_only=True)["global_step"]


@dataclass
class Interrupted:
    """An LM job of seed 1, slowed down and interrupted: its sweep's exit status and stderr, its run
    directory, its ``status.json`` when the sweep ended and, for a job that ended there, the exit
    status and stderr of the run that resumed it."""

    root: Path
    returncode: int
    stderr: str
    run_dir: Path
    status: dict[str, Any]
    resumed: tuple[int, str] | None = None


def _requeued_twice(root: Path) -> Interrupted:
    """Sent the time-limit signal once a checkpoint exists, then preempted once its second attempt has
    saved one of its own: SLURM runs it three times, each attempt resuming the one before."""
    # SLURM warns a job before its time limit with the signal that submitit asks for (sbatch
    # --signal=USR2@<signal_delay_s>); sent here mid-run, as submitit's own tests do, since a real
    # limit of minutes would land anywhere on this shared machine.
    limit = ["hydra.launcher.timeout_min=10", "hydra.launcher.max_num_timeout=1"]
    job = submitted_job(root, start(root, *SLURM, *LM, *SLOW, "seed=1", *limit))
    run_until(job, lambda: _checkpoint_step(root) > 0, "checkpoint", running_s=CHECKPOINT_S)
    subprocess.run(["scancel", "--signal=USR2", job.id], check=True)
    run_dir = _sweep_jobs(root)[0]
    # Once the first attempt has stopped (a few steps in), a checkpoint at step 10 is the second's:
    # it has run the validation at step 8 and is well before the one at 16.
    run_until(job, lambda: _status_is(run_dir, "requeued"), "requeue at the time-limit signal")
    run_until(job, lambda: _checkpoint_step(root) >= 10, "checkpoint of the second attempt")
    subprocess.run(["scontrol", "requeue", job.id], check=True)
    rc, err = sweep_end(job)
    return Interrupted(root, rc, err, run_dir, _status(run_dir))


def _cancelled_then_resumed(root: Path) -> Interrupted:
    """Cancelled with ``scancel`` once a checkpoint exists, then continued by the same 2 ranks, outside
    SLURM: its 2 nodes started by hand on this machine."""
    job = submitted_job(root, start(root, *SLURM, *LM, *SLOW, "seed=1"))
    run_until(job, lambda: _checkpoint_step(root) > 0, "checkpoint", running_s=CHECKPOINT_S)
    subprocess.run(["scancel", job.id], check=True)
    rc, err = sweep_end(job)
    run_dir = _sweep_jobs(root)[0]
    stopped = _status(run_dir)
    return Interrupted(root, rc, err, run_dir, stopped, _two_nodes_by_hand(root, f"resume={run_dir}"))


def _two_node_sweep(root: Path, task: str, seeds: str) -> Path:
    rc, err = sweep_end(submitted_job(root, start(root, *SLURM, *TASKS[task], seeds)))
    assert rc == 0, err[-3000:]
    assert "jobs of the sweep completed" in err
    return root


def _two_nodes_by_hand(root: Path, *args: str) -> tuple[int, str]:
    """A 2-node run (the job's own trainer.num_nodes=2, one rank a node) as two ``train.py`` processes started by
    hand on this machine, node 0 and node 1 (``NODE_RANK``); the worse exit status and both consoles."""
    nodes = [start(root, *args, environment={**env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517",
                                             "NODE_RANK": str(rank)}) for rank in (0, 1)]
    ended = [finish(node) for node in nodes]
    return max((rc for rc, _ in ended), key=abs), "\n".join(err for _, err in ended)


class Runs:
    """Every run of this module, started together when a test first needs one, then shared: each task
    as one 2-node SLURM job (the LM as a 2-seed sweep) and as 2 processes on one node (``<task>-one-node``,
    tests/shared_runs.py); the interrupted LM jobs ``requeued`` and ``cancelled`` (resumed as two nodes
    started by hand). SLURM runs its jobs in turn (a requeued one goes back in line) while the runs on
    this machine go one after another beside them: their imports overlap the jobs' sleeps and waits."""

    def __init__(self, root: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
        # A thread per sweep waits for it (and interrupts it); one more runs the local runs in turn.
        self._sweeps = ThreadPoolExecutor(max_workers=5)
        self._local = ThreadPoolExecutor(max_workers=1)
        self._interrupted = {
            "requeued": self._sweeps.submit(_requeued_twice, root / "requeued"),
            "cancelled": self._sweeps.submit(_cancelled_then_resumed, root / "cancelled"),
        }
        self._dirs: dict[str, Future[Path]] = {}
        for task in TASKS:
            seeds = "seed=1,2" if task == "lm" else "seed=1"
            self._dirs[task] = self._sweeps.submit(_two_node_sweep, root / task, task, seeds)
        for task in TASK_RUNS:  # shared with tests/test_ddp_matrix.py, which checks them as runs of their own
            self._dirs[f"{task}-one-node"] = self._local.submit(one_node_run, tmp_path_factory, task)

    def __getitem__(self, name: str) -> Path:
        """The sweep directory of a task's SLURM job, or the run directory of a local run."""
        return self._dirs[name].result()

    def interrupted(self, name: str) -> Interrupted:
        return self._interrupted[name].result()

    def close(self) -> None:
        """Wait for every run: none outlives the module."""
        self._sweeps.shutdown()
        self._local.shutdown()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, _shared_data_cache: None) -> Iterator[Runs]:
    runs = Runs(tmp_path_factory.mktemp("slurm"), tmp_path_factory)
    yield runs
    runs.close()


@pytest.mark.parametrize("task", list(TASKS))
def test_two_node_job_trains_like_two_processes_on_one_node(runs: Runs, task: str) -> None:
    job = _sweep_jobs(runs[task])[0]
    _no_traceback(runs[task])
    status = _status(job)
    assert status["status"] == "completed" and "requeues" not in status
    run = _wandb(job)
    assert run.config["trainer"]["num_nodes"] == 2 and run.finished
    assert any(key.startswith("test/") for key in run.summary), run.summary
    assert list(job.parent.glob(".submitit/*/*_1_log.out")), "rank 1 ran as the second task"
    two_nodes, one_node = _losses(run), _losses(_wandb(runs[f"{task}-one-node"]))
    assert len(two_nodes) >= 3 and list(two_nodes) == list(one_node)
    assert list(two_nodes.values()) == pytest.approx(list(one_node.values()), rel=1e-5)


def test_two_seeds_are_two_slurm_jobs_and_one_report(runs: Runs) -> None:
    jobs = _sweep_jobs(runs["lm"])
    assert len({json.loads((job / "run.json").read_text())["slurm_job"] for job in jobs}) == len(jobs) == 2
    assert [_status(job)["status"] for job in jobs] == ["completed"] * 2
    sweep = jobs[0].parent
    result = subprocess.run([sys.executable, "-m", "trident.report", str(sweep)], capture_output=True, text=True, env=env(), check=False)
    assert result.returncode == 0, result.stderr
    assert "| 2 |" in (sweep / "report.md").read_text(), "one setting, n = 2 seeds"


def _ends_like_uninterrupted(run_dir: Path, runs: Runs) -> None:
    reference = _sweep_jobs(runs["lm"])[0]
    validations = _validations(run_dir)
    assert validations == _validations(reference), "one continuous metrics log, ending like the uninterrupted job"
    assert [step for step, _ in validations] == sorted({step for step, _ in validations})
    expected = _losses(_wandb(reference))
    resumed = _losses(_wandb(run_dir))
    assert list(resumed) == list(expected), "W&B holds every step once, in order"
    assert list(resumed.values()) == pytest.approx(list(expected.values()), rel=1e-5)


def _requeued_and_completed(runs: Runs) -> Interrupted:
    """The job requeued twice, checked for what both requeues prove: it completed in SLURM, with no
    traceback, exactly like the uninterrupted job."""
    job = runs.interrupted("requeued")
    assert job.returncode == 0, job.stderr[-3000:]
    _no_traceback(job.root)
    assert job.status["status"] == "completed", job.status
    _ends_like_uninterrupted(job.run_dir, runs)
    return job


def test_time_limit_checkpoints_at_the_signal_and_the_job_finishes(runs: Runs) -> None:
    job = _requeued_and_completed(runs)
    time_limit, _ = job.status["requeues"]
    assert time_limit["signal"] == "SIGUSR2" and 0 < time_limit["step"] < 24


def test_preempted_job_is_requeued_and_resumes_exactly(runs: Runs) -> None:
    job = _requeued_and_completed(runs)
    time_limit, preemption = job.status["requeues"]
    assert preemption["signal"] == "SIGTERM" and time_limit["step"] < preemption["step"] < 24
    # Each attempt after the first resumed the run from its newest checkpoint.
    assert (job.run_dir / "train.log").read_text().count("requeued SLURM job") == 2


def test_scancel_leaves_a_complete_checkpoint_and_resume_continues_exactly(runs: Runs) -> None:
    job = runs.interrupted("cancelled")
    assert job.returncode == 1 and "cancelled by SIGTERM" in job.stderr, job.stderr[-3000:]
    assert job.status["status"] == "cancelled" and job.status["signal"] == "SIGTERM"
    checkpoint = job.run_dir / "checkpoints" / "last.ckpt"
    assert Path(job.status["checkpoint"]) == checkpoint
    # The same 2 ranks, here as 2 nodes started by hand, continued the run from that checkpoint
    # (a run started over would end like the uninterrupted one too).
    assert job.resumed is not None
    rc, err = job.resumed
    assert rc == 0 and "Traceback" not in err, err[-3000:]
    _no_traceback(job.root)
    assert f"Restored all states from the checkpoint at {checkpoint}" in (job.run_dir / "train.log").read_text()
    assert _status(job.run_dir)["status"] == "completed"
    _ends_like_uninterrupted(job.run_dir, runs)


def test_two_nodes_by_hand_train_like_two_processes_on_one_node(runs: Runs) -> None:
    """The cancelled job's steps after its checkpoint ran on 2 nodes started by hand (MASTER_ADDR, NODE_RANK):
    each one's loss is that of the run of 2 processes on one node."""
    job = runs.interrupted("cancelled")
    assert job.resumed is not None and job.resumed[0] == 0, job.resumed
    resumed_at = job.status["step"]  # the steps done when it was cancelled: the steps after it ran by hand
    by_hand = {step: loss for step, loss in _losses(_wandb(job.run_dir)).items() if step >= resumed_at}
    assert len(by_hand) >= 4, f"cancelled at step {resumed_at} of 24: too few steps left to compare"
    one_node = _losses(_wandb(runs["lm-one-node"]))
    assert by_hand == pytest.approx({step: one_node[step] for step in by_hand}, rel=1e-5)


def test_a_job_whose_log_directory_appears_after_sbatch_still_runs(tmp_path: Path) -> None:
    """submitit makes ``.submitit/<array id>_<task>/`` only once sbatch has returned the id; this cluster
    starts a job within milliseconds, and the node prolog (scripts/slurm_cluster.sh) waits for the
    directory. A 2-task array of 2-node jobs with an srun step, as submitit submits a 2-seed sweep."""
    out = tmp_path / "logs"
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--array=0-1", "--nodes=2", "--ntasks-per-node=1", f"--output={out}/%A_%a/log.out",
         "--wrap", f"srun --output={out}/%A_%a/step_%t.out echo step && echo ran"],
        capture_output=True, text=True, check=True, cwd=tmp_path)
    array = submitted.stdout.strip().split(";")[0]
    time.sleep(1)  # long after SLURM would have started the jobs without the prolog
    logs = [out / f"{array}_{task}" for task in (0, 1)]
    for log_dir in logs:
        log_dir.mkdir(parents=True)
    queued = ["squeue", "-h", "-j", array]
    run_until(Job(array, out), lambda: not subprocess.run(queued, capture_output=True, text=True, check=False).stdout.strip(),
              "end of the array")
    for log_dir in logs:
        assert (log_dir / "log.out").read_text().strip() == "ran", log_dir
        assert [(log_dir / f"step_{rank}.out").read_text().strip() for rank in (0, 1)] == ["step", "step"]
