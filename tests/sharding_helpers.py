"""``RecordRank``, the callback train.py loads by ``_target_`` (``tests.sharding_helpers.RecordRank``; it lives in
the bench, :mod:`trident.bench.rank_record`, whose ``sharding`` row runs it too); :func:`save_sharded_copy`, a
checkpoint file rewritten as the sharded checkpoint ``trainer=fsdp`` writes; fake and one-rank process groups."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from trident.bench.rank_record import RecordRank
from trident.parallel.fsdp import DATA_PARALLEL, ShardedStrategy
from trident.parallel.tensor_parallel import TENSOR_PARALLEL

# The FSDP tests' runs load it by this module's name (``tests.sharding_helpers.RecordRank``).
__all__ = ["RecordRank", "fake_two_ranks", "one_rank_process_group", "save_sharded_copy"]


def save_sharded_copy(checkpoint_file: Path, directory: Path) -> None:
    """The checkpoint file rewritten as the sharded checkpoint directory ``trainer=fsdp`` writes with
    ``save_distributed_checkpoint=true`` (here by one process: its shards are the whole tensors), without the
    optimizer state (no reader outside a resume takes it)."""
    checkpoint = torch.load(checkpoint_file, map_location="cpu", weights_only=True)
    checkpoint.pop("optimizer_states", None)
    ShardedStrategy(save_distributed_checkpoint=True).save_checkpoint(checkpoint, directory)


@contextmanager
def fake_two_ranks() -> Iterator[DeviceMesh]:
    """Rank 0 of a tensor-parallel group of 2 whose collectives exchange nothing (torch's fake process group):
    shapes and placements are real, values are not."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (1, 2), mesh_dim_names=(DATA_PARALLEL, TENSOR_PARALLEL))
    finally:
        dist.destroy_process_group()


@contextmanager
def one_rank_process_group(tmp_path: Path) -> Iterator[None]:
    """A gloo process group of one rank (its file store under ``tmp_path``): the fast tests' device meshes need one."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
