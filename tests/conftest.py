"""Shared fixtures: compose the real Hydra config the way train.py does, on small settings."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig

from trident.runs.compose import compose_train_config
from trident.runs.pipeline import build_data_and_task, build_trainer, check_config, train

# The CI skip rule (tests/ci_skips.py): pytest registers the hooks that a conftest holds.
from .ci_skips import ALLOWED_CI_SKIPS, GPU_SKIP_REASON, pytest_sessionfinish, pytest_terminal_summary  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = ROOT / "conf"
# The docs page whose tables state each sweep preset's command, jobs and measured wall time.
SWEEPS_PAGE = ROOT / "docs" / "sweeps.md"

# Small and fast: the nano model on short blocks, a few batches of everything.
SMALL = [
    "model=nano",
    "data.block_size=32",
    "data.batch_size=4",
    "trainer.max_steps=4",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=1",
    "trainer.limit_test_batches=1",
    "trainer.log_every_n_steps=1",
    "trainer.num_sanity_val_steps=0",
    "task.sampling.max_new_tokens=8",
    "print_config=false",
    "callbacks.progress_bar=null",
    "callbacks.model_summary=null",
]


# pytest-xdist workers (pyproject's addopts): each one's torch uses its share of the cores (tiny models
# gain nothing from more threads); the train.py processes it starts inherit the same through OMP_NUM_THREADS.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    _THREADS = max(1, len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    torch.set_num_threads(_THREADS)
    os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files with the most slow tests first, each file's tests in their order: xdist's workers take whole
    files in this order (pyproject's addopts), so the long files start at once and short ones fill the end."""
    slow_tests = Counter(item.path for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow_tests[item.path])  # stable: the collection order otherwise


# No network and no user W&B settings. Set at import time: huggingface_hub and datasets read
# these variables when they are first imported, before any fixture could run.
os.environ.update({"WANDB_MODE": "offline", "WANDB_SILENT": "true", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})


@pytest.fixture(scope="session", autouse=True)
def _shared_data_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """One prepared-data cache for the whole session (the Shakespeare corpus is prepared once),
    always a fresh one: a user's TRIDENT_CACHE_DIR must neither feed the tests nor be written by them."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRIDENT_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield


# What a launcher leaves in the process: Lightning sets MASTER_PORT (a free port) for an in-process Trainer or a one-rank
# FSDP mesh and never takes it back. A test after it in the same worker would see it (a DDP worker's environment
# check, a job that inherits the port): each test starts and ends without them.
LAUNCHER_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", "RANK", "TRIDENT_DDP_JOB")


@pytest.fixture(autouse=True)
def _no_launcher_variables() -> Iterator[None]:
    for name in LAUNCHER_VARIABLES:
        os.environ.pop(name, None)
    yield
    for name in LAUNCHER_VARIABLES:
        os.environ.pop(name, None)


def compose_config(overrides: list[str], output_dir: Path | None = None) -> DictConfig:
    """Compose ``conf/train.yaml`` with ``overrides``, as ``python train.py <overrides>`` would."""
    return compose_train_config(overrides, output_dir, CONF_DIR)


@pytest.fixture
def make_config(tmp_path: Path) -> Callable[..., DictConfig]:
    """``make_config("pos_encoding=alibi", ...)``: the small config plus overrides, writing under tmp_path."""

    def make(*overrides: str) -> DictConfig:
        return compose_config([*SMALL, *overrides], output_dir=tmp_path / "run")

    return make


@pytest.fixture(scope="module")
def single_thread() -> Iterator[None]:
    """Tiny models: intra-op threads cost more than they save (and the 2-core CPU is shared)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)




# The LM's reference run: 4 steps, W&B (offline) and CSV logs, throughput every step against a fixed
# peak, checkpoints; read-only tests of the run's files, logs, MFU and commands share it.
LM_REFERENCE = ["pos_encoding=alibi", "seed=7", "callbacks.throughput.window=1", "callbacks.throughput.peak_flops=2e9",
                "+logger.csv._target_=lightning.pytorch.loggers.CSVLogger", "+logger.csv.name=csv"]


@pytest.fixture(scope="session")
def lm_reference_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, float]]:
    """(run directory, returned metrics) of ``train.py`` on SMALL + LM_REFERENCE. Tests only read it."""
    run_dir = tmp_path_factory.mktemp("lm_reference") / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the nano model: intra-op threads cost more than they save
    try:
        metrics = train(compose_config([*SMALL, *LM_REFERENCE], output_dir=run_dir))
    finally:
        torch.set_num_threads(threads)
    return run_dir, metrics


def one_step(cfg: DictConfig) -> dict[str, float]:
    """One training step and one validation batch of the task and data the pipeline builds from ``cfg``
    (its model, encoding, precision, augmentation), without a run's files, loggers and test stage: a
    variant is checked at a fraction of a run's cost; each task keeps its end-to-end runs elsewhere."""
    datamodule, task = build_data_and_task(cfg, check_config(cfg), "fit")
    trainer = build_trainer(cfg.trainer, max_steps=1, max_epochs=1, val_check_interval=1, limit_val_batches=1,
                            num_sanity_val_steps=0, logger=False, enable_checkpointing=False, callbacks=[],
                            enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(task, datamodule=datamodule)
    return {name: float(value) for name, value in trainer.callback_metrics.items()}
