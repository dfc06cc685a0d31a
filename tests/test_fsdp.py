"""``trainer=fsdp_cpu``: FSDP2 (``fully_shard`` per Transformer block, then the root) on 2 gloo
processes, each a real ``train.py`` subprocess. It trains the same model as DDP (``trainer=ddp_cpu``)
step for step (the MLM, with dropout, gradient clipping, gradient accumulation and activation checkpointing),
each rank holding half the weights, and every task trains under it with the default logger (W&B, offline).

The MLM FSDP run is stopped by SIGTERM twice and resumed each time, first from a checkpoint file, then from a
sharded checkpoint (``trainer.strategy.save_distributed_checkpoint=true``), and still trains as DDP's
uninterrupted run, in one W&B run; its sharded checkpoints are read whole without FSDP (``trident.load``, eval.py,
trident-export, ``init_from``). An LM run in one process (``trainer.devices=1``) resumes at 2 ranks (1 -> 2), and
that run in one process again (2 -> 1), with the one-process run's losses. The other options a user combines with
FSDP (docs/scaling.md's table) ride on these runs: classify from the MLM run's sharded weights (``init_from``) with
LoRA, sharded checkpoints, layer-wise rates and early stopping; vit in bf16; and the learning-rate finder runs
under it. Each run is made once (module-scoped fixtures) for every test that reads it: a ``train.py`` start costs
far more than its steps, so one run carries several checks (the stop/resume chain is the MLM run itself)."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import trident
from trident.parallel.distributed_checkpoint import is_sharded_checkpoint
from trident.tracking.wandb_files import find_offline_runs
from trident.weights.checkpoints import read_checkpoint
from trident.weights.init_from import read_init_source

from .conftest import SMALL
from .entry_points import run_in_process
from .shared_runs import QUIET, TASK_RUNS, assert_clean, run_script
from .test_classify import CLASSIFY_SMALL

pytestmark = pytest.mark.slow

RECORD = ["+callbacks.record_rank._target_=tests.sharding_helpers.RecordRank"]
# 20 steps with dropout on (each rank's random state matters), epochs of 4 steps, validation once.
LM_20 = [*SMALL, *QUIET, "model.dropout=0.1", "trainer.max_steps=20", "trainer.limit_train_batches=4",
         "trainer.check_val_every_n_epoch=null", "trainer.val_check_interval=20", "seed=3"]
# Both MLM runs clip the gradients' norm at 0.1 and accumulate 2 batches a step (40 batches): under FSDP the norm must be
# the whole model's, as DDP's is. The FSDP run also checkpoints activations (the same dropout masks recomputed).
MLM_20 = ["task=mlm", *(o for o in LM_20 if not o.startswith("task.sampling")), "trainer.gradient_clip_val=0.1",
          "trainer.accumulate_grad_batches=2"]
# The DDP references are compared, not read: no logger, no test.
REFERENCE = ["logger=none", "test=false"]
# A resume that changes it names the trainer again: the command line is checked against the default config first.
SHARDED = ["trainer.strategy.save_distributed_checkpoint=true"]
# SIGTERM to every rank as optimizer step `callbacks.signal.step` (0-based) begins: the run saves after it and stops.
STOP = ["+callbacks.signal._target_=tests.resume_helpers.SignalAtStep", "+callbacks.signal.signal_name=SIGTERM",
        "+callbacks.signal.rank=null"]
# A few steps of each other task (the LM and the MLM are the runs above): classify (its own test, below), translation,
# and vit in bf16 (FSDP gathers bf16 weights and reduces fp32 gradients).
TASKS = {"translation": TASK_RUNS["translation"], "vit": [*TASK_RUNS["vit"], "precision=bf16"]}
# Classify from the MLM run's encoder (init_from) with LoRA adapters (whole checkpoints without the frozen base: sharded
# ones are refused), layer-wise learning rates and early stopping (patience 1 with an improvement of 100 needed: the
# second validation, at step 2, stops it).
CLASSIFY = [*(o for o in CLASSIFY_SMALL if o != "logger=none"), *QUIET, "finetune=lora",
            "task.layer_decay=0.8", "task.head_lr=0.01", "callbacks=early_stopping",
            "callbacks.early_stopping.patience=1", "callbacks.early_stopping.min_delta=100", "trainer.val_check_interval=1",
            "trainer.limit_test_batches=1"]
# Runs across world sizes: 6 steps of the global batch 8 (data.batch_size x processes), without dropout (one process
# cannot draw two ranks' masks), so that one process's loss is the mean of the 2 ranks' (each its half of the batch).
# Every 2 steps a sharded checkpoint is kept (at-step2.ckpt, ... in a folder of each run): one to resume from at the other
# world size.
RESHARD = [*(o for o in SMALL if not o.startswith("data.batch_size")), *QUIET, "model.dropout=0", "trainer.max_steps=6",
           "trainer.limit_train_batches=4", "trainer.check_val_every_n_epoch=null", "trainer.val_check_interval=6",
           "logger=none", "test=false", "seed=5", *SHARDED,
           "+callbacks.every_2._target_=lightning.pytorch.callbacks.ModelCheckpoint",
           "+callbacks.every_2.every_n_train_steps=2", "+callbacks.every_2.save_top_k=-1",
           "+callbacks.every_2.filename='at-step{step}'", "+callbacks.every_2.auto_insert_metric_name=false"]
ONE_PROCESS, TWO_RANKS = ["trainer.devices=1", "data.batch_size=8"], ["trainer.devices=2", "data.batch_size=4"]


def train_py(args: list[str], cwd: Path, here: pytest.MonkeyPatch | None) -> None:
    """``python train.py <args>``: a fresh process, or with ``here`` this one (a run of one process, whose process
    boundary no test checks: a fresh one would only add its imports)."""
    if here is None:
        assert_clean(run_script("train.py", *args, cwd=cwd))
        return
    result = run_in_process("train.py", args, cwd, here)
    assert result.returncode == 0 and "Traceback" not in result.stdout + result.stderr, result.stderr[-3000:]


def train(root: Path, trainer: str, *overrides: str, here: pytest.MonkeyPatch | None = None) -> Path:
    root.mkdir(exist_ok=True)
    train_py([f"trainer={trainer}", *overrides, *RECORD, f"paths.output_root={root / 'outputs'}"], root, here)
    (run_dir,) = root.glob("outputs/runs/*/*")
    return run_dir


def resume(run_dir: Path, *overrides: str, here: pytest.MonkeyPatch | None = None) -> None:
    train_py([f"resume={run_dir}", *overrides], run_dir, here)


def ranks(run_dir: Path, world_size: int = 2) -> list[dict[str, Any]]:
    return [json.loads((run_dir / f"rank{r}.json").read_text()) for r in range(world_size)]


def last(run_dir: Path, weights: bool = True) -> dict[str, Any]:
    """The run's last checkpoint, a file or sharded (then gathered here, in one process without FSDP)."""
    return read_checkpoint(run_dir / "checkpoints" / "last.ckpt", "the run's last checkpoint", weights=weights)


def net_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return {k.removeprefix("net."): v for k, v in last(run_dir)["state_dict"].items() if k.startswith("net.")}


def assert_completed_with_one_wandb_run(run_dir: Path) -> None:
    assert json.loads((run_dir / "status.json").read_text())["status"] == "completed"
    assert [r["world_size"] for r in ranks(run_dir)] == [2, 2]
    assert len(list(run_dir.glob("wandb/offline-run-*"))) == 1, "one W&B run (the default logger), from rank 0"


def assert_trains_as_ddp(ddp: Path, fsdp: Path, steps: int = 20) -> None:
    """Each rank's losses (one an optimizer step) equal DDP's, each rank holds half of every parameter, gradient and optimizer
    state, and the last checkpoint holds the whole weights, the same as DDP's."""
    for ddp_rank, fsdp_rank in zip(ranks(ddp), ranks(fsdp)):
        assert len(fsdp_rank["losses"]) == steps
        torch.testing.assert_close(fsdp_rank["losses"], ddp_rank["losses"], rtol=0, atol=1e-5)
        held, whole = fsdp_rank["params"], ddp_rank["params"]
        assert held["dtensors"] == held["tensors"] == whole["tensors"] and whole["dtensors"] == 0
        assert held["total"] == whole["total"] == whole["local"]
        # fully_shard splits each tensor's first dimension in two (rounded up): about half each.
        assert 0.45 < held["local"] / held["total"] < 0.55, held
        # Gradients and optimizer state are sharded like the parameters (AdamW: two moments a parameter).
        for kind in ("parameters", "gradients", "optimizer_state"):
            assert 0.45 < held["bytes"][kind] / whole["bytes"][kind] < 0.55, (kind, held["bytes"], whole["bytes"])
    torch.testing.assert_close(last(fsdp)["state_dict"], last(ddp)["state_dict"], rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def mlm_fsdp(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The MLM's DDP run and its FSDP run (with activation checkpointing), both clipping and accumulating. The FSDP
    run is stopped by SIGTERM during steps 5 and 13 (mid-epoch: an epoch is 2 steps of 2 batches) and resumed each
    time: from a checkpoint file, after which it saves sharded checkpoints, then from a sharded one. Returns both run
    directories."""
    root = tmp_path_factory.mktemp("mlm")
    ddp = train(root / "ddp", "ddp_cpu", *MLM_20, *REFERENCE)
    fsdp = train(root / "fsdp", "fsdp_cpu", *MLM_20, "model.activation_checkpointing=true", *STOP,
                 "+callbacks.signal.step=4")
    checkpoint = fsdp / "checkpoints" / "last.ckpt"
    assert checkpoint.is_file() and last(fsdp, weights=False)["global_step"] == 5
    resume(fsdp, "trainer=fsdp_cpu", *SHARDED, "++callbacks.signal.step=12")
    assert is_sharded_checkpoint(checkpoint) and last(fsdp, weights=False)["global_step"] == 13
    resume(fsdp, "trainer=fsdp_cpu", *SHARDED, "++callbacks.signal=null")
    return ddp, fsdp


def test_fsdp_stopped_and_resumed_twice_trains_the_mlm_as_ddp_does_clipping_accumulating_and_checkpointing_activations(
        mlm_fsdp: tuple[Path, Path]) -> None:
    """Steps 6-13 follow a resume from a checkpoint file, steps 14-20 one from a sharded checkpoint: each rank's
    losses and the weights are still DDP's uninterrupted run's, and the three attempts are one W&B run (rank 0's)."""
    ddp, fsdp = mlm_fsdp
    assert json.loads((fsdp / "status.json").read_text())["status"] == "completed"
    assert [r["world_size"] for r in ranks(fsdp)] == [2, 2]
    attempts = find_offline_runs(fsdp)
    assert len(attempts) == 3 and len({run.run_id for run in attempts}) == 1, [run.path for run in attempts]
    assert_trains_as_ddp(ddp, fsdp)


@pytest.mark.parametrize("task", list(TASKS))
def test_every_other_task_trains_under_fsdp_with_the_default_logger(task: str, tmp_path: Path) -> None:
    run_dir = train(tmp_path, "fsdp_cpu", *TASKS[task], "trainer.max_steps=2", "trainer.limit_test_batches=1")
    assert_completed_with_one_wandb_run(run_dir)
    if task == "vit":
        assert "precision_used: bf16-mixed" in (run_dir / "config_resolved.yaml").read_text()


def test_classify_trains_under_fsdp_from_the_mlm_with_lora_and_early_stopping(
        mlm_fsdp: tuple[Path, Path], tmp_path: Path) -> None:
    """init_from under FSDP: the MLM run's sharded weights, gathered and loaded before sharding (every rank starts from
    them); LoRA: the base stays as loaded, the adapters and the head train and are written to <run>/adapter (from the
    best checkpoint), the checkpoints hold them without the base (which trident.load refills); early stopping stops
    both ranks."""
    _, mlm = mlm_fsdp
    assert is_sharded_checkpoint(mlm / "checkpoints" / "last.ckpt")
    run_dir = train(tmp_path, "fsdp_cpu", *CLASSIFY, f"init_from={mlm}")
    assert_completed_with_one_wandb_run(run_dir)
    source = read_init_source(str(mlm)).state_dict
    for record in ranks(run_dir):  # each whole parameter's sum as training starts: the source's (the head is new)
        started = {name.removeprefix("net."): total for name, total in record["start_sums"].items()}
        loaded = {name for name in started.keys() & source.keys() if not name.startswith("head.")}
        assert any(name.startswith("encoder.") for name in loaded), sorted(started)
        assert {n: started[n] for n in loaded} == pytest.approx(
            {n: float(source[n].double().sum()) for n in loaded}, rel=0, abs=1e-9)
    status = json.loads((run_dir / "status.json").read_text())
    assert status["stopped_early"].startswith("stopped early at step 2:"), status
    adapter = load_file(run_dir / "adapter" / "adapter.safetensors")  # what trained: the adapters and the new head
    assert {k for k in adapter if "lora_" not in k} == {"head.weight", "head.bias"}, sorted(adapter)
    source, tuned = net_weights(mlm), trident.load(run_dir / "checkpoints" / "last.ckpt").net.state_dict()
    saved = net_weights(run_dir).keys()  # what trains, and what the source lacks (the class token), not the frozen base
    assert saved >= adapter.keys() and not (saved - adapter.keys()) & source.keys(), sorted(saved)
    base = [k for k in source if k in tuned and k not in adapter]  # the embedding and the encoder
    assert any(k.startswith("encoder.") for k in base), sorted(tuned)
    for name in base:  # the frozen base: as the MLM run left it, bit for bit
        assert torch.equal(tuned[name], source[name]), name
    (best_checkpoint,) = (run_dir / "checkpoints").glob("best-step*.ckpt")
    best = read_checkpoint(best_checkpoint, "the best checkpoint")["state_dict"]
    for name, tensor in adapter.items():
        assert torch.equal(tensor, best[f"net.{name}"]), name


def evaluate(run_dir: Path, cwd: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, float]:
    result = run_in_process("eval.py", [f"ckpt_path={run_dir}"], cwd, monkeypatch)
    assert result.returncode == 0, result.stderr
    (written,) = (run_dir / "eval").glob("*.json")
    metrics = json.loads(written.read_text())["metrics"]
    return {k: v for k, v in metrics.items() if not k.endswith("_per_s")}  # speeds vary


def test_a_sharded_run_is_read_whole_without_fsdp(mlm_fsdp: tuple[Path, Path], tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank wrote its shards; trident.load, init_from, trident-export and eval.py gather them in one
    process into the weights of DDP's run (the checkpoint at step 20: the best, the run's only validation)."""
    lm_ddp, run_dir = mlm_fsdp
    folder = run_dir / "checkpoints"
    assert sorted(os.listdir(folder)) == ["best-step20.ckpt", "last.ckpt"], "nothing staged is left behind"
    for checkpoint in folder.iterdir():
        assert sorted(os.listdir(checkpoint)) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    whole = net_weights(lm_ddp)
    torch.testing.assert_close(trident.load(run_dir).net.state_dict(), whole, rtol=0, atol=1e-5)
    torch.testing.assert_close(read_init_source(str(run_dir)).state_dict, whole, rtol=0, atol=1e-5)
    out = tmp_path / "exported"
    result = run_in_process("trident.commands.export", [str(run_dir), "--format", "safetensors", "--out", str(out)],
                            tmp_path, monkeypatch)
    assert result.returncode == 0, result.stderr
    exported = load_file(out / "model.safetensors")
    torch.testing.assert_close(exported, {k: whole[k] for k in exported}, rtol=0, atol=1e-5)
    sharded, reference = evaluate(run_dir, tmp_path, monkeypatch), evaluate(lm_ddp, tmp_path, monkeypatch)
    assert sharded.keys() == reference.keys() and "test/loss" in sharded
    assert sharded == pytest.approx(reference, abs=1e-4)


def resumable_at(run_dir: Path, checkpoint: Path, copy: Path) -> Path:
    """A copy of ``run_dir`` whose only checkpoint is ``checkpoint`` (a sharded one), as its last: a resume continues from
    there (it would take the latest step of the run's checkpoints)."""
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("checkpoints"))
    shutil.copytree(checkpoint, copy / "checkpoints" / "last.ckpt")
    return copy


@pytest.fixture(scope="module")
def resharded(tmp_path_factory: pytest.TempPathFactory, single_thread: None) -> dict[str, Path]:
    """6 steps of the LM: in one process (trainer=fsdp_cpu trainer.devices=1) throughout; that run resumed at 2 ranks
    from its sharded checkpoint of step 2 (1 -> 2); and that one resumed in one process from its sharded checkpoint of
    step 4 (2 -> 1). The global batch stays 8. Each run's checkpoints of every 2 steps go to a folder of its own
    (``<name> steps``). The one-process runs run in this process (train.py's entry, a mesh of one rank)."""
    root = tmp_path_factory.mktemp("reshard")
    runs = {"one process": root / "one", "1 -> 2": root / "one-to-two", "2 -> 1": root / "two-to-one"}
    steps = {name: root / f"{run.name}-steps" for name, run in runs.items()}
    with pytest.MonkeyPatch.context() as here:
        one = train(runs["one process"], "fsdp_cpu", *RESHARD, *ONE_PROCESS,
                    f"+callbacks.every_2.dirpath={steps['one process']}", here=here)
    resume(resumable_at(one, steps["one process"] / "at-step2.ckpt", runs["1 -> 2"]), "trainer=fsdp_cpu", *SHARDED,
           *TWO_RANKS, f"++callbacks.every_2.dirpath={steps['1 -> 2']}")
    with pytest.MonkeyPatch.context() as here:
        resume(resumable_at(runs["1 -> 2"], steps["1 -> 2"] / "at-step4.ckpt", runs["2 -> 1"]), "trainer=fsdp_cpu",
               *SHARDED, *ONE_PROCESS, f"++callbacks.every_2.dirpath={steps['2 -> 1']}", here=here)
    runs["one process"] = one
    return {**runs, **{f"{name} steps": folder for name, folder in steps.items()}}


def assert_resumed_from(run_dir: Path, checkpoint: Path, world_size: int) -> list[dict[str, Any]]:
    """The resumed run completed at ``world_size`` and started from the weights ``checkpoint`` holds (each whole
    parameter's sum as training starts, on every rank); returns each rank's record."""
    assert json.loads((run_dir / "status.json").read_text())["status"] == "completed"
    saved = read_checkpoint(checkpoint, "the checkpoint resumed from")["state_dict"]
    records = ranks(run_dir, world_size)
    for record in records:
        assert record["world_size"] == world_size
        assert record["start_sums"] == pytest.approx({n: float(saved[n].double().sum()) for n in record["start_sums"]},
                                                     rel=0, abs=1e-9)
    return records


def test_a_sharded_checkpoint_of_one_process_resumes_at_two_ranks(resharded: dict[str, Path]) -> None:
    """1 -> 2: the sharded checkpoint of step 2 written by one process resumes at 2 ranks with the weights it holds;
    steps 3-6 have the one-process run's losses (the mean of the 2 ranks' half batches) and end at its weights."""
    one, two = resharded["one process"], resharded["1 -> 2"]
    first, second = assert_resumed_from(two, resharded["one process steps"] / "at-step2.ckpt", world_size=2)
    (alone,) = ranks(one, 1)
    assert alone["world_size"] == 1 and len(alone["losses"]) == 6
    alone = alone["losses"]
    assert len(first["losses"]) == 6 and len(second["losses"]) == 4  # rank 0 continues the one process's record
    torch.testing.assert_close([(a + b) / 2 for a, b in zip(first["losses"][2:], second["losses"])], alone[2:],
                               rtol=0, atol=1e-5)
    torch.testing.assert_close(last(two)["state_dict"], last(one)["state_dict"], rtol=0, atol=1e-5)


def test_a_sharded_checkpoint_of_two_ranks_resumes_in_one_process(resharded: dict[str, Path]) -> None:
    """2 -> 1: the sharded checkpoint of step 4 written by 2 ranks resumes in one process (trainer=fsdp_cpu
    trainer.devices=1) with the weights it holds; steps 5-6 have the one-process run's losses and end at its weights."""
    one, back = resharded["one process"], resharded["2 -> 1"]
    (record,) = assert_resumed_from(back, resharded["1 -> 2 steps"] / "at-step4.ckpt", world_size=1)
    assert len(record["losses"]) == 6
    torch.testing.assert_close(record["losses"][4:], ranks(one, 1)[0]["losses"][4:], rtol=0, atol=1e-5)
    torch.testing.assert_close(last(back)["state_dict"], last(one)["state_dict"], rtol=0, atol=1e-5)


def test_the_learning_rate_finder_runs_under_fsdp(tmp_path: Path) -> None:
    """tune=lr_find on 2 ranks: its 20 steps at rising rates, then the weights it started from put back (its own
    checkpoint, gathered and loaded into the shards), and a suggestion in the range it swept."""
    run_dir = train(tmp_path, "fsdp_cpu", *SMALL, *QUIET, "logger=none", "tune=lr_find", "tune.num_training=20")
    found = json.loads((run_dir / "lr_find.json").read_text())
    assert len(found["loss"]) == len(found["lr"]) == 20 and all(math.isfinite(v) for v in found["loss"])
    assert found["min_lr"] <= found["suggested_lr"] <= found["max_lr"]
