"""DPO's reference policy in full fine-tuning on the companion seam (trident.tasks.networks): a frozen copy of the
initial policy, written to ``<run>/init/reference.safetensors`` and read from there again (a resume, a load), never in
a checkpoint, sharded like the policy under FSDP; a run stopped and resumed equals the uninterrupted one step for step."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

import trident
from tests.conftest import compose_config
from tests.sharding_helpers import one_rank_process_group
from tests.test_preference import ROWS, llama, preference_data, trident_task, write_jsonl
from trident.objectives.preference import check_preference_run
from trident.parallel.fsdp import DATA_PARALLEL
from trident.runs.pipeline import train

__all__ = ["llama"]  # the module's fixture, used here


def test_the_reference_is_a_frozen_companion_outside_the_state_dict(tmp_path: Path, llama: Path) -> None:
    """The copy holds the initial weights, trains nothing and is no part of the task's state dict (so of no
    checkpoint, optimizer or DDP reducer); a task loaded with the same source reads it back equal."""
    from trident.tasks.networks import save_initial_companions

    source = tmp_path / "reference.safetensors"
    task = trident_task(llama, {"name": "dpo"}, reference=source)
    reference = task.companions["reference"]
    torch.testing.assert_close(reference.state_dict(), task.net.state_dict(), rtol=0, atol=0)
    assert not any(p.requires_grad for p in reference.parameters()) and not reference.training
    assert {key for key in task.state_dict() if not key.startswith("net.")} <= {
        key for key in task.state_dict() if key.startswith(("objective.", "epoch_losses.", "step_loss."))}
    save_initial_companions(task)
    with torch.no_grad():
        for param in task.net.parameters():
            param.add_(1.0)  # trained: a resumed task's policy is no longer the initial one
    from trident.tasks.lm import LanguageModelTask

    again = LanguageModelTask(**{**task.hparams, "reference": str(source)})
    torch.testing.assert_close(again.companions["reference"].double().state_dict(), reference.state_dict())


def test_fsdp_shards_the_reference_like_the_policy_and_its_log_probabilities_stay(tmp_path: Path, llama: Path) -> None:
    """trainer=fsdp in full fine-tuning: no longer refused; configure_model shards the reference on the policy's mesh
    (one rank here, as tests/test_networks.py checks a companion), and it gives the reference log-probabilities it
    gave whole."""
    cfg = compose_config(["data=preference", "data.files=[x.jsonl]", "data.source=files", "objective=dpo", "init_from=x",
                          "trainer=fsdp"])
    check_preference_run(cfg)
    data = preference_data(tmp_path, llama, ROWS)
    batch = data.pairs["train"].collate([(i,) for i in range(len(ROWS))])
    task = trident_task(llama, {"name": "dpo"}, reference=tmp_path / "reference.safetensors").float()
    whole = task.objective.reference_logps(task, batch)
    with one_rank_process_group(tmp_path):
        from types import SimpleNamespace

        task._device_mesh = init_device_mesh("cpu", (1,), mesh_dim_names=(DATA_PARALLEL,))
        task._trainer = SimpleNamespace(precision="32-true")  # what configure_model reads of a trainer
        task.configure_model()
        reference = task.companions["reference"]
        assert isinstance(task.net, FSDPModule) and isinstance(reference, FSDPModule)
        assert all(isinstance(p, DTensor) and not p.requires_grad for p in reference.parameters())
        sharded = task.objective.reference_logps(task, batch)
    torch.testing.assert_close(sharded, whole, rtol=1e-5, atol=1e-5)


def _losses(run_dir: Path) -> dict[int, float]:
    """Per-step training losses from every CSV log of a run (a resumed run adds a version)."""
    losses = {}
    for path in sorted(run_dir.rglob("metrics.csv")):
        with path.open() as handle:
            losses |= {int(row["step"]): float(row["train/loss"]) for row in csv.DictReader(handle) if row.get("train/loss")}
    return losses


@pytest.mark.slow
@pytest.mark.usefixtures("single_thread")
def test_a_full_fine_tuning_dpo_run_stopped_and_resumed_equals_the_uninterrupted_one(tmp_path: Path, llama: Path) -> None:
    """train.py data=preference objective=dpo init_from=<Llama directory> (full fine-tuning), 4 steps at once against 2
    then resumed to 4: the same loss at every step and the same weights; the checkpoints hold no reference weight and
    the reference is read from <run>/init/reference.safetensors."""
    files = write_jsonl(tmp_path / "pairs.jsonl", [dict(row, prompt=f"{row['prompt']} {i}") for i in range(4)
                                                  for row in ROWS])
    common = ["task=lm", "data=preference", "objective=dpo", f"init_from={llama}", "data.source=files",
              f"data.files=[{files}]", "data.batch_size=2", "data.max_length=32", "scheduler=constant",
              "trainer.val_check_interval=2", "trainer.limit_val_batches=1", "trainer.log_every_n_steps=1",
              "logger=csv", "test=false", "print_config=false", "callbacks.throughput=null"]
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    train(compose_config([*common, "trainer.max_steps=4"], output_dir=whole))
    train(compose_config([*common, "trainer.max_steps=2"], output_dir=tmp_path / "first"))
    (tmp_path / "first").rename(stopped)  # moved before the resume: the run reads its own copy, where it is now
    train(compose_config([*common, "trainer.max_steps=4", f"resume={stopped}"], output_dir=stopped))
    expected, resumed = _losses(whole), _losses(stopped)
    assert sorted(expected) == [0, 1, 2, 3]
    torch.testing.assert_close(resumed, expected, rtol=0, atol=1e-6)
    last = [torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
            for run in (whole, stopped)]
    torch.testing.assert_close(last[1], last[0], rtol=0, atol=1e-6)
    assert not any(key.startswith("reference") or ".reference" in key for key in last[0]), "the policy's weights alone"
    assert (stopped / "init" / "reference.safetensors").is_file()
    # Moved again and loaded (trident.load, as init_from=<this run> or trident-export read it; and eval.py): the
    # reference is the moved run's copy of the initial weights, recorded relative to the run.
    moved = tmp_path / "elsewhere" / "run"
    moved.parent.mkdir()
    stopped.rename(moved)
    loaded = trident.load(moved)
    initial = load_file(str(moved / "init" / "reference.safetensors"))
    torch.testing.assert_close(loaded.companions["reference"].state_dict(), initial, rtol=0, atol=0)
    assert OmegaConf.load(moved / "config_resolved.yaml").task.reference == "init/reference.safetensors"
    from trident.commands.evaluate import evaluate

    assert "test/rewards/accuracies" in evaluate([f"ckpt_path={moved}", "trainer.limit_test_batches=1"])  # eval.py too
