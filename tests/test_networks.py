"""Several networks per task (issue 51 item 2): a task that trains ``net`` beside a frozen companion (a teacher,
the shape of a distillation or a reference policy). No trident task holds a second network yet, so the proof is a
task of the tests': its checkpoints hold no teacher weight, the teacher is read from its source again whenever the
task is built (a checkpoint's load included), it gets no gradient and no optimizer state, it follows the task's
dtype, and FSDP shards it as it shards ``net`` (one rank here, two gloo processes below)."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from trident.backbone import TransformerConfig
from trident.errors import ConfigError, DataError
from trident.models import CausalLM
from trident.parallel.fsdp import DATA_PARALLEL
from trident.tasks.lm import LanguageModelTask

from .sharding_helpers import one_rank_process_group
from .test_task_contract import OPTIMIZER, SCHEDULER

BACKBONE = {"d_model": 8, "n_heads": 2, "n_layers": 2, "d_ff": 16, "max_seq_len": 8, "pos_encoding": "rope",
            "dropout": 0.0}
VOCAB = 11


class DistilledLM(LanguageModelTask):
    """An LM that learns the next token and its teacher's distribution: ``teacher`` is where the frozen teacher's
    weights are (a hyperparameter, so a checkpoint knows where to read them again)."""

    def __init__(self, backbone: dict[str, Any], vocab_size: int, optimizer: dict[str, Any],
                 scheduler: dict[str, Any], teacher: str, lora: dict[str, Any] | None = None) -> None:
        super().__init__(backbone, vocab_size, optimizer, scheduler, lora=lora)
        self.add_companion("teacher", CausalLM(self.backbone_config, vocab_size), teacher)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        inputs, targets = batch  # (B, T), (B, T)
        logits = self.net(inputs)  # (B, T, V)
        with torch.no_grad():
            taught = self.companions["teacher"](inputs)  # (B, T, V)
        summed = (F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
                  + F.kl_div(logits.log_softmax(-1), taught.log_softmax(-1), log_target=True, reduction="sum"))
        return self.trained_loss(summed, torch.tensor(targets.numel()))


def teacher_file(path: Path, seed: int) -> dict[str, Tensor]:
    """A teacher's weights (random, ``seed``) written to ``path`` as safetensors; returns them."""
    torch.manual_seed(seed)
    weights = {k: v.clone() for k, v in CausalLM(TransformerConfig(**BACKBONE), VOCAB).state_dict().items()}
    save_file(weights, str(path))  # each tensor its own copy (the tied head too)
    return weights


def _batches() -> DataLoader:
    ids = torch.randint(0, VOCAB, (4, 9), generator=torch.Generator().manual_seed(0))
    return DataLoader([(row[:-1], row[1:]) for row in ids], batch_size=2)


def _same(a: dict[str, Tensor], b: dict[str, Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def trained(tmp_path: Path) -> tuple[DistilledLM, L.Trainer, Path, dict[str, Tensor]]:
    source = teacher_file(tmp_path / "teacher.safetensors", seed=1)
    torch.manual_seed(0)
    task = DistilledLM(BACKBONE, VOCAB, {**OPTIMIZER, "lr": 1e-2}, SCHEDULER, teacher=str(tmp_path / "teacher.safetensors"))
    trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        default_root_dir=str(tmp_path))
    trainer.fit(task, train_dataloaders=_batches())
    checkpoint = tmp_path / "distilled.ckpt"
    trainer.save_checkpoint(checkpoint)
    return task, trainer, checkpoint, source


def test_the_companion_is_read_from_its_source_frozen_and_outside_the_module_tree(tmp_path: Path) -> None:
    source = teacher_file(tmp_path / "teacher.safetensors", seed=1)
    task = DistilledLM(BACKBONE, VOCAB, OPTIMIZER, SCHEDULER, teacher=str(tmp_path / "teacher.safetensors"))
    teacher = task.companions["teacher"]
    assert _same(teacher.state_dict(), source)
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    assert not any(name.startswith("teacher") for name in task.state_dict())
    assert {id(p) for p in task.parameters()}.isdisjoint(id(p) for p in teacher.parameters())
    task.to(torch.float64)  # a precision plugin's cast: the companion follows the task
    assert teacher.head.weight.dtype == torch.float64 and task.net.head.weight.dtype == torch.float64


def test_the_checkpoint_holds_no_companion_and_a_load_reads_it_from_its_source_again(
        trained: tuple[DistilledLM, L.Trainer, Path, dict[str, Tensor]], tmp_path: Path) -> None:
    task, trainer, checkpoint, source = trained
    saved = torch.load(checkpoint, map_location="cpu", weights_only=True)
    assert saved["state_dict"] and not [k for k in saved["state_dict"] if "teacher" in k]
    assert saved["hyper_parameters"]["teacher"] == str(tmp_path / "teacher.safetensors")
    # It trained without a gradient or an optimizer state, and is the source's still.
    teacher = task.companions["teacher"]
    assert all(p.grad is None for p in teacher.parameters())
    optimized = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
    assert optimized and optimized.isdisjoint(id(p) for p in teacher.parameters())
    assert _same(teacher.state_dict(), source)
    # A load builds the task again: the trained net from the checkpoint, the teacher from where it is now.
    moved = teacher_file(tmp_path / "teacher.safetensors", seed=2)
    loaded = DistilledLM.load_from_checkpoint(checkpoint, map_location="cpu", weights_only=True)
    assert _same(loaded.net.state_dict(), task.net.state_dict())
    assert _same(loaded.companions["teacher"].state_dict(), moved)


def test_a_converter_changes_the_trained_network_not_the_companion(tmp_path: Path) -> None:
    teacher_file(tmp_path / "teacher.safetensors", seed=1)
    lora = {"rank": 2, "alpha": 4.0, "dropout": 0.0, "targets": ["q", "v"]}
    task = DistilledLM(BACKBONE, VOCAB, OPTIMIZER, SCHEDULER, teacher=str(tmp_path / "teacher.safetensors"), lora=lora)
    assert any(".lora_A." in name for name in task.net.state_dict())
    assert not any(".lora_A." in name for name in task.companions["teacher"].state_dict())


def test_a_companion_source_that_is_missing_or_does_not_fit_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="the teacher of task=lm is read from .*nowhere.safetensors, which is not a file"):
        DistilledLM(BACKBONE, VOCAB, OPTIMIZER, SCHEDULER, teacher=str(tmp_path / "nowhere.safetensors"))
    save_file({"other.weight": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(DataError, match="does not fit the teacher of task=lm"):
        DistilledLM(BACKBONE, VOCAB, OPTIMIZER, SCHEDULER, teacher=str(tmp_path / "other.safetensors"))


def _sharded(tmp_path: Path, world_size: int) -> dict[str, Any]:
    """This rank's view of a DistilledLM sharded by its configure_model on a ``world_size`` data-parallel mesh."""
    torch.manual_seed(0)
    task = DistilledLM(BACKBONE, VOCAB, OPTIMIZER, SCHEDULER, teacher=str(tmp_path / "teacher.safetensors"))
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = task.companions["teacher"](ids)
    task._device_mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=(DATA_PARALLEL,))
    task._trainer = SimpleNamespace(precision="32-true")  # what configure_model reads of a trainer
    task.configure_model()
    teacher = task.companions["teacher"]
    embedding = next(teacher.parameters())  # (V, d): FSDP2 splits its rows over the ranks
    seen = {"net": isinstance(task.net, FSDPModule), "teacher": isinstance(teacher, FSDPModule),
            "dtensors": all(isinstance(p, DTensor) for p in teacher.parameters()),
            "local_rows": embedding.to_local().shape[0], "rows": embedding.shape[0],
            "frozen": not any(p.requires_grad for p in teacher.parameters())}
    with torch.no_grad():  # (the root keeps its gathered weights after a forward: read the shards before)
        sharded = teacher(ids)
    return {**seen, "same_logits": bool(torch.allclose(sharded, whole, rtol=1e-5, atol=1e-6))}


def test_fsdp_shards_the_companion_as_it_shards_the_net_on_one_rank(tmp_path: Path) -> None:
    teacher_file(tmp_path / "teacher.safetensors", seed=1)
    with one_rank_process_group(tmp_path):
        seen = _sharded(tmp_path, 1)
    assert seen == {"net": True, "teacher": True, "dtensors": True, "local_rows": VOCAB, "rows": VOCAB,
                    "same_logits": True, "frozen": True}


def _rank(rank: int, port: int, tmp_path: Path) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        (tmp_path / f"{rank}.json").write_text(json.dumps(_sharded(tmp_path, 2)))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_ranks_shard_the_companion_and_it_gives_its_whole_logits(tmp_path: Path) -> None:
    teacher_file(tmp_path / "teacher.safetensors", seed=1)
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    torch.multiprocessing.spawn(_rank, args=(port, tmp_path), nprocs=2)
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"{rank}.json").read_text())
        assert seen["net"] and seen["teacher"] and seen["dtensors"] and seen["frozen"] and seen["same_logits"]
        assert seen["local_rows"] < seen["rows"], "each rank holds a shard of the teacher, not all of it"


class TwoTowerLM(LanguageModelTask):
    """Step 1 of "Add a network to a task" for a trained one: a second tower beside ``net``, named in NETWORKS."""

    NETWORKS = ("net", "tower")

    def __init__(self, backbone: dict[str, Any], vocab_size: int, optimizer: dict[str, Any],
                 scheduler: dict[str, Any], lora: dict[str, Any] | None = None) -> None:
        super().__init__(backbone, vocab_size, optimizer, scheduler, lora=lora)
        self.tower = CausalLM(self.backbone_config, vocab_size)


def test_a_second_trained_network_is_converted_checkpointed_and_sharded(tmp_path: Path) -> None:
    task = TwoTowerLM(BACKBONE, VOCAB, OPTIMIZER, SCHEDULER, lora={"rank": 2, "alpha": 4.0, "dropout": 0.0, "targets": ["q"]})
    for name in TwoTowerLM.NETWORKS:
        adapters = [k for k in task.state_dict() if k.startswith(f"{name}.") and ".lora_A." in k]
        assert adapters, f"{name} has adapters"
        trained = {k for k, p in getattr(task, name).named_parameters() if p.requires_grad}
        assert trained and all(".lora_" in k for k in trained), f"{name}: only its adapters train"
    with one_rank_process_group(tmp_path):
        task._device_mesh = init_device_mesh("cpu", (1,), mesh_dim_names=(DATA_PARALLEL,))
        task._trainer = SimpleNamespace(precision="32-true")
        task.configure_model()
        assert isinstance(task.net, FSDPModule) and isinstance(task.tower, FSDPModule)


def test_the_ema_of_the_weights_shares_the_companion_instead_of_copying_it(tmp_path: Path) -> None:
    """callbacks=ema averages a deep copy of the task: a teacher as large as the net was copied with it, for nothing."""
    from trident.training.callbacks import ModelEMA

    teacher_file(tmp_path / "teacher.safetensors", seed=1)
    task = DistilledLM(BACKBONE, VOCAB, OPTIMIZER, SCHEDULER, teacher=str(tmp_path / "teacher.safetensors"))
    ema = ModelEMA(decay=0.5)
    trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False, callbacks=[ema],
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        default_root_dir=str(tmp_path))
    trainer.fit(task, train_dataloaders=_batches())
    assert ema._average_model is not None
    assert ema._average_model.module.companions["teacher"] is task.companions["teacher"]
    assert task.companions["teacher"] is not None and not task.companions["teacher"].training


def test_a_relative_companion_is_read_from_the_first_folder_that_holds_it(tmp_path: Path) -> None:
    """A run records its copy of the initial weights relative to itself (``init/reference.safetensors``): read beside
    the run, or beside the checkpoint loaded from a run moved elsewhere; written in the first folder when none holds
    it yet; an absolute source is read as it is."""
    from trident.tasks.networks import companion_path, companions_beside

    run, moved = tmp_path / "run", tmp_path / "moved"
    (moved / "init").mkdir(parents=True)
    (moved / "init" / "reference.safetensors").write_bytes(b"")
    with companions_beside(run, moved):
        assert companion_path("init/reference.safetensors") == str(moved / "init" / "reference.safetensors")
        assert companion_path("init/teacher.safetensors") == str(run / "init" / "teacher.safetensors")
        assert companion_path(str(tmp_path / "elsewhere.safetensors")) == str(tmp_path / "elsewhere.safetensors")
