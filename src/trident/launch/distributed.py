"""One Hydra job, one run directory, also when Lightning runs it as several DDP processes.

Lightning's ``ddp`` strategy starts its worker processes (local ranks 1..N-1) by running the
launching command again. For a Hydra app that command may be a whole sweep (``-m seed=1,2``):
every worker would then start its own sweep, in a new sweep directory. :func:`workers_follow`
tells the workers which job they belong to (its overrides and run directory), and
:func:`trident.launch.workers.worker_arguments` turns a worker's command line into that one
job. Only global rank 0 writes the run's files: :func:`is_global_zero` answers before the process group exists, and
:class:`OtherRanksFilter` keeps the other ranks out of ``train.log``.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import lightning as L
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig

from trident.errors import ConfigError, TridentError
from trident.launch.requeue import JobStopped
from trident.launch.torchrun import publish_job, torchrun_rank
from trident.launch.workers import JOB_VARIABLE

# What Lightning's launcher writes into the launching process's environment. Left in place, the
# next job of a sweep in the same process would take it for a worker started by someone else.
_LAUNCHER_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", JOB_VARIABLE)
# Hydra settings of the launching job that a worker must not repeat: it runs one job (no sweep,
# no launcher) in the job's run directory. The others (e.g. hydra.searchpath) it keeps.
_LAUNCH_ONLY_KEYS = ("hydra.mode", "hydra.run.", "hydra.sweep.", "hydra.launcher", "hydra.sweeper",
                     "hydra/launcher", "hydra/sweeper", "hydra.output_subdir", "hydra.job.num", "hydra.job.id")

# What gloo raises in a collective whose other end has gone: that rank's process ended.
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer")
# Seconds the launching process waits at most for its workers to end: after a peer's collective
# failed (the failed worker is exiting) and after the job itself ended (the workers finish alike).
# The wait ends when they do; on a loaded machine a failed rank's teardown alone took over 10 s.
WORKER_EXIT_WAIT_S = 60.0


class RankFailed(TridentError):
    """Another DDP rank of the job failed (its own output says why), which stops this one; the
    exit status is that rank's (2 for its user error, 1 for a crash)."""

    def __init__(self, message: str, exit_status: int = 1) -> None:
        super().__init__(message)
        self.exit_status = exit_status


def is_global_zero() -> bool:
    """Whether this process is global rank 0, from what its launcher put in the environment
    (Lightning's rule: RANK, LOCAL_RANK, SLURM_PROCID), so it holds before DDP is set up;
    ``NODE_RANK`` marks the first process of another node started by hand."""
    rank: int = rank_zero_only.rank  # type: ignore[attr-defined]  # set by Lightning on import and at DDP set-up
    return rank == 0 and os.environ.get("NODE_RANK", "0") == "0"


def check_workers_can_start(trainer: DictConfig) -> None:
    """Fail early where Lightning could not start DDP workers: it re-runs the launching command,
    and inside a ``hydra/launcher=submitit_local`` job that command is submitit's, not train.py.
    (Under SLURM, the job's tasks are the ranks and nothing is re-run.)"""
    if os.environ.get("SUBMITIT_EXECUTOR") != "local":
        return
    devices = trainer.get("devices", 1)
    one_device = devices in (1, "1") or (not isinstance(devices, (int, str)) and len(devices) == 1)
    if one_device and trainer.get("num_nodes", 1) == 1:
        return
    raise ConfigError(
        f"trainer.devices={devices} needs DDP worker processes, which a hydra/launcher=submitit_local job cannot "
        "start: run it without submitit_local (python train.py trainer=ddp ...), or on SLURM with hydra/launcher=slurm"
    )


def _worker_overrides(hydra_overrides: Sequence[str], task_overrides: Sequence[str]) -> list[str]:
    kept = [o for o in hydra_overrides if not o.lstrip("+~").startswith(_LAUNCH_ONLY_KEYS)]
    return [*kept, *task_overrides]


@contextmanager
def workers_follow(hydra_overrides: Sequence[str], task_overrides: Sequence[str], run_dir: Path) -> Iterator[None]:
    """Run a job whose DDP workers (started inside this block) join this job in ``run_dir``:
    they get its overrides (``hydra.overrides.task``, and of ``hydra.overrides.hydra`` those
    that shape the config, such as ``hydra.searchpath``). Under torchrun, which started the other
    ranks itself, they get the same job from global rank 0 (:mod:`trident.launch.torchrun`).

    On exit the launcher's environment variables and the process group go, so that the next
    job of a sweep in this process starts workers of its own.
    """
    saved = {name: os.environ.get(name) for name in _LAUNCHER_VARIABLES}
    overrides = _worker_overrides(hydra_overrides, task_overrides)
    os.environ[JOB_VARIABLE] = json.dumps({"overrides": overrides, "run_dir": str(run_dir.resolve())})
    if torchrun_rank() == 0:  # torchrun started the other ranks: they wait for this job
        publish_job(os.environ[JOB_VARIABLE])
    try:
        yield
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class OtherRanksFilter(logging.Filter):
    """Passes every record of global rank 0; of other ranks, only records at ``min_level`` or
    above (none when ``min_level`` is None). Used in conf/hydra/default.yaml so that the ranks of
    one job do not all write the same ``train.log`` and console lines."""

    def __init__(self, min_level: str | None = None) -> None:
        super().__init__()
        self.min_level = logging.getLevelName(min_level) if min_level else None

    def filter(self, record: logging.LogRecord) -> bool:
        if is_global_zero():
            return True
        return self.min_level is not None and record.levelno >= self.min_level


def lost_peer(err: BaseException) -> bool:
    """Whether ``err`` (or an exception behind it) is a collective that failed because another
    rank's process ended, rather than a failure of this rank."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        if any(text in str(current) for text in _PEER_GONE):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def _take_workers(trainer: L.Trainer) -> list[subprocess.Popen]:
    """The processes of local ranks 1..N-1 that Lightning's launcher started from this one (none
    in a worker, or where the cluster starts every rank itself, e.g. SLURM), taken over from
    Lightning's child-process observer: it polls the launcher's own list every few seconds and
    SIGKILLs this process when a worker failed, which would cut the report of that failure short."""
    procs = getattr(trainer.strategy.launcher, "procs", None)
    if not procs:
        return []
    workers = list(procs)
    procs.clear()
    return workers


def _failed_worker(
    trainer: L.Trainer, workers: list[subprocess.Popen], timeout_s: float
) -> tuple[int, int | None] | None:
    """(global rank, exit status) of the first worker that failed, waiting up to ``timeout_s`` in
    all for the workers to end. A worker still running then counts as failed with status None, and
    every worker still running is killed: it would otherwise outlive the job (e.g. in a collective)."""
    deadline = time.monotonic() + timeout_s
    # The launching process is its node's local rank 0; its workers follow it in global rank.
    for rank, worker in enumerate(workers, start=trainer.global_rank + 1):
        try:
            status = worker.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _end(workers)
            return rank, None
        if status != 0:
            return rank, status
    return None


def _end(workers: list[subprocess.Popen]) -> None:
    """Kill the workers still running and reap them all."""
    for worker in workers:
        if worker.poll() is None:
            worker.kill()
    for worker in workers:
        worker.wait()


def _rank_failed(rank: int, status: int | None) -> RankFailed:
    how = "did not end in time, killed" if status is None else f"ended with exit status {status}"
    # A signal's negative status, or none, is a crash (1) to the shell.
    return RankFailed(f"DDP rank {rank} failed ({how}), which stopped the run: that rank's output above says why",
                      exit_status=status if status is not None and status > 0 else 1)


class WorkerProcesses(L.Callback):
    """The launching process's DDP workers, taken from Lightning's child-process observer as soon
    as they run (``setup`` comes right after the launch): the observer SIGKILLs this process a few
    seconds after a worker fails, before this one could name the failed rank
    (:func:`ranks_fail_together`)."""

    def __init__(self) -> None:
        self._taken: list[subprocess.Popen] = []

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._taken += _take_workers(trainer)

    def take(self, trainer: L.Trainer) -> list[subprocess.Popen]:
        """Every worker, taken early or now (a failure before ``setup``)."""
        workers, self._taken = [*self._taken, *_take_workers(trainer)], []
        return workers


@contextmanager
def ranks_fail_together(trainer: L.Trainer, workers: WorkerProcesses) -> Iterator[None]:
    """A job whose DDP ranks succeed or fail as one, with the failing rank named.

    Lightning's launcher does not look at how its worker processes end: a worker failing after
    rank 0 finished left exit status 0, and a rank failing mid-run made the others' next collective
    fail with a traceback of their own. Here the launching process waits for its workers at the
    end and fails with the first failed one; a rank whose collective lost its peer raises
    :class:`RankFailed` (one line) instead of that traceback; and when the launching process
    fails by itself, it ends its workers, which would otherwise wait in a collective.
    """
    try:
        yield
    except JobStopped:
        _failed_worker(trainer, workers.take(trainer), WORKER_EXIT_WAIT_S)  # the workers stop at the same step
        raise
    except Exception as err:
        running = workers.take(trainer)
        if not lost_peer(err):
            _end(running)
            raise
        failed = _failed_worker(trainer, running, WORKER_EXIT_WAIT_S)
        if failed is not None:
            raise _rank_failed(*failed) from err
        raise RankFailed("another DDP rank failed, which stopped this one: that rank's error says why") from err
    failed = _failed_worker(trainer, workers.take(trainer), WORKER_EXIT_WAIT_S)
    if failed is not None:
        raise _rank_failed(*failed)
