"""Models larger than one device: FSDP2 (``fully_shard``) on a device mesh, through Lightning's
``ModelParallelStrategy`` (``trainer=fsdp``, ``trainer=fsdp_cpu``).

Lightning builds the device mesh and calls the task's ``configure_model``, which hands the network
to :func:`parallelize`: the one place a model is parallelized. Each Transformer block is its own
FSDP unit (its weights gathered just before it runs, freed after), then the root takes the rest
(embeddings, head, final norm). With ``trainer.strategy.tensor_parallel_size`` > 1 the mesh is 2-D
(data parallel x tensor parallel): the tensor-parallel plan (trident.parallel.tensor_parallel) first
splits the network over each group's ranks, then FSDP shards every piece over the data-parallel dimension.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy, Strategy, StrategyRegistry
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

from trident.backbone import TransformerBlock, TransformerStack
from trident.errors import ConfigError
from trident.parallel.distributed_checkpoint import save_sharded
from trident.parallel.tensor_parallel import TENSOR_PARALLEL, check_world_size, keep_optimizer_rows, tensor_parallelize

# The mesh dimension FSDP shards over (Lightning's name for it).
DATA_PARALLEL = "data_parallel"


# What ShardedStrategy sets itself, and why a user's value cannot be honoured.
_SET_BY_TRIDENT = {
    "data_parallel_size": "trainer=fsdp shards over every process, or every tensor-parallel group",
}


class ShardedStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` sharding over every process: Lightning's ``auto`` data-parallel
    size is the node count, which on one node would leave FSDP nothing to shard over. Its checkpoints
    are whole by default: rank 0 gathers the weights and optimizer state into one ordinary checkpoint
    file. With ``save_distributed_checkpoint=True`` each rank writes its own shards instead, into a
    directory put in place once complete (:mod:`trident.parallel.distributed_checkpoint`).
    ``tensor_parallel_size`` processes form one tensor-parallel group; FSDP shards over the groups."""

    def __init__(self, tensor_parallel_size: int = 1, save_distributed_checkpoint: bool = False, **kwargs: Any) -> None:
        super().__init__(data_parallel_size=1, tensor_parallel_size=tensor_parallel_size,
                         save_distributed_checkpoint=save_distributed_checkpoint, **kwargs)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        write = super().save_checkpoint
        if self._save_distributed_checkpoint:
            save_sharded(self, lambda staging: write(checkpoint, staging, storage_options), filepath)
        elif self.is_global_zero:
            # Not Lightning's save, which first deletes a sharded checkpoint of this name on every rank (the ranks of
            # the nodes race on a shared one), then writes the file: a run switched back to checkpoint files would lose
            # its newest checkpoint to a stop in between. Rank 0 alone replaces it, once the file is complete.
            self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options)

    def setup_environment(self) -> None:
        # The world size is known only once the cluster environment is: here, before the mesh is built.
        world_size = self.num_nodes * self.num_processes
        check_world_size(world_size, self._tensor_parallel_size)  # trainer.devices=-1: known only now
        self._data_parallel_size = world_size // self._tensor_parallel_size
        super().setup_environment()

    def setup_optimizers(self, trainer: L.Trainer) -> None:
        super().setup_optimizers(trainer)
        assert self.model is not None
        for optimizer in self.optimizers:
            keep_optimizer_rows(optimizer, self.model)  # tensor parallelism: its state is saved as the weights are


# trainer.precision values FSDP2 cannot run (fp16 mixed precision needs a gradient scaler).
_UNSHARDABLE_PRECISIONS = {"16-mixed", "16"}
# The strategies that shard the weights over the ranks: Lightning's ModelParallelStrategy (FSDP2, which
# ShardedStrategy is) and its FSDPStrategy (FSDP1), and any subclass of either.
SHARDING_STRATEGIES: tuple[type[Strategy], ...] = (ModelParallelStrategy, FSDPStrategy)


def target_class(node: Mapping[str, Any]) -> type | None:
    """The class a config node's ``_target_`` names, imported; None where it names none (no ``_target_``, a function,
    or nothing importable: Hydra's instantiate says so later)."""
    target = node.get("_target_")
    # Here, not at the top: every task imports this module, and a command that loads a run (export, sample) no Hydra.
    from hydra._internal.utils import _locate

    try:  # Hydra's own lookup; get_class would log an error for a target that is a function, not a class
        located = _locate(str(target)) if target else None
    except (ImportError, ValueError):
        return None
    return located if isinstance(located, type) else None


def strategy_class(strategy: Any) -> type | None:
    """The class a ``trainer.strategy`` value builds: a strategy or its class, a ``_target_`` mapping (its class
    imported, not its name read), or a name Lightning registers (``ddp``, ``fsdp``: its registry says which class).
    None: it names no class (``auto``, an unknown name or target, which Lightning or Hydra refuse when they build it)."""
    if isinstance(strategy, type):
        return strategy
    if isinstance(strategy, Strategy):
        return type(strategy)
    if isinstance(strategy, Mapping):
        return target_class(strategy)
    if isinstance(strategy, str) and strategy.lower() in StrategyRegistry:  # lower-cased, as Lightning reads it
        return StrategyRegistry[strategy.lower()]["strategy"]
    return None


def shards_weights(strategy: Any) -> bool:
    """Whether a ``trainer.strategy`` value (:func:`strategy_class`'s kinds) shards the weights over the ranks: its
    class is, or derives from, one of :data:`SHARDING_STRATEGIES`. The one test trident makes of a strategy."""
    kind = strategy_class(strategy)
    return kind is not None and issubclass(kind, SHARDING_STRATEGIES)


def check_sharding_config(strategy: Any, precision: Any = None) -> None:
    """``trainer=fsdp`` settings it cannot honour (``precision``: ``trainer.precision``), and Lightning's FSDP1 by
    name, are one line before any work."""
    if isinstance(strategy, str) and shards_weights(strategy):
        raise ConfigError(f"trainer.strategy={strategy} is Lightning's FSDP1, which trident does not use: "
                          "choose trainer=fsdp (FSDP2: fully_shard per Transformer block), or trainer=fsdp_cpu on CPUs")
    if not isinstance(strategy, Mapping) or not shards_weights(strategy):
        return
    for key, reason in _SET_BY_TRIDENT.items():
        if key in strategy:
            raise ConfigError(f"trainer.strategy.{key} cannot be set ({reason}): remove trainer.strategy.{key}")
    if str(precision) in _UNSHARDABLE_PRECISIONS:
        # Lightning's ModelParallelStrategy has no gradient scaler for sharded gradients (it refuses 16-mixed
        # itself, but only once the trainer is built, after the data is prepared).
        raise ConfigError(f"precision=fp16 (trainer.precision={precision}) does not work with trainer=fsdp (FSDP2 "
                          "has no fp16 gradient scaler here): use precision=bf16, or precision=fp32")
    sharded = strategy.get("save_distributed_checkpoint", False)
    if not isinstance(sharded, bool):
        raise ConfigError(f"trainer.strategy.save_distributed_checkpoint must be true or false, got {sharded!r}: set "
                          "it to true for sharded checkpoints (each rank writes its shards) or false for whole files")
    if sharded and strategy.get("tensor_parallel_size", 1) != 1:
        # Tensor parallelism saves its split rows whole and in today's order (tensor_parallel's hooks):
        # DCP would write every rank's copy of them, and no test has shown that such a directory reloads.
        raise ConfigError("trainer.strategy.save_distributed_checkpoint=true does not work with tensor parallelism "
                          "(its checkpoints are gathered whole): set trainer.strategy.save_distributed_checkpoint=false")


def mixed_precision(precision: str) -> MixedPrecisionPolicy:
    """bf16 runs compute and gather bf16 parameters but reduce gradients in fp32 (a sum of bf16
    gradients over ranks loses digits); other precisions keep fp32 throughout."""
    if precision.startswith("bf16"):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def parallelize(net: nn.Module, mesh: DeviceMesh, precision: str) -> None:
    """Split ``net`` in place over ``mesh``'s tensor-parallel dimension (when it has more than one rank), then
    shard it over the data-parallel dimension: each TransformerBlock, then the root. A network already sharded
    (``configure_model`` runs again for the test after fit) stays as it is."""
    if isinstance(net, FSDPModule):
        return
    if TENSOR_PARALLEL in (mesh.mesh_dim_names or ()) and mesh[TENSOR_PARALLEL].size() > 1:
        tensor_parallelize(net, mesh[TENSOR_PARALLEL])
    shard_mesh = mesh[DATA_PARALLEL]
    policy = mixed_precision(precision)
    for block in net.modules():
        if isinstance(block, TransformerBlock):
            fully_shard(block, mesh=shard_mesh, mp_policy=policy, reshard_after_forward=True)
    for stack in net.modules():
        if isinstance(stack, TransformerStack):
            prefetch_next_blocks(stack)
    # The root's weights (embeddings, head) stay gathered from forward to backward: the backward needs them first.
    fully_shard(net, mesh=shard_mesh, mp_policy=policy, reshard_after_forward=False)
    # A network run through other methods than forward (CLIP's encode_image / encode_text) names them: FSDP gathers
    # the root's weights around them too.
    for method in getattr(net, "FORWARD_METHODS", ()):
        register_fsdp_forward_method(net, method)


def prefetch_next_blocks(stack: TransformerStack) -> None:
    """Each sharded block of ``stack`` gathers the next one's weights as its forward starts, and the one before as its
    backward starts (torchtitan's explicit prefetch): the all-gather runs beside the block's compute instead of
    before the next block's. Only where layer i runs block i (no model.share_layers, whose blocks run out of order)."""
    blocks = [block for block in stack.blocks if isinstance(block, FSDPModule)]
    if len(blocks) != len(stack.blocks) or list(stack.block_of_layer) != list(range(len(blocks))):
        return
    for block, following in itertools.pairwise(blocks):
        block.set_modules_to_forward_prefetch([following])
        following.set_modules_to_backward_prefetch([block])


@contextmanager
def whole_weights(net: nn.Module) -> Iterator[None]:
    """Entered by every rank: inside, a sharded ``net`` keeps all its weights gathered, so forward
    passes need no collective and one rank may run forwards the others do not (rank 0's samples, a
    decoding loop that stops when its own batch is done); outside FSDP they would hang. Without FSDP, nothing."""
    if not isinstance(net, FSDPModule):
        yield
        return
    units = [module for module in net.modules() if isinstance(module, FSDPModule)]
    net.set_reshard_after_forward(False)
    for unit in units:
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
        net.set_reshard_after_forward(True)
        net.set_reshard_after_forward(False, recurse=False)  # as parallelize left it
