"""``torchrun --nproc_per_node=N train.py trainer=ddp_cpu``: torchrun starts every rank itself, with
RANK, WORLD_SIZE and LOCAL_RANK set (Lightning's TorchElasticEnvironment: nothing is spawned again).

Each rank would otherwise run Hydra on its own and name its own run directory (``${now:...}`` read a
moment apart), writing a second ``.hydra/`` there. Instead global rank 0 publishes its job (overrides
and run directory, as for the workers Lightning starts: :func:`trident.launch.distributed.workers_follow`)
in torchrun's key-value store, and every other rank waits for it before Hydra starts and runs that
job (:func:`trident.launch.workers.worker_arguments`): one run directory, written by rank 0 alone.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from trident.errors import ConfigError, TridentError

# Seconds a rank waits for rank 0's job: rank 0 checks the command line and imports torch first.
JOB_WAIT_S = 300.0
# The store of a process whose rank hosts it (torchrun without its agent's store): kept for the
# process's lifetime, so that the other ranks can still read it and init_process_group reuses it.
_hosted: list[Any] = []


def torchrun_rank() -> int | None:
    """The global rank torchrun gave this process, or None when torchrun did not start it."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    return int(os.environ["RANK"])


def check_one_job(argv: list[str], multirun_flags: tuple[str, ...]) -> None:
    """torchrun's ranks run one job: a sweep (``-m``) would start a job per rank and value."""
    if torchrun_rank() is not None and any(arg in multirun_flags for arg in argv):
        raise ConfigError("torchrun runs one job: drop -m/--multirun, or sweep DDP jobs with "
                          "`python train.py -m trainer=ddp ...` (docs/scaling.md)")


def _key() -> str:
    # A restarted worker group (torchrun --max-restarts) publishes its job anew.
    return f"trident/job/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _store(rank: int) -> Any:
    """torchrun's store at MASTER_ADDR:MASTER_PORT: its agent's (TORCHELASTIC_USE_AGENT_STORE),
    else the one rank 0 hosts there, as ``torch.distributed.init_process_group`` would open it."""
    from torch.distributed import TCPStore  # here: a DDP worker reads its job before anything else loads

    hosts = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                     is_master=hosts, timeout=timedelta(seconds=JOB_WAIT_S), wait_for_workers=False, multi_tenant=True)
    if hosts:
        _hosted.append(store)
    return store


def publish_job(job: str) -> None:
    """Global rank 0: hand the job (JSON: overrides and run directory) to the other ranks."""
    _store(0).set(_key(), job)


def job_of_rank_zero(rank: int) -> str:
    """The job that global rank 0 published, waiting for it at most :data:`JOB_WAIT_S`."""
    try:
        return _store(rank).get(_key()).decode()
    except RuntimeError as err:  # torch's DistStoreError: a timeout, or the store went away
        raise TridentError(f"torchrun rank {rank} got no job from rank 0 within {JOB_WAIT_S:.0f} s "
                           f"({str(err).splitlines()[0]}): rank 0's output says why it did not start") from err
