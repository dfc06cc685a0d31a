"""The life of a task's networks, in this order: build, load weights, apply the converters, shard, compile.

1. **Build**: the task's constructor builds each network it trains (:attr:`TridentTask.NETWORKS`, ``net`` alone
   today) and each frozen companion (:meth:`TridentTask.add_companion`: a teacher, a reference policy).
2. **Load**: a companion's weights are read from its source as soon as the constructor returns, every time the
   task is built (a run, ``load_from_checkpoint``, ``trident.load``, a resume): it is never saved with the run.
   A new run's ``init_from`` weights go into ``net`` next (trident.runs.lifecycle: that room reads sources),
   before any converter changes it; a checkpoint's own weights are those of the converted networks, which
   Lightning loads once the constructor has returned. A companion that copies a trained network's **initial**
   weights (``add_companion(..., initial_of="net")``: DPO's reference policy in full fine-tuning) is filled from
   that network once a new run has loaded ``init_from`` into it, and written to its source
   (:func:`save_initial_companions`), from which a resume or a load reads it again.
3. **Convert**: the converters the task's hyperparameters record (trident.converters, e.g. ``lora=``) change each
   trained network; only what a converter lets train, and the task's ``HEAD``, keep their gradients. Applied
   when the constructor returns, so a checkpoint re-applies them from its own hyperparameters; a run that loads
   weights first builds the task inside :func:`converting_later` and calls :func:`convert_networks` itself.
4. **Shard**: ``trainer=fsdp``: every network, companions included, on Lightning's device mesh
   (``configure_model`` -> :func:`shard_networks`).
5. **Compile**: ``compile=true``: every network in place (:func:`compile_network`: ``nn.Module.compile``, whose
   graph is traced at the first call, after sharding), so parameter names and checkpoints stay as they are;
   ``compile=blocks``: each Transformer block in place instead (the FSDP units of step 4).

Companions are kept outside the module tree: no state dict, optimizer, DDP reducer or checkpoint sees them;
they follow the task's device and dtype (``TridentTask._apply``), stay in eval mode and never train.
:func:`switched_off` runs the trained networks as they were loaded, where every converter can be switched off.
"""

from __future__ import annotations

import contextvars
import inspect
from abc import ABCMeta
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from trident.backbone import TransformerBlock, TransformerStack
from trident.converters import Converter, converters_of
from trident.errors import ConfigError, DataError


class TaskNetworks(Protocol):
    """What the lifecycle reads of a task (trident.tasks.base.TridentTask, which imports this module)."""

    NAME: ClassVar[str]
    HEAD: ClassVar[tuple[str, ...]]
    hparams: Any
    converters: list[Converter]
    companions: dict[str, nn.Module]
    companion_sources: dict[str, str]
    companion_initial: dict[str, str]

    def networks(self) -> dict[str, nn.Module]: ...

    def on_networks_converted(self) -> None: ...

# Set while a run builds its task: the converters wait until the run has loaded the source's weights.
_later: contextvars.ContextVar[bool] = contextvars.ContextVar("converting_later", default=False)


class NetworkLifecycle(ABCMeta):
    """The metaclass of tasks: when a task's constructor (the build) returns, its companions are loaded and its
    converters applied, whoever built it (a run, Lightning's ``load_from_checkpoint``, a test)."""

    def __init__(cls, name: str, bases: tuple[type, ...], namespace: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(name, bases, namespace, **kwargs)
        # inspect.signature(task_class) would otherwise read __call__ below (*args, **kwargs): the class keeps its
        # constructor's arguments, which the run checks its task.* keys against.
        constructor = inspect.signature(cls.__init__)
        cls.__signature__ = constructor.replace(parameters=list(constructor.parameters.values())[1:])

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        task = super().__call__(*args, **kwargs)
        if not _later.get():
            load_companions(task)
            convert_networks(task)
        return task


@contextmanager
def converting_later() -> Iterator[None]:
    """Tasks built inside keep their networks as built and their companions unread, for weights to be loaded
    before :func:`load_companions` and :func:`convert_networks`."""
    token = _later.set(True)
    try:
        yield
    finally:
        _later.reset(token)


def load_companions(task: TaskNetworks, started: bool = False) -> None:
    """Each companion's weights from its source (a ``.safetensors`` file of its state dict, or a trident
    checkpoint: its ``net``), frozen, in eval mode; ``started`` (a new run, its networks just loaded from
    ``init_from``): a copy of a trained network's initial weights is taken from that network."""
    for name, companion in task.companions.items():
        initial_of = task.companion_initial.get(name)
        weights = (task.networks()[initial_of].state_dict() if started and initial_of is not None
                   else read_network_weights(task.companion_sources[name], f"the {name} of task={task.NAME}"))
        missing, unexpected = companion.load_state_dict(weights, strict=False)
        if missing or unexpected:
            raise DataError(f"{task.companion_sources[name]} does not fit the {name} of task={task.NAME} "
                            f"({(missing or unexpected)[0]}): pass the weights of a network of its settings")
        companion.requires_grad_(False).eval()


def save_initial_companions(task: TaskNetworks) -> None:
    """Write each copy of a trained network's initial weights to its source (a ``.safetensors`` file), for a resume
    or a load to read it again (a new run's rank 0, once :func:`load_companions` has filled them)."""
    from safetensors.torch import save_file

    for name in task.companion_initial:
        path = Path(task.companion_sources[name])
        path.parent.mkdir(parents=True, exist_ok=True)
        # Cloned: tied weights share one tensor, which safetensors refuses to write twice.
        weights = {key: value.detach().cpu().clone().contiguous() for key, value in task.companions[name].state_dict().items()}
        save_file(weights, str(path))


@contextmanager
def _all_off(task: TaskNetworks) -> Iterator[None]:
    with ExitStack() as stack:
        for net in task.networks().values():
            for converter in task.converters:
                stack.enter_context(converter.switched_off(net))
        yield


def can_switch_off(converters: Sequence[Converter | type[Converter]]) -> bool:
    """Whether ``converters`` (one at least: instances, or the classes a config chooses) can each be switched off."""
    return bool(converters) and all(converter.SWITCHES_OFF for converter in converters)


def switched_off(task: TaskNetworks) -> AbstractContextManager[None] | None:
    """A context in which ``task``'s trained networks run as they were loaded, every converter switched off (e.g.
    LoRA's adapters); None when no converter is applied or one cannot be switched off."""
    return _all_off(task) if can_switch_off(task.converters) else None


# The folders a relative companion source is found in while a task is built: the run's directory (a run, its resume,
# eval.py) or a checkpoint's folders (a load). A run records its copies run-relative, so a moved run reads its own.
_beside: contextvars.ContextVar[tuple[Path, ...]] = contextvars.ContextVar("companions_beside", default=())


@contextmanager
def companions_beside(*folders: Path) -> Iterator[None]:
    """Tasks built inside read (and a new run writes) a relative companion source in the first of ``folders``
    that holds it, else in the first."""
    token = _beside.set(tuple(folders))
    try:
        yield
    finally:
        _beside.reset(token)


def companion_path(source: str) -> str:
    """A companion's source as recorded -> where it is read and written: an absolute path as it is, a relative one
    (``init/reference.safetensors``) in the folders of :func:`companions_beside` (none: the working directory's)."""
    path, folders = Path(source), _beside.get()
    if path.is_absolute() or not folders:
        return source
    return str(next((folder / path for folder in folders if (folder / path).exists()), folders[0] / path))


def read_network_weights(source: str, what: str) -> dict[str, Tensor]:
    """The state dict of one network at ``source``: a ``.safetensors`` file, or a trident checkpoint's ``net``."""
    path = Path(source)
    if not path.is_file():
        raise ConfigError(f"{what} is read from {source}, which is not a file: pass a .safetensors file or a trident "
                          "checkpoint (.ckpt)")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    return {k.removeprefix("net."): v for k, v in checkpoint["state_dict"].items() if k.startswith("net.")}


def convert_networks(task: TaskNetworks) -> None:
    """Apply the converters ``task``'s hyperparameters record to each network it trains (in place; the names of
    the existing parameters stay): what no converter lets train is frozen, but for the task's ``HEAD``."""
    task.converters = converters_of(task.hparams)
    for net in task.networks().values():
        convert_network(net, task.converters, task.HEAD)
    task.on_networks_converted()


def convert_network(net: nn.Module, converters: list[Converter], head: tuple[str, ...] = ()) -> None:
    """Apply ``converters`` to ``net`` in order (in place): what none of them lets train is frozen, but for the
    parameters under ``head`` (a task's ``HEAD``). A network rebuilt from a checkpoint alone is converted here too
    (trident.weights.network)."""
    for converter in converters:
        converter.apply(net)
    if converters:
        for name, param in net.named_parameters():
            param.requires_grad_(name.startswith(head) or all(c.trains(name) for c in converters))


def merge_converters(task: TaskNetworks) -> None:
    """Fold every converter of ``task`` into its networks' plain layers (an export writes the base's layout)."""
    for net in task.networks().values():
        merge_network(net, task.converters)


def merge_network(net: nn.Module, converters: list[Converter]) -> None:
    """Fold ``converters`` (applied to ``net`` in this order) into its plain layers, the last applied first."""
    for converter in reversed(converters):
        converter.merge(net)


def all_networks(task: TaskNetworks | Any) -> list[nn.Module]:
    """The networks ``task`` trains, then its companions (a LightningModule that is not a trident task: its ``net``)."""
    if not hasattr(task, "networks"):
        return [task.net]
    return [*task.networks().values(), *task.companions.values()]


def shard_networks(task: TaskNetworks, mesh: DeviceMesh, precision: str) -> None:
    """FSDP (and tensor parallelism) over ``mesh``: each network of ``task``, companions included."""
    from trident.parallel.fsdp import DATA_PARALLEL, parallelize  # Lightning's strategies: an export needs none

    for net in all_networks(task):
        for converter in task.converters:  # e.g. the NF4 base's scale groups, split over the ranks
            converter.check_shards(net, mesh[DATA_PARALLEL].size())
        parallelize(net, mesh, precision)


#: The compiled variants each stack's blocks may take under compile=blocks (twice torch's default recompile_limit: an
#: LM run with validation, sampling and a test passed 8 with one stack).
RECOMPILES_PER_STACK = 16


def compile_network(task: TaskNetworks, mode: Any) -> None:
    """``compile=true``: torch.compile each network of ``task`` in place (``nn.Module.compile``), so parameter
    names, checkpoints and the LightningModule hooks stay as they are. ``compile=blocks``: each Transformer block
    in place instead, as torchtitan's ``apply_compile`` does: the blocks of a stack share one graph (compiled
    once, not once per layer), the rest runs eagerly, and FSDP still shards those very blocks, after they are
    compiled (torchtitan's order too: configure_model shards at fit, after this)."""
    if not (isinstance(mode, bool) or mode == "blocks"):
        raise ConfigError(f"compile must be true, false or blocks, got {mode!r}: true compiles the whole network, "
                          "blocks each Transformer block on its own")
    if mode is True:
        for net in all_networks(task):
            net.compile()
    elif mode == "blocks":
        blocks = [module for net in all_networks(task) for module in net.modules() if isinstance(module, TransformerBlock)]
        if not blocks:
            raise ConfigError(f"compile=blocks found no Transformer block in {type(task).__name__}'s networks: "
                              "use compile=true (the whole network)")
        # Every stack's blocks share TransformerBlock.forward's code, whose compiled variants (training, evaluation,
        # a KV cache's prefill and steps, a second shape...) dynamo caps at recompile_limit for all of them: an
        # encoder-decoder passed torch's 8 within one validation and beam search, the rest running eagerly; an LM run
        # with validation, sampling and a test took 10.
        stacks = sum(isinstance(module, TransformerStack) for net in all_networks(task) for module in net.modules())
        limit = torch._dynamo.config.recompile_limit
        torch._dynamo.config.recompile_limit = max(limit, RECOMPILES_PER_STACK * max(stacks, 1))
        for block in blocks:
            block.compile()
