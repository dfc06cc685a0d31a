"""Real multi-process DDP on CPU (gloo): ``python train.py -m trainer=ddp_cpu ...`` end to end
(single runs of every task, resume, signals and eval.py: test_ddp_matrix.py, test_ddp_signals.py).

One sweep, two jobs: the same global batch of 8 blocks as 2 processes x 4 and as 1 process x 8.
Both jobs run under the DDP strategy, so both read their data through Lightning's
DistributedSampler: the two ranks' shares of a step are, together, exactly the one process's
batch. The sweep also exercises the Hydra + DDP pitfall in its hardest form: Lightning re-runs
the command for rank 1, and that command is a whole multirun.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import wandb
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DistributedSampler

from trident.commands.sample import load_lm_checkpoint
from trident.data.lm import PackedBlocks
from trident.data.order import EpochShuffleSampler
from trident.data.translation import TranslationDataModule
from trident.errors import DataError
from trident.launch.distributed import RankFailed, WorkerProcesses, ranks_fail_together, workers_follow
from trident.runs.command_line import prepare_command_line
from trident.runs.pipeline import build_data_and_task, build_trainer, check_config, constructor_args, instantiate
from trident.tracking.loggers import build_loggers, record_summary, summarize_monitor
from trident.tracking.wandb_files import OfflineRun, find_offline_runs

from .conftest import ROOT, SMALL, compose_config
from .test_translation_data import many_pairs, write_tsv

STEPS = 6
VAL_BATCHES = 2  # per rank and validation
BLOCK_SIZE = 32
# The two jobs of the sweep, as a config group that only this test's search path holds.
CASES = {
    "two_processes": {"devices": 2, "batch_size": 4},
    "one_process": {"devices": 1, "batch_size": 8},
}
# Same data, same initial weights, same global batches: the runs differ only in the order of
# floating-point sums (two per-rank means averaged by the gradient all-reduce, against one mean
# of 8), measured at ~1e-7 relative over these steps. 1e-5 leaves room for other CPUs and
# libraries, and is far below the ~7e-3 gap at the very first step when the global batches
# differ (e.g. a rank training on the other rank's blocks, or on a batch of 4 instead of 8).
LOSS_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory, _shared_data_cache: None) -> Path:
    root = tmp_path_factory.mktemp("ddp")
    cases = root / "conf" / "ddp_case"
    cases.mkdir(parents=True)
    for name, case in CASES.items():
        cases.joinpath(f"{name}.yaml").write_text(
            f"# @package _global_\ntrainer:\n  devices: {case['devices']}\ndata:\n  batch_size: {case['batch_size']}\n"
        )
    overrides = [o for o in SMALL if not o.startswith(("data.batch_size", "trainer.max_steps", "trainer.limit_val_batches"))]
    command = [
        sys.executable, str(ROOT / "train.py"), "-m", "trainer=ddp_cpu", *overrides,
        f"data.block_size={BLOCK_SIZE}", f"trainer.max_steps={STEPS}", f"trainer.val_check_interval={STEPS // 2}",
        f"trainer.limit_val_batches={VAL_BATCHES}", f"hydra.searchpath=[file://{root / 'conf'}]",
        "+ddp_case=" + ",".join(CASES), f"paths.output_root={root / 'outputs'}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, check=False, capture_output=True, text=True, cwd=root, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stdout + result.stderr, "no rank of any job printed one"
    return root / "outputs"


def _job_dirs(outputs: Path) -> dict[str, Path]:
    sweeps = list((outputs / "multirun").glob("*/*"))
    assert len(sweeps) == 1, f"one sweep directory, not one per rank: {sweeps}"
    jobs = sorted(p for p in sweeps[0].iterdir() if p.is_dir())
    assert [p.name.split("_")[0] for p in jobs] == ["0", "1"], jobs
    return dict(zip(CASES, jobs))


def _wandb_run(job_dir: Path) -> OfflineRun:
    runs = find_offline_runs(job_dir)
    assert len(runs) == 1, "exactly one W&B run per job, from rank 0"
    return runs[0]


@pytest.mark.slow
def test_only_rank_zero_writes_one_run_directory_per_job(sweep: Path) -> None:
    assert [p.name for p in sweep.iterdir() if p.name != "cache"] == ["multirun"], "no stray run directory of rank 1"
    for job_dir in _job_dirs(sweep).values():
        assert (job_dir / "config_resolved.yaml").is_file() and (job_dir / ".hydra" / "config.yaml").is_file()
        assert sorted(p.name for p in (job_dir / "checkpoints").iterdir()) == [f"best-step{STEPS}.ckpt", "last.ckpt"]
        assert {"test/loss", "test/ppl"} <= set(_wandb_run(job_dir).summary)
        # Every rank runs the pipeline, which logs the run directory at its end: rank 0 only in train.log.
        log = (job_dir / "train.log").read_text()
        assert log.count(f"Run directory: {job_dir}") == 1, log


@pytest.mark.slow
def test_two_processes_train_like_one_on_the_same_global_batch(sweep: Path) -> None:
    jobs = _job_dirs(sweep)
    two, one = (_wandb_run(jobs[name]) for name in CASES)
    assert two.config["trainer"]["devices"] == 2 and one.config["trainer"]["devices"] == 1
    losses_two, losses_one = two.metric("train/loss"), one.metric("train/loss")
    assert len(losses_two) == len(losses_one) == STEPS
    assert losses_two == pytest.approx(losses_one, rel=LOSS_TOLERANCE)
    assert losses_two[-1] < losses_two[0], "the runs learn, so the comparison covers real updates"
    assert two.metric("val/loss") == pytest.approx(one.metric("val/loss"), rel=LOSS_TOLERANCE)


@pytest.mark.slow
def test_logged_val_loss_is_the_mean_over_both_ranks_shares(sweep: Path) -> None:
    job_dir = _job_dirs(sweep)["two_processes"]
    task = load_lm_checkpoint(job_dir / "checkpoints" / "last.ckpt").eval()
    run_config = OmegaConf.load(job_dir / "config_resolved.yaml")
    assert isinstance(run_config, DictConfig)
    data = instantiate(constructor_args(run_config, "data"))
    data.setup()
    # The DistributedSampler deals validation blocks out in turn: with 2 ranks x VAL_BATCHES
    # batches of 4, the ranks together see the first 16 blocks, rank 0 the even ones.
    validation = PackedBlocks(data.splits["validation"], BLOCK_SIZE)
    blocks = [validation[i] for i in range(2 * VAL_BATCHES * 4)]
    with torch.no_grad():
        losses = torch.stack([F.cross_entropy(task(x[None])[0], y) for x, y in blocks])
    logged = _wandb_run(job_dir).metric("val/loss")[-1]
    assert logged == pytest.approx(losses.mean().item(), rel=1e-5)
    rank_zero_share = losses[0::2].mean().item()
    assert rank_zero_share != pytest.approx(losses.mean().item(), rel=1e-5), "rank 0's share alone would be told apart"
    assert _wandb_run(job_dir).metric("val/ppl")[-1] == pytest.approx(losses.mean().exp().item(), rel=1e-4)


def test_worker_runs_its_jobs_overrides_in_its_run_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    argv = ["-m", "-cn", "train", "seed=1,2", "trainer=ddp_cpu"]
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert prepare_command_line(argv) == argv, "a worker of a job not started by trident keeps its command"
    run_dir = tmp_path / "sweep, 1" / "1_it's"
    hydra_overrides = ["hydra.mode=MULTIRUN", f"hydra.sweep.dir={tmp_path}", "hydra.searchpath=[file:///x]"]
    with workers_follow(hydra_overrides, ["seed=2", "trainer=ddp_cpu"], run_dir):
        assert prepare_command_line(argv) == [
            "-cn", "train", "hydra.searchpath=[file:///x]", "seed=2", "trainer=ddp_cpu",
            f"hydra.run.dir='{run_dir}'".replace("it's", "it\\'s"), "hydra.output_subdir=null",
        ]
        monkeypatch.setenv("LOCAL_RANK", "0")
        assert prepare_command_line(argv) == argv, "rank 0 runs the command as given"
        monkeypatch.setenv("MASTER_PORT", "29500")  # as Lightning's launcher sets it
    assert "MASTER_PORT" not in os.environ and "TRIDENT_DDP_JOB" not in os.environ, "the next job starts afresh"


def rank_shares(cfg: DictConfig, monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, list[list[list[int]]]], int]:
    """The example indices each rank of two reads, per split, through the pipeline's own data module and
    trainer and Lightning's own loader preparation: a rank is only told its number the way Lightning's
    launcher tells a worker (LOCAL_RANK), so a module that ignored the trainer's rank would be seen.
    Also returns the size of the validation split."""
    datamodule, _ = build_data_and_task(cfg, check_config(cfg), "fit")
    # A DDP trainer built for rank 1 sets Lightning's process-wide rank: restored after the test, so
    # later in-process runs are rank 0 again (and write their run directories).
    monkeypatch.setattr(rank_zero_only, "rank", rank_zero_only.rank)
    shares: dict[str, list[list[list[int]]]] = {"train": [], "validation": []}
    for rank in range(2):
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        trainer = build_trainer(cfg.trainer, logger=False)
        assert (trainer.world_size, trainer.global_rank) == (2, rank)
        datamodule.trainer = trainer  # what Trainer.fit does to its datamodule
        connector = trainer._data_connector
        for split, loader, mode in (("train", datamodule.train_dataloader(), RunningStage.TRAINING),
                                    ("validation", datamodule.val_dataloader(), RunningStage.VALIDATING)):
            prepared = connector._prepare_dataloader(loader, shuffle=split == "train", mode=mode)
            shares[split].append([list(batch) for batch in prepared.batch_sampler])
    return shares, len(datamodule.val_dataloader().dataset)


@pytest.mark.parametrize("task", ["lm", "translation"])
def test_each_rank_reads_its_own_share_as_lightning_builds_the_loaders(task: str, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    overrides = [*SMALL, "trainer=ddp_cpu"] if task == "lm" else [
        "task=translation", "trainer=ddp_cpu", "model=nano", "data.source=files", "data.vocab_size=300",
        "data.max_len=32", "data.max_tokens=200", "data.split=[0.6,0.3,0.1]", "print_config=false",
        f"data.files={write_tsv(tmp_path / 'pairs.tsv', many_pairs(300))}"]
    shares, validation_size = rank_shares(compose_config(overrides, output_dir=tmp_path / "run"), monkeypatch)
    for split, (first, second) in shares.items():
        assert len(first) == len(second) > 1, f"{split}: both ranks run the same number of steps"
        seen = [index for batch in first + second for index in batch]
        flat_first = {index for batch in first for index in batch}
        flat_second = {index for batch in second for index in batch}
        # DistributedSampler may repeat an example to even out the ranks, never share a whole shard.
        assert len(flat_first & flat_second) <= 1, f"{split}: the ranks read different examples"
        assert len(set(seen)) >= len(seen) - 1, f"{split}: every example on one rank only"
    validation = {index for share in shares["validation"] for batch in share for index in batch}
    assert validation == set(range(validation_size)), "together the ranks validate on the whole split"


@pytest.mark.parametrize("split", ["train", "validation"])
def test_translation_ranks_get_disjoint_token_budget_batches_of_the_whole_split(split: str, tmp_path: Path) -> None:
    """Translation turns Lightning's sampler off (use_distributed_sampler: false) and deals its
    token-budget batches out by the trainer's rank itself."""
    files = str(write_tsv(tmp_path / "pairs.tsv", many_pairs(400)))
    module = TranslationDataModule(source="files", files=files, vocab_size=300, max_len=32, max_tokens=200,
                                   split=(0.6, 0.3, 0.1), cache_dir=str(tmp_path / "cache"))
    module.prepare_data()
    module.setup()
    shares = []
    for rank in range(2):
        # All that the data module reads of its trainer.
        module.trainer = SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 2, "rank": rank})  # type: ignore[assignment]
        batches = module.split_loader(split, train=split == "train").batch_sampler
        assert batches is not None
        shares.append([sorted(batch) for batch in batches])
    assert len(shares[0]) == len(shares[1]) > 1, "both ranks run the same number of steps"
    seen = [index for share in shares for batch in share for index in batch]
    assert sorted(seen) == list(range(module.pair_counts()[split])), "every pair once, on one rank"


def test_wandb_run_is_touched_on_rank_zero_only(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    """On other ranks ``WandbLogger.experiment`` is Lightning's no-op stand-in: writing the summary
    or defining metrics there must do nothing (it used to raise on ``summary.update``), and no
    login check warns there (rank 0's warning would be repeated)."""
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    with caplog.at_level(logging.WARNING, logger="trident.tracking.loggers"):
        _journal, logger = build_loggers(compose_config(["logger=wandb"], tmp_path / "run"), tmp_path / "run", "abc123", None)
    assert caplog.records == [], "rank 0 alone says that W&B logs offline"
    assert isinstance(logger, WandbLogger)
    record_summary([logger], {"test/loss": 1.0})
    summarize_monitor(logger, "val/loss", "min")
    assert wandb.run is None and not (tmp_path / "run" / "wandb").exists(), "no W&B run on rank 1"


def _launcher_of(workers: list[Any]) -> SimpleNamespace:
    """What ranks_fail_together reads of a rank-0 trainer whose launcher started these workers."""
    return SimpleNamespace(global_rank=0, strategy=SimpleNamespace(launcher=SimpleNamespace(procs=workers)))


def _launched(*exit_statuses: int) -> SimpleNamespace:
    """A trainer whose launcher started workers ending with these statuses."""
    return _launcher_of([subprocess.Popen([sys.executable, "-c", f"import sys; sys.exit({s})"]) for s in exit_statuses])


def test_a_worker_failing_after_rank_zero_finished_fails_the_job() -> None:
    trainer = _launched(0, 2)
    with (
        pytest.raises(RankFailed, match=r"DDP rank 2 failed \(ended with exit status 2\)") as failure,
        ranks_fail_together(trainer, WorkerProcesses()),  # type: ignore[arg-type]
    ):
        pass
    assert failure.value.exit_status == 2, "the failing rank's status: 2 for its user error"
    assert trainer.strategy.launcher.procs == [], "taken from Lightning's observer, which would SIGKILL this process"
    with ranks_fail_together(_launched(0, 0), WorkerProcesses()):  # type: ignore[arg-type]
        pass


def test_workers_are_taken_from_lightnings_observer_as_soon_as_they_run() -> None:
    """Lightning's observer SIGKILLs rank 0 a few seconds after a worker fails mid-run: the workers
    are taken from it at ``setup``, right after the launch, and still judged at the end."""
    trainer = _launched(3)
    workers = WorkerProcesses()
    workers.setup(trainer, None, "fit")  # type: ignore[arg-type]
    assert trainer.strategy.launcher.procs == [], "the observer watches an empty list from here on"
    with pytest.raises(RankFailed, match=r"DDP rank 1 failed \(ended with exit status 3\)"), ranks_fail_together(trainer, workers):  # type: ignore[arg-type]
        pass


def test_a_collective_that_lost_its_peer_names_the_failed_rank_instead_of_a_traceback() -> None:
    lost = RuntimeError("[gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:34474")
    with (
        pytest.raises(RankFailed, match=r"DDP rank 1 failed \(ended with exit status 1\)") as failure,
        ranks_fail_together(_launched(1), WorkerProcesses()),  # type: ignore[arg-type]
    ):
        raise lost
    assert failure.value.__cause__ is lost
    with (
        pytest.raises(RankFailed, match="another DDP rank failed, which stopped this one"),
        ranks_fail_together(_launched(), WorkerProcesses()),  # type: ignore[arg-type]  # a worker: its peer was rank 0
    ):
        raise lost


def test_rank_zero_failing_by_itself_ends_its_waiting_workers() -> None:
    waiting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    trainer = _launcher_of([waiting])
    with pytest.raises(DataError, match="own failure"), ranks_fail_together(trainer, WorkerProcesses()):  # type: ignore[arg-type]
        raise DataError("own failure")
    assert waiting.poll() == -signal.SIGKILL


class FakeWorker:
    """A worker process as ranks_fail_together sees it: ended with ``status``, or running (None) until killed."""

    def __init__(self, status: int | None) -> None:
        self.returncode = status
        self.killed = False

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if timeout is not None:
                raise subprocess.TimeoutExpired("worker", timeout)
            raise AssertionError("waited forever on a worker that was not killed")
        return self.returncode

    def kill(self) -> None:
        self.killed = True
        self.returncode = -signal.SIGKILL


def test_workers_that_do_not_end_in_time_are_killed_and_named() -> None:
    ended, hung, also_hung = FakeWorker(0), FakeWorker(None), FakeWorker(None)
    trainer = _launcher_of([ended, hung, also_hung])
    failed = pytest.raises(RankFailed, match=r"DDP rank 2 failed \(did not end in time, killed\)")
    with failed as failure, ranks_fail_together(trainer, WorkerProcesses()):  # type: ignore[arg-type]
        pass
    assert failure.value.exit_status == 1
    assert hung.killed and also_hung.killed and not ended.killed, "no worker outlives the job"


def test_a_worker_ended_by_sighup_is_not_taken_for_one_that_did_not_end() -> None:
    trainer = _launcher_of([FakeWorker(-signal.SIGHUP)])
    failed = pytest.raises(RankFailed, match=r"DDP rank 1 failed \(ended with exit status -1\)")
    with failed as failure, ranks_fail_together(trainer, WorkerProcesses()):  # type: ignore[arg-type]
        pass
    assert failure.value.exit_status == 1


def test_epoch_order_is_dealt_out_by_rank_and_resumes_per_rank() -> None:
    """LM and image data shuffle with EpochShuffleSampler: under DDP each rank takes every other
    index of the epoch's permutation (Lightning keeps it unwrapped), and a resumed rank skips its
    own batches. Rank r's batch k of 4 and the other rank's are one process's batch k of 8."""
    ranks = [EpochShuffleSampler(size=21, batch_size=4, seed=3, num_replicas=2, rank=r) for r in range(2)]
    one = EpochShuffleSampler(size=21, batch_size=8, seed=3)
    for sampler in (*ranks, one):
        sampler.set_epoch(2)
    shares = [list(sampler) for sampler in ranks]
    whole = list(one)
    assert len(shares[0]) == len(shares[1]) == len(ranks[0]) == 10, "the uneven tail is dropped"
    for k in range(2):
        assert sorted(shares[0][4 * k : 4 * k + 4] + shares[1][4 * k : 4 * k + 4]) == sorted(whole[8 * k : 8 * k + 8])
    assert isinstance(ranks[0], DistributedSampler), "so Lightning does not wrap it in a second, reshuffling sharding"
    ranks[1].skip_next(2)
    assert list(ranks[1]) == shares[1][8:]
