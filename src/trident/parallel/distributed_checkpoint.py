"""Sharded checkpoints: ``trainer=fsdp`` with ``trainer.strategy.save_distributed_checkpoint=true``.

Each rank writes its own shards of the weights and optimizer state with ``torch.distributed.checkpoint``
(DCP, through Lightning's ``ModelParallelStrategy``): nothing is gathered on one rank. The checkpoint is a
directory with the name the file would have had (``checkpoints/last.ckpt/``), holding

- ``__<rank>_0.distcp``, each rank's shards, and ``.metadata``, DCP's index of them (each tensor's whole
  shape and where its pieces lie);
- ``meta.pt``, Lightning's rest: step, loops, callbacks (RNG states), data position, hyperparameters,
  tokenizer: an ordinary checkpoint without ``state_dict`` and ``optimizer_states``.

It is written under a hidden name (``.last.ckpt.<random>.tmp``) and renamed once complete
(:func:`save_sharded`): a save cut off mid-write is never taken for a checkpoint. ``trainer=fsdp`` resumes
from it at any number of processes (DCP reads each rank's new shards out of the saved ones); every other
reader (eval.py, ``trident.load``, trident-export, ``init_from``, averaging) gets from
:func:`read_sharded_checkpoint` the dict a checkpoint file holds, its weights gathered whole in one process
without FSDP. torch is imported where it is used: :func:`is_checkpoint` serves ``resume=auto`` before
torch loads.
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trident.errors import ConfigError, DataError

if TYPE_CHECKING:
    from lightning.pytorch.strategies import Strategy
    from torch.distributed.checkpoint import Metadata

# DCP's index of the shards, and Lightning's file of the rest (lightning.fabric.utilities.load._METADATA_FILENAME).
DCP_INDEX = ".metadata"
REST = "meta.pt"
SHARD_SUFFIX = ".distcp"
# The key of the weights in a checkpoint, and the first part of their names in DCP's index.
WEIGHTS = "state_dict"
FIX = "use another checkpoint of the run, or copy the whole directory again"
# The module of DCP's index classes.
METADATA_MODULE = "torch.distributed.checkpoint.metadata"


def is_sharded_checkpoint(path: Path) -> bool:
    """``path`` is a complete sharded checkpoint directory (its two index files are written last)."""
    return path.is_dir() and (path / DCP_INDEX).is_file() and (path / REST).is_file()


def is_checkpoint(path: Path) -> bool:
    """A checkpoint file, or a complete sharded checkpoint directory."""
    return path.is_file() or is_sharded_checkpoint(path)


def holds_shards(path: Path) -> bool:
    """``path`` is a sharded checkpoint directory, complete or not (what a reader names: it then says what is missing)."""
    return path.is_dir() and ((path / DCP_INDEX).is_file() or (path / REST).is_file()
                              or any(path.glob(f"*{SHARD_SUFFIX}")))


def save_sharded(strategy: Strategy, write: Callable[[Path], None], filepath: str | os.PathLike[str]) -> None:
    """Every rank writes its shards with ``write`` into a hidden directory next to ``filepath`` (rank 0 names
    it), which rank 0 then renames to ``filepath``, replacing the checkpoint of that name."""
    target = Path(strategy.broadcast(str(filepath)))
    target.parent.mkdir(parents=True, exist_ok=True)
    named = tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp") if strategy.is_global_zero else ""
    staging = Path(strategy.broadcast(named))
    try:
        write(staging)
        if strategy.is_global_zero:
            _put_in_place(staging, target)
    except BaseException:
        if strategy.is_global_zero:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    strategy.barrier("sharded checkpoint in place")


def _put_in_place(staging: Path, target: Path) -> None:
    _fsync(staging / REST)  # Lightning's torch.save does not sync it; DCP's writer syncs its own files
    _fsync(staging)
    replace_checkpoint(staging, target)


def replace_checkpoint(staged: Path, target: Path) -> None:
    """Rename the complete checkpoint ``staged`` (a file or a sharded directory, beside ``target``) to ``target``,
    replacing the checkpoint of that name, a file or a sharded directory: a run that switches between whole and
    sharded checkpoints replaces one kind by the other in place."""
    if (staged.is_file() and not _is_directory(target)) or not os.path.lexists(target):
        os.replace(staged, target)  # at once
    else:
        if _is_directory(target) and not holds_shards(target):
            raise DataError(f"cannot save checkpoint {str(target)!r}: a directory that is not a sharded checkpoint has "
                            "its name: move it away, or set another checkpoint directory or file name")
        # A directory cannot be renamed over another, nor a file over a directory: the old checkpoint steps aside
        # (hidden) for a moment.
        retired = staged.with_suffix(".old")
        os.replace(target, retired)
        try:
            os.replace(staged, target)
        except BaseException:  # (Ctrl-C, a full disk) the old checkpoint comes back under its name
            os.replace(retired, target)
            raise
        if _is_directory(retired):
            shutil.rmtree(retired)
        else:
            retired.unlink()
    _fsync(target.parent)  # the rename itself survives a power loss


def _is_directory(path: Path) -> bool:
    """A directory itself, not a link to one (a link is replaced, not what it points to)."""
    return path.is_dir() and not path.is_symlink()


def _fsync(path: Path) -> None:
    handle = os.open(path, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def check_sharded_resume(path: Path, sharded_strategy: bool) -> None:
    """A sharded checkpoint resumes under ``trainer=fsdp`` only (at any number of processes): its optimizer
    state is kept in shards that only FSDP's loader reads."""
    if holds_shards(path) and not sharded_strategy:
        raise ConfigError(
            f"{path} is a sharded checkpoint (a torch.distributed.checkpoint directory), which only FSDP resumes: "
            "add trainer=fsdp (trainer=fsdp_cpu on CPUs; any number of processes, trainer.devices=1 too), "
            f"or start a new run from its weights with init_from={path}"
        )


class _IndexUnpickler(pickle.Unpickler):
    """DCP's index is a pickle: read it allowing only what an index holds (DCP's metadata classes, each
    shard's place in the files, torch's sizes and dtypes, the path it was saved to), so that a file from
    elsewhere cannot run code, as ``weights_only=True`` guards checkpoint files."""

    def find_class(self, module: str, name: str) -> Any:
        import torch

        allowed = "." not in name and (  # a dotted name would reach any attribute (torch.load, os.system)
                   module == METADATA_MODULE
                   or (module, name) in (("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                                         ("torch.serialization", "_get_layout"))  # a layout by its name
                   or (module.split(".")[0] == "pathlib" and name in ("PosixPath", "WindowsPath", "PurePosixPath"))
                   or (module == "torch" and (name == "Size" or isinstance(
                       getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)))))
        found = super().find_class(module, name) if allowed else None
        # Of DCP's metadata module, only the classes it defines (not what it imports: a function, a module).
        if found is None or (module == METADATA_MODULE and not (isinstance(found, type) and found.__module__ == module)):
            raise pickle.UnpicklingError(f"{module}.{name} has no place in a checkpoint index")
        return found


def read_index(path: Path, setting: str) -> Metadata:
    """DCP's index of the sharded checkpoint ``path`` (named by the config key ``setting``), checked against
    the shard files: each one there and as long as the index says (a copy or a save cut short is not)."""
    from torch.distributed.checkpoint import Metadata

    for name in (DCP_INDEX, REST):
        if not (path / name).is_file():
            raise DataError(f"{str(path)!r} is not a complete sharded checkpoint (it has no {name}): point {setting} at "
                            "a checkpoint file or a whole sharded checkpoint directory")
    try:
        with open(path / DCP_INDEX, "rb") as file:
            index = _IndexUnpickler(file).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError, ValueError, OSError) as err:
        raise DataError(f"cannot read the index of sharded checkpoint {str(path)!r} ({type(err).__name__}: {err}): "
                        f"{FIX}") from err
    if not isinstance(index, Metadata):
        raise DataError(f"{str(path / DCP_INDEX)!r} is not an index of shards (torch.distributed.checkpoint): {FIX}")
    ends: dict[str, int] = {}
    for stored in (index.storage_data or {}).values():
        ends[stored.relative_path] = max(ends.get(stored.relative_path, 0), stored.offset + stored.length)
    for name, end in sorted(ends.items()):
        shard = path / name
        if not shard.is_file() or shard.stat().st_size < end:
            raise DataError(f"sharded checkpoint {str(path)!r} is incomplete: its shard {name} is missing or shorter "
                            f"than its index says (a copy or a save cut short): {FIX}")
    return index


def read_sharded_checkpoint(path: Path, setting: str, weights: bool = True) -> dict[str, Any]:
    """The dict a checkpoint file holds, read from the sharded checkpoint ``path`` in this process (no FSDP,
    no process group): ``meta.pt`` with ``state_dict``, each weight whole, gathered from its shards. With
    ``weights=False``, each weight's shape and dtype only (meta tensors): for checks before a resume, which
    then loads each rank's shards itself. The optimizer state stays out: only a resumed run needs it."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    index = read_index(path, setting)
    try:
        rest = torch.load(path / REST, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError) as err:
        raise DataError(f"cannot read {str(path / REST)!r} ({type(err).__name__}: corrupt or truncated): {FIX}") from err
    state_dict: dict[str, torch.Tensor] = {}
    for key, stored in index.state_dict_metadata.items():
        place = index.planner_data[key]  # the key's path in the saved dict: ("state_dict", "net.head.weight")
        if place[0] == WEIGHTS and isinstance(stored, TensorStorageMetadata):
            state_dict[".".join(map(str, place[1:]))] = torch.empty(
                stored.size, dtype=stored.properties.dtype, device="cpu" if weights else "meta")
    if weights:
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
                dcp.load({WEIGHTS: state_dict}, storage_reader=dcp.FileSystemReader(path), no_dist=True)
        except (dcp.CheckpointException, RuntimeError, OSError, ValueError) as err:
            raise DataError(f"cannot read the shards of sharded checkpoint {str(path)!r} ({type(err).__name__}): "
                            f"{FIX}") from err
    return {**rest, WEIGHTS: state_dict}
