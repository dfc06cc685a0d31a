"""Sharded checkpoints (``trainer=fsdp`` with ``trainer.strategy.save_distributed_checkpoint=true``) in one
process: ``ShardedStrategy`` writes each under a hidden name and puts it in place once complete; the requeue
and every reader find them like checkpoint files and read them back whole (without FSDP); an incomplete or
foreign one, or a resume without FSDP, is one error line. The 2-process runs: tests/test_fsdp.py."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import time
from pathlib import Path
from typing import Any

import hydra.utils
import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.fabric.utilities.load import _METADATA_FILENAME
from torch import nn

import trident
from trident.commands.average_checkpoints import average_checkpoints
from trident.errors import ConfigError, DataError
from trident.launch.requeue import latest_checkpoint
from trident.parallel.distributed_checkpoint import (
    REST,
    check_sharded_resume,
    is_sharded_checkpoint,
    save_sharded,
)
from trident.parallel.fsdp import ShardedStrategy
from trident.runs.pipeline import read_resume_checkpoint
from trident.weights.checkpoints import AtomicCheckpointIO, check_checkpoint_fits, checkpoint_of, read_checkpoint
from trident.weights.init_from import read_init_source

from .conftest import compose_config
from .entry_points import run_in_process
from .sharding_helpers import save_sharded_copy


def tiny(vocabulary: int) -> nn.Module:
    """A module whose state dict looks like a task's (``net.*``): a token table, a head and a buffer."""
    task = nn.Module()
    task.net = nn.Module()
    task.net.embed = nn.Embedding(vocabulary, 4)
    task.net.head = nn.Linear(4, vocabulary)
    task.net.register_buffer("steps", torch.tensor(3))
    return task


def checkpoint(step: int) -> dict[str, Any]:
    """What Lightning hands a strategy to save: the weights, optimizer state and the rest."""
    torch.manual_seed(step)
    return {"state_dict": tiny(10).state_dict(), "optimizer_states": [], "global_step": step,
            "hyper_parameters": {"lr": 0.1}, "callbacks": {"ModelCheckpoint": {"best_model_path": ""}}}


def save(saved: dict[str, Any], path: Path) -> None:
    ShardedStrategy(save_distributed_checkpoint=True).save_checkpoint(dict(saved), path)  # it takes the weights out


def test_the_preset_takes_the_setting_and_keeps_whole_files_by_default() -> None:
    assert not hydra.utils.instantiate(compose_config(["trainer=fsdp_cpu"]).trainer.strategy)._save_distributed_checkpoint
    sharded = compose_config(["trainer=fsdp_cpu", "trainer.strategy.save_distributed_checkpoint=true"]).trainer.strategy
    assert hydra.utils.instantiate(sharded)._save_distributed_checkpoint
    assert REST == _METADATA_FILENAME  # the rest goes where Lightning's loader reads it


def test_a_sharded_checkpoint_is_a_directory_read_back_whole(tmp_path: Path) -> None:
    saved = checkpoint(1)
    save(saved, tmp_path / "last.ckpt")
    assert is_sharded_checkpoint(tmp_path / "last.ckpt")
    assert sorted(os.listdir(tmp_path / "last.ckpt")) == [".metadata", "__0_0.distcp", "meta.pt"]
    assert os.listdir(tmp_path) == ["last.ckpt"], "nothing staged is left behind"
    for read in (read_checkpoint(tmp_path / "last.ckpt", "ckpt_path"), AtomicCheckpointIO().load_checkpoint(tmp_path / "last.ckpt")):
        torch.testing.assert_close(read["state_dict"], saved["state_dict"], rtol=0, atol=0)
        assert (read["global_step"], read["hyper_parameters"]) == (1, {"lr": 0.1}) and "optimizer_states" not in read
    shapes = read_checkpoint(tmp_path / "last.ckpt", "ckpt_path", weights=False)["state_dict"]
    assert {k: (v.shape, v.dtype, v.is_meta) for k, v in shapes.items()} == {
        k: (v.shape, v.dtype, True) for k, v in saved["state_dict"].items()}


def test_a_save_replaces_the_checkpoint_of_its_name_file_or_directory(tmp_path: Path) -> None:
    torch.save(checkpoint(1), tmp_path / "last.ckpt")  # a whole file, saved before the run switched to shards
    for step in (2, 3):
        save(checkpoint(step), tmp_path / "last.ckpt")
        read = read_checkpoint(tmp_path / "last.ckpt", "ckpt_path")
        assert read["global_step"] == step
        torch.testing.assert_close(read["state_dict"], checkpoint(step)["state_dict"], rtol=0, atol=0)
        assert os.listdir(tmp_path) == ["last.ckpt"]


def test_a_failed_save_leaves_the_previous_checkpoint_of_its_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save(checkpoint(1), tmp_path / "last.ckpt")

    def fails_midway(state: dict[str, Any], path: Path) -> None:  # Lightning's DCP save, cut off by a full disk
        (Path(path) / "__0_0.distcp").write_bytes(b"half a shard")
        raise OSError("No space left on device")

    monkeypatch.setattr("lightning.pytorch.strategies.model_parallel._distributed_checkpoint_save", fails_midway)
    with pytest.raises(OSError, match="No space"):
        save(checkpoint(2), tmp_path / "last.ckpt")
    assert os.listdir(tmp_path) == ["last.ckpt"]
    torch.testing.assert_close(read_checkpoint(tmp_path / "last.ckpt", "ckpt_path")["state_dict"], checkpoint(1)["state_dict"],
                               rtol=0, atol=0)


def whole(rank: int = 0) -> ShardedStrategy:
    """The strategy of a run that saves checkpoint files (the default), as global rank ``rank``, with the writer
    that train.py gives it."""
    strategy = ShardedStrategy()
    strategy.checkpoint_io = AtomicCheckpointIO()
    environment = LightningEnvironment()
    environment.set_global_rank(rank)
    strategy.cluster_environment = environment
    return strategy


def test_a_run_switched_back_to_files_replaces_its_sharded_checkpoint_once_the_file_is_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sharded run resumed with save_distributed_checkpoint=false: rank 0 alone replaces the directory (the ranks
    share it; Lightning deletes it on every rank), and only once its file is complete: a save that fails (or is
    stopped) midway leaves the sharded checkpoint, which the requeue resumes from."""
    folder = tmp_path / "run" / "checkpoints"
    save(checkpoint(1), folder / "last.ckpt")
    whole(rank=1).save_checkpoint(checkpoint(2), folder / "last.ckpt")  # rank 1 writes nothing
    assert is_sharded_checkpoint(folder / "last.ckpt")

    def full_disk(*args: Any, **kwargs: Any) -> None:
        raise OSError("No space left on device")

    with monkeypatch.context() as patched:
        patched.setattr(torch, "save", full_disk)
        with pytest.raises(OSError, match="No space"):
            whole().save_checkpoint(checkpoint(2), folder / "last.ckpt")
    assert os.listdir(folder) == ["last.ckpt"] and latest_checkpoint(tmp_path / "run") == folder / "last.ckpt"
    assert read_checkpoint(folder / "last.ckpt", "ckpt_path", weights=False)["global_step"] == 1
    whole().save_checkpoint(checkpoint(2), folder / "last.ckpt")
    assert os.listdir(folder) == ["last.ckpt"] and (folder / "last.ckpt").is_file()
    read = read_checkpoint(folder / "last.ckpt", "ckpt_path")
    assert read["global_step"] == 2
    torch.testing.assert_close(read["state_dict"], checkpoint(2)["state_dict"], rtol=0, atol=0)
    (folder / "notes.ckpt").mkdir()  # a directory of the user's, not a checkpoint: kept, in one line
    (folder / "notes.ckpt" / "todo.txt").write_text("keep")
    with pytest.raises(DataError, match="a directory that is not a sharded checkpoint has its name: move it away"):
        whole().save_checkpoint(checkpoint(3), folder / "notes.ckpt")
    assert (folder / "notes.ckpt" / "todo.txt").read_text() == "keep"


def test_a_file_stopped_on_its_way_over_a_sharded_checkpoint_gives_the_old_one_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sharded directory steps aside before the file is renamed in: a stop between the two (Ctrl-C) puts it back
    under its name, so the run keeps a checkpoint the requeue finds."""
    folder = tmp_path / "run" / "checkpoints"
    save(checkpoint(1), folder / "last.ckpt")
    renames = []
    real_replace = os.replace

    def interrupted_second_rename(source: Any, destination: Any) -> None:
        renames.append(source)
        if len(renames) == 2:  # the complete file, on its way in
            raise KeyboardInterrupt
        real_replace(source, destination)

    with monkeypatch.context() as patched:
        patched.setattr(os, "replace", interrupted_second_rename)
        with pytest.raises(KeyboardInterrupt):
            whole().save_checkpoint(checkpoint(2), folder / "last.ckpt")
    assert os.listdir(folder) == ["last.ckpt"] and is_sharded_checkpoint(folder / "last.ckpt")
    assert latest_checkpoint(tmp_path / "run") == folder / "last.ckpt"
    assert read_checkpoint(folder / "last.ckpt", "ckpt_path", weights=False)["global_step"] == 1


def test_the_requeue_resumes_the_newest_save_across_a_switch_of_checkpoint_kind(tmp_path: Path) -> None:
    """A run that saved checkpoint files, then sharded ones, then files again: ``last.ckpt`` is replaced in place by
    each kind (never a file and a directory of one name), and the requeue takes the newest save by its real time."""
    folder = tmp_path / "run" / "checkpoints"
    whole().save_checkpoint(checkpoint(4), folder / "best-step4.ckpt")
    whole().save_checkpoint(checkpoint(5), folder / "last.ckpt")
    for step, strategy in [(6, ShardedStrategy(save_distributed_checkpoint=True)), (7, whole())]:
        time.sleep(0.02)  # file times tick in steps of a few milliseconds
        strategy.save_checkpoint(checkpoint(step), folder / "last.ckpt")
        assert sorted(os.listdir(folder)) == ["best-step4.ckpt", "last.ckpt"]
        assert latest_checkpoint(tmp_path / "run") == folder / "last.ckpt"
        assert read_checkpoint(folder / "last.ckpt", "ckpt_path", weights=False)["global_step"] == step
    time.sleep(0.02)
    save(checkpoint(8), folder / "best-step8.ckpt")  # a newer sharded checkpoint of another name
    assert latest_checkpoint(tmp_path / "run") == folder / "best-step8.ckpt"


def test_a_save_cut_off_never_counts_as_a_checkpoint(tmp_path: Path) -> None:
    folder = tmp_path / "run" / "checkpoints"
    save(checkpoint(1), folder / "last.ckpt")

    def cut_off(staging: Path) -> None:
        (staging / "__0_0.distcp").write_bytes(b"half a shard")
        raise OSError("No space left on device")

    with pytest.raises(OSError, match="No space"):
        save_sharded(ShardedStrategy(save_distributed_checkpoint=True), cut_off, folder / "last.ckpt")
    assert os.listdir(folder) == ["last.ckpt"] and read_checkpoint(folder / "last.ckpt", "ckpt_path")["global_step"] == 1
    # A save killed mid-write leaves its hidden staging directory (here a newer, whole one), and a copy cut short a
    # directory under a checkpoint's name without Lightning's meta.pt (written last): neither is taken.
    shutil.copytree(folder / "last.ckpt", folder / ".last.ckpt.x1y2.tmp")
    shutil.copytree(folder / "last.ckpt", folder / "best-step9.ckpt")
    (folder / "best-step9.ckpt" / REST).unlink()
    os.utime(folder / "last.ckpt", ns=(1, 1))  # the older one
    assert latest_checkpoint(tmp_path / "run") == folder / "last.ckpt"
    assert checkpoint_of(tmp_path / "run") == folder / "last.ckpt"


def test_the_requeue_and_the_readers_find_sharded_checkpoints_like_files(tmp_path: Path) -> None:
    folder = tmp_path / "run" / "checkpoints"
    (folder / "periodic").mkdir(parents=True)
    torch.save(checkpoint(2), folder / "periodic" / "step2.ckpt")
    save(checkpoint(4), folder / "best-step4.ckpt")
    save(checkpoint(6), folder / "last.ckpt")
    for age, name in enumerate(["periodic/step2.ckpt", "best-step4.ckpt", "last.ckpt"]):
        os.utime(folder / name, ns=(age, age))
    assert latest_checkpoint(tmp_path / "run") == folder / "last.ckpt"
    assert checkpoint_of(tmp_path / "run") == folder / "best-step4.ckpt"  # the best, as for checkpoint files
    assert checkpoint_of(folder / "last.ckpt") == folder / "last.ckpt"
    os.utime(folder / "best-step4.ckpt", ns=(9, 9))
    assert latest_checkpoint(tmp_path / "run") == folder / "best-step4.ckpt"


@pytest.fixture
def sharded(tmp_path: Path) -> Path:
    save(checkpoint(1), tmp_path / "good" / "last.ckpt")
    return tmp_path / "good" / "last.ckpt"


def damaged_copy(sharded: Path, damage: str) -> Path:
    copy = sharded.parent.parent / damage / "last.ckpt"
    shutil.copytree(sharded, copy)
    return copy


class RunsCode:
    def __reduce__(self) -> tuple[Any, ...]:
        return print, ("the index ran code",)


def test_an_incomplete_or_foreign_sharded_checkpoint_is_one_line(sharded: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cut = damaged_copy(sharded, "cut")
    (cut / "__0_0.distcp").write_bytes((cut / "__0_0.distcp").read_bytes()[:100])
    no_index = damaged_copy(sharded, "no_index")
    (no_index / ".metadata").unlink()
    foreign = damaged_copy(sharded, "foreign")
    (foreign / ".metadata").write_bytes(pickle.dumps(RunsCode()))
    borrowed = damaged_copy(sharded, "borrowed")  # a function DCP's metadata module imports, called
    (borrowed / ".metadata").write_bytes(b"ctorch.distributed.checkpoint.metadata\nfield\n)R.")
    rest_damaged = damaged_copy(sharded, "rest")
    (rest_damaged / REST).write_bytes(b"not a checkpoint")
    for path, message in [(cut, "is incomplete: its shard __0_0.distcp is missing or shorter than its index says"),
                          (no_index, "is not a complete sharded checkpoint (it has no .metadata)"),
                          (foreign, "builtins.print has no place in a checkpoint index"),
                          (borrowed, "torch.distributed.checkpoint.metadata.field has no place in a checkpoint index"),
                          (rest_damaged, "meta.pt' (")]:
        for weights in (True, False):
            with pytest.raises(DataError, match=re.escape(message)):
                read_checkpoint(path, "ckpt_path", weights=weights)
    assert "ran code" not in capsys.readouterr().out


def test_a_sharded_checkpoint_is_checked_against_the_model_and_resumed_only_under_fsdp(sharded: Path) -> None:
    shapes = read_checkpoint(sharded, "ckpt_path", weights=False)
    check_checkpoint_fits(shapes, tiny(10), sharded)
    with pytest.raises(ConfigError, match="does not fit this model .another vocabulary.: net.embed.weight is .10, 4. there"):
        check_checkpoint_fits(shapes, tiny(12), sharded)
    check_sharded_resume(sharded, sharded_strategy=True)
    with pytest.raises(ConfigError, match="is a sharded checkpoint .* which only FSDP resumes: add trainer=fsdp"):
        check_sharded_resume(sharded, sharded_strategy=False)
    torch.save(checkpoint(1), sharded.parent / "whole.ckpt")
    check_sharded_resume(sharded.parent / "whole.ckpt", sharded_strategy=False)
    # The run's own check reads the shapes only (no rank gathers the weights), and only under trainer=fsdp.
    resumed = read_resume_checkpoint(str(sharded), {"_target_": "trident.parallel.fsdp.ShardedStrategy"})
    assert resumed is not None and all(t.is_meta for t in resumed[1]["state_dict"].values())
    with pytest.raises(ConfigError, match="only FSDP resumes"):
        read_resume_checkpoint(str(sharded), "auto")


@pytest.fixture(scope="module")
def run_copies(lm_reference_run: tuple[Path, dict[str, float]], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two copies of the LM reference run (4 steps, one process): as it is, and with its checkpoints sharded."""
    root = tmp_path_factory.mktemp("sharded_run")
    files, sharded = (Path(shutil.copytree(lm_reference_run[0], root / name, ignore=shutil.ignore_patterns("wandb")))
                      for name in ("files", "sharded"))
    for checkpoint_file in files.glob("checkpoints/*.ckpt"):
        (sharded / "checkpoints" / checkpoint_file.name).unlink()
        save_sharded_copy(checkpoint_file, sharded / "checkpoints" / checkpoint_file.name)
    return files, sharded


def test_the_readers_take_a_sharded_run_as_its_checkpoint_files(run_copies: tuple[Path, Path], tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """trident.load, init_from, averaging and eval.py read a sharded run (its weights gathered in this process)
    as the same run with checkpoint files."""
    files, sharded = run_copies
    assert checkpoint_of(sharded).name == checkpoint_of(files).name and checkpoint_of(files).name.startswith("best-")
    torch.testing.assert_close(trident.load(sharded).net.state_dict(), trident.load(files).net.state_dict(), rtol=0, atol=0)
    for inside in (".", "checkpoints/last.ckpt"):  # the run directory (its best checkpoint), or a checkpoint
        torch.testing.assert_close(read_init_source(str(sharded / inside)).state_dict,
                                   read_init_source(str(files / inside)).state_dict, rtol=0, atol=0)
    averaged = [average_checkpoints([run / "checkpoints" / "last.ckpt"], tmp_path / f"{run.name}.ckpt")["state_dict"]
                for run in (files, sharded)]
    torch.testing.assert_close(averaged[1], averaged[0], rtol=0, atol=0)
    scores = []
    for run in (files, sharded):
        result = run_in_process("eval.py", [f"ckpt_path={run}"], tmp_path, monkeypatch)
        assert result.returncode == 0, result.stderr
        (written,) = (run / "eval").glob("*.json")
        metrics = json.loads(written.read_text())["metrics"]
        scores.append({k: v for k, v in metrics.items() if not k.endswith("_per_s")})  # speeds vary
    assert scores[1] == scores[0] and "test/loss" in scores[0]
