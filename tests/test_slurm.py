"""trident on a real SLURM cluster: two nodes on this machine (``scripts/slurm_cluster.sh``).

Every job goes through the README's launcher command with the default logger (W&B, offline):
2-node DDP jobs of each task train step for step like 2 processes on one node; a 3-seed sweep is
3 SLURM jobs that ``python -m trident.report`` reads; a job requeued mid-run (preemption), one
that reaches its time limit and one cancelled with ``scancel`` each end exactly like the
uninterrupted job. The nodes have one CPU each, so jobs are tiny and runs are shared.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trident.runs.wandb_files import OfflineRun, find_offline_runs

from .conftest import ROOT, SMALL
from .test_translation_train import SMALL_MT
from .test_vit_pipeline import VIT_SMALL

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

# The README's command for a CPU cluster: one rank per node on two nodes.
SLURM = ["-m", "hydra/launcher=slurm", "trainer=ddp_cpu", "trainer.devices=1", "trainer.num_nodes=2",
         "hydra.launcher.cpus_per_task=1"]
# The same 2 ranks as processes of one machine.
ONE_NODE = ["trainer=ddp_cpu"]
QUIET = ["callbacks.progress_bar=null", "callbacks.model_summary=null", "callbacks.throughput=null"]
LM = [o for o in SMALL if not o.startswith(("trainer.max_steps", "trainer.val_check_interval", "callbacks."))]
LM += [*QUIET, "trainer.max_steps=24", "trainer.val_check_interval=8", "callbacks.last_checkpoint.every_n_train_steps=4"]
TASKS = {
    "lm": LM,
    "translation": [o for o in SMALL_MT if not o.startswith("callbacks.")] + QUIET,
    "vit": [o for o in VIT_SMALL if not o.startswith("callbacks.")] + QUIET,
}
# Slow steps (0.5 s) leave time to interrupt a job mid-run; they change no number.
SLOW = ["+callbacks.slow._target_=tests.resume_helpers.SlowSteps", "+callbacks.slow.seconds=0.5"]


def _env() -> dict[str, str]:
    # The jobs inherit this environment (sbatch exports it): the tests' helpers, one thread.
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}


def _train(root: Path, *args: str) -> subprocess.Popen[str]:
    root.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(ROOT / "train.py"), *args, f"paths.output_root={root}"]
    return subprocess.Popen(command, cwd=root, env=_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _finish(process: subprocess.Popen[str], timeout: float = 900) -> tuple[int, str]:
    _, err = process.communicate(timeout=timeout)
    return process.returncode, err


def _sweep_jobs(root: Path) -> list[Path]:
    (sweep,) = list((root / "multirun").glob("*/*"))
    return sorted((p for p in sweep.iterdir() if (p / ".hydra").is_dir()), key=lambda p: int(p.name.split("_")[0]))


def _status(job_dir: Path) -> dict:
    return json.loads((job_dir / "status.json").read_text())


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


def _slurm_job(root: Path) -> str:
    """The SLURM job id of the (one) job that a sweep under ``root`` submitted, once submitted."""
    for _ in range(300):
        jobs = list(root.glob("multirun/*/*/.submitit/*/*_submitted.pkl"))
        if jobs:
            return jobs[0].parent.name
        time.sleep(1)
    raise AssertionError("no job was submitted")


def _wait_for(path_glob: str, root: Path, timeout: float = 600) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = list(root.glob(path_glob))
        if found:
            return found[0]
        time.sleep(0.5)
    raise AssertionError(f"{path_glob} did not appear under {root}")


def _start_requeued(job: str, process: subprocess.Popen[str]) -> None:
    """SLURM holds a requeued job for about 2 minutes (BeginTime): start it now, until the sweep ends."""
    while process.poll() is None:
        state = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T %r"], capture_output=True, text=True, check=False).stdout
        if "PENDING" in state and "BeginTime" in state:
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True)
        time.sleep(2)


class Runs:
    """Each task as one 2-node SLURM job (the LM as a 3-seed sweep), and as 2 processes on one
    node (``<task>-one-node``); run when a test first needs them, then shared."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.dirs: Runs = {}

    def __getitem__(self, name: str) -> Path:
        task = name.removesuffix("-one-node")
        if name not in self.dirs:
            seeds = "seed=1,2,3" if task == "lm" else "seed=1"
            rc, err = _finish(_train(self.root / task, *SLURM, *TASKS[task], seeds))
            assert rc == 0, err[-3000:]
            assert "jobs of the sweep completed" in err
            rc, err = _finish(_train(self.root / f"{task}-one-node", *ONE_NODE, *TASKS[task], "seed=1", "hydra.run.dir=run"))
            assert rc == 0, err[-3000:]
            self.dirs[task], self.dirs[f"{task}-one-node"] = self.root / task, self.root / f"{task}-one-node" / "run"
        return self.dirs[name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, _shared_data_cache: None) -> Runs:
    return Runs(tmp_path_factory.mktemp("slurm"))


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


def test_three_seeds_are_three_slurm_jobs_and_one_report(runs: Runs) -> None:
    jobs = _sweep_jobs(runs["lm"])
    assert len({json.loads((job / "run.json").read_text())["slurm_job"] for job in jobs}) == len(jobs) == 3
    assert [_status(job)["status"] for job in jobs] == ["completed"] * 3
    sweep = jobs[0].parent
    result = subprocess.run([sys.executable, "-m", "trident.report", str(sweep)], capture_output=True, text=True, env=_env(), check=False)
    assert result.returncode == 0, result.stderr
    assert "| 3 |" in (sweep / "report.md").read_text(), "one setting, n = 3 seeds"


def _interrupted(root: Path, interrupt: str, *extra: str) -> tuple[int, str, Path]:
    """The LM job of seed 1, slowed down, interrupted once a checkpoint exists; returns the sweep's
    exit status and stderr, and the job's run directory."""
    process = _train(root, *SLURM, *LM, *SLOW, "seed=1", *extra)
    job = _slurm_job(root)
    _wait_for("multirun/*/*/*/checkpoints/last.ckpt", root)
    subprocess.run([*interrupt.split(), job], check=True)
    _start_requeued(job, process)
    rc, err = _finish(process)
    return rc, err, _sweep_jobs(root)[0]


def _ends_like_uninterrupted(run_dir: Path, runs: Runs) -> None:
    reference = _sweep_jobs(runs["lm"])[0]
    validations = _validations(run_dir)
    assert validations == _validations(reference), "one continuous metrics log, ending like the uninterrupted job"
    assert [step for step, _ in validations] == sorted({step for step, _ in validations})
    expected = _losses(_wandb(reference))
    resumed = _losses(_wandb(run_dir))
    assert list(resumed) == list(expected), "W&B holds every step once, in order"
    assert list(resumed.values()) == pytest.approx(list(expected.values()), rel=1e-5)


def test_preempted_job_is_requeued_and_resumes_exactly(runs: Runs, tmp_path: Path) -> None:
    rc, err, run_dir = _interrupted(tmp_path, "scontrol requeue")
    assert rc == 0, err[-3000:]
    _no_traceback(tmp_path)
    status = _status(run_dir)
    assert status["status"] == "completed"
    (requeue,) = status["requeues"]
    assert requeue["signal"] == "SIGTERM" and 0 < requeue["step"] < 24
    assert "requeued SLURM job" in (run_dir / "train.log").read_text()
    _ends_like_uninterrupted(run_dir, runs)


def test_time_limit_checkpoints_at_the_signal_and_the_job_finishes(runs: Runs, tmp_path: Path) -> None:
    # SLURM warns a job before its time limit with the signal that submitit asks for (sbatch
    # --signal=USR2@<signal_delay_s>); sent here mid-run, as submitit's own tests do, since a real
    # limit of minutes would land anywhere on this shared machine.
    limit = ["hydra.launcher.timeout_min=10", "hydra.launcher.max_num_timeout=1"]
    rc, err, run_dir = _interrupted(tmp_path, "scancel --signal=USR2", *limit)
    assert rc == 0, err[-3000:]
    _no_traceback(tmp_path)
    status = _status(run_dir)
    assert status["status"] == "completed", status
    (requeue,) = status["requeues"]
    assert requeue["signal"] == "SIGUSR2" and 0 < requeue["step"] < 24
    _ends_like_uninterrupted(run_dir, runs)


def test_scancel_leaves_a_complete_checkpoint_and_resume_continues_exactly(runs: Runs, tmp_path: Path) -> None:
    rc, err, run_dir = _interrupted(tmp_path, "scancel")
    assert rc == 1 and "cancelled by SIGTERM" in err, err[-3000:]
    _no_traceback(tmp_path)
    status = _status(run_dir)
    assert status["status"] == "cancelled" and status["signal"] == "SIGTERM"
    assert Path(status["checkpoint"]) == run_dir / "checkpoints" / "last.ckpt"
    # The same 2 ranks, here as 2 processes of this machine, continue the run.
    rc, err = _finish(_train(tmp_path, f"resume={run_dir}", "trainer.devices=2", "trainer.num_nodes=1"))
    assert rc == 0, err[-3000:]
    assert _status(run_dir)["status"] == "completed"
    _ends_like_uninterrupted(run_dir, runs)


def test_two_nodes_by_hand_train_like_two_processes_on_one_node(runs: Runs, tmp_path: Path) -> None:
    args = [*ONE_NODE, *LM, "seed=1", "trainer.devices=1", "trainer.num_nodes=2", "hydra.run.dir=run"]
    nodes = []
    for rank in (0, 1):
        env = {**_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517", "NODE_RANK": str(rank)}
        command = [sys.executable, str(ROOT / "train.py"), *args, f"paths.output_root={tmp_path}"]
        nodes.append(subprocess.Popen(command, cwd=tmp_path, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    for node in nodes:
        rc, err = _finish(node)
        assert rc == 0 and "Traceback" not in err, err[-3000:]
    assert _losses(_wandb(tmp_path / "run")) == pytest.approx(_losses(_wandb(runs["lm-one-node"])), rel=1e-5)
