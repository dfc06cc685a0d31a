"""A ``finetune=lora`` run's checkpoints without its frozen base.

Under LoRA the ``init_from`` weights do not train: every checkpoint of the run (``last.ckpt``, ``best-*``,
step checkpoints, the EMA's swapped copy, an average of them, what ``log_model=best`` uploads) holds only
what trains (the adapters, a new head) and every other tensor the source did not give as it is (a resampled
position table, buffers), plus :data:`FROZEN_BASE_KEY`: where the base came from (``init_from`` made
absolute), the names of the tensors it fills and their fingerprint. Every reader refills them (the task's
``on_load_checkpoint``) from, in this order: the network itself when it already holds the base (a run that
tests or resumes), the run's own copy of its source (``<run>/init``, beside the checkpoint), then
``$TRIDENT_BASE`` (where a moved base is now) if set, else the recorded ``init_from``. The fingerprint must
match; a base found nowhere, or changed, is one error line.

The fingerprint is sha256 over each base tensor's name, dtype, shape and bytes as trident reads them from the
source, one hash per tensor in threads (hashlib releases the GIL), so it costs about a read of the weights
over the cores; sizes and mtimes of files would miss a base rewritten in place and break on a copy.
"""

from __future__ import annotations

import contextvars
import hashlib
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from trident.errors import DataError

if TYPE_CHECKING:
    from trident.tasks.task_in_checkpoint import TaskInCheckpoint

#: The checkpoint key of the base's record (source, fingerprint, tensors).
FROZEN_BASE_KEY = "trident_frozen_base"
#: Where a moved base is now (a reader's override of the recorded ``init_from``).
BASE_VARIABLE = "TRIDENT_BASE"
#: The checkpoint entries that hold the network's weights: the weights, and the EMA's raw weights beside its average.
WEIGHT_ENTRIES = ("state_dict", "current_model_state")
# The network's prefix in a task's state dict.
NET = "net."
# The checkpoint being read (trident.load and the commands), to find the run's copy of the source beside it.
_reading: contextvars.ContextVar[Path | None] = contextvars.ContextVar("reading_checkpoint", default=None)


@dataclass
class FrozenBase:
    """The base of a LoRA network: ``source`` (init_from, absolute), the ``names`` of the network's tensors it
    fills (state-dict keys, without ``net.``), their ``fingerprint``; ``in_net``: the network holds them now."""

    source: str
    names: list[str]
    fingerprint: str
    in_net: bool = field(default=False, compare=False)

    def record(self) -> dict[str, Any]:
        return {"source": self.source, "fingerprint": self.fingerprint, "tensors": list(self.names)}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> FrozenBase:
        return cls(str(record["source"]), list(record["tensors"]), str(record["fingerprint"]))


def fingerprint(weights: dict[str, Tensor], names: list[str]) -> str:
    """sha256 over the name, dtype, shape and bytes of ``weights[name]`` for each of ``names``, in order."""
    def one(name: str) -> bytes:
        tensor = weights[name].detach().cpu().contiguous()
        digest = hashlib.sha256(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().data)
        return digest.digest()

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return hashlib.sha256(b"".join(pool.map(one, names))).hexdigest()


def frozen_base_of(net: nn.Module, source: str, weights: dict[str, Tensor]) -> FrozenBase:
    """The base of ``net`` (adapters on, ``weights`` of ``source`` loaded): its frozen parameters that hold the
    source's tensor of their name unchanged. A parameter the source did not give as it is (resampled, new)
    stays in the checkpoints."""
    names = [name for name, tensor in net.state_dict(keep_vars=True).items()
             if isinstance(tensor, nn.Parameter) and not tensor.requires_grad and name in weights
             and weights[name].shape == tensor.shape and torch.equal(weights[name].to(tensor.dtype), tensor.detach())]
    return FrozenBase(source, names, fingerprint(weights, names), in_net=True)


def drop_base(checkpoint: dict[str, Any], base: FrozenBase) -> None:
    """Take the base's tensors out of ``checkpoint`` (its weights, the EMA's raw weights) and record where they
    come from."""
    for entry in WEIGHT_ENTRIES:
        weights = checkpoint.get(entry)
        if isinstance(weights, dict):
            for name in base.names:
                weights.pop(NET + name, None)
    checkpoint[FROZEN_BASE_KEY] = base.record()


@contextmanager
def reading(path: Path) -> Iterator[None]:
    """The checkpoint at ``path`` is being read: a base missing from it is looked for beside it (``<run>/init``)."""
    token = _reading.set(path)
    try:
        yield
    finally:
        _reading.reset(token)


def refill_base(checkpoint: dict[str, Any], net: nn.Module, known: FrozenBase | None,
                path: Path | None, n_heads: int | None) -> FrozenBase | None:
    """Put the base back into ``checkpoint``'s weights, from ``net`` when it holds the same base (``known``),
    else from where :func:`find_base` finds it (``n_heads``: ``net``'s, for a source that does not record them);
    returns the base ``net`` holds once the checkpoint is loaded."""
    record = checkpoint.get(FROZEN_BASE_KEY)
    if not isinstance(record, dict):
        return known
    wanted = FrozenBase.from_record(record)
    if known is not None and known.in_net and known.fingerprint == wanted.fingerprint:
        own = net.state_dict()
        weights = {name: own[name].detach() for name in wanted.names}
    else:
        weights = find_base(wanted, path if path is not None else _reading.get(), n_heads)
    for entry in WEIGHT_ENTRIES:
        saved = checkpoint.get(entry)
        if isinstance(saved, dict):
            saved.update({NET + name: weights[name] for name in wanted.names})
    wanted.in_net = True
    return wanted


def keep_base_out(task: TaskInCheckpoint, weights: dict[str, Any], init_from: str, saved: dict[str, Any] | None,
                  resumed: bool) -> None:
    """finetune=lora: the run's checkpoints leave out the frozen base, the ``weights`` of ``init_from`` that the
    network holds (weights.frozen_base); a resumed run's base goes into the network from its source first, checked
    against its checkpoint's record (a checkpoint written before records none: it holds every weight)."""
    from trident.weights.lora_adapter import base_of  # here: it reads checkpoints, whose module imports this one

    if not resumed:  # the record names it as the run's adapter.json does
        task.frozen_base = frozen_base_of(task.net, base_of(init_from), weights)
    elif saved is not None and FROZEN_BASE_KEY in saved:
        task.frozen_base = base_from_source(task.net, saved[FROZEN_BASE_KEY], weights, init_from)
    # FSDP loads a checkpoint's weights itself, before the task's on_load_checkpoint: the base is in the network by
    # then, and the checkpoint's part alone is loaded.
    task.strict_loading = False


def base_from_source(net: nn.Module, record: dict[str, Any], weights: dict[str, Tensor], given: str) -> FrozenBase:
    """A resumed run's base (``record``, from its checkpoint) put into ``net`` from the ``weights`` of its source
    (``given``: how the run names it), before the checkpoint is loaded (FSDP loads the saved part alone)."""
    wanted = FrozenBase.from_record(record)
    differs = _difference(wanted, weights, given)
    if differs is not None:
        raise DataError(f"resume: the run's checkpoint holds its finetune=lora adapters without the frozen base they "
                        f"adapt, init_from={wanted.source} ({len(wanted.names)} tensors), and {differs}: resume with "
                        "init_from=<the base the run was trained on>")
    net.load_state_dict({name: weights[name] for name in wanted.names}, strict=False)
    wanted.in_net = True
    return wanted


def find_base(wanted: FrozenBase, checkpoint: Path | None, n_heads: int | None = None) -> dict[str, Tensor]:
    """The base's tensors from the run's copy of its source beside ``checkpoint``, else ``$TRIDENT_BASE`` when set,
    else the recorded ``init_from``: the first that exists and holds the recorded fingerprint; else one error line.
    ``n_heads``: the head count of the network, for a source that does not record it (a timm file)."""
    from trident.weights.init_from import COPY_DIR, read_init_source  # here: it imports the tasks, which import this

    override = os.environ.get(BASE_VARIABLE)
    copies = [parent / COPY_DIR for parent in (checkpoint.resolve().parents if checkpoint is not None else [])
              if (parent / COPY_DIR / "source.json").is_file()][:1]
    candidates = [*copies, Path(override) if override else Path(wanted.source)]
    shown = f"{BASE_VARIABLE}={override}" if override else f"init_from={wanted.source}"
    where = f"checkpoint {str(checkpoint)!r}" if checkpoint is not None else "the checkpoint"
    fix = (f"point {BASE_VARIABLE} at the base it was trained on" if override else
           f"put the base back at {wanted.source}, or set {BASE_VARIABLE}=<where it is now>")
    differs: str | None = f"{candidates[-1]} is not there"
    for candidate in candidates:
        if candidate.exists():
            weights = read_init_source(str(candidate), n_heads).state_dict
            differs = _difference(wanted, weights, str(candidate))
            if differs is None:
                return weights
    raise DataError(f"{where} holds a finetune=lora run's adapters without the frozen base they adapt, "
                    f"{shown} ({len(wanted.names)} tensors), and {differs}: {fix}")


def _difference(wanted: FrozenBase, weights: dict[str, Tensor], where: str) -> str | None:
    """How ``weights`` (read from ``where``) differ from the recorded base; None: they are it."""
    missing = [name for name in wanted.names if name not in weights]
    if missing:
        return f"{where} lacks {missing[0]}"
    found = fingerprint(weights, wanted.names)
    if found != wanted.fingerprint:
        return f"the weights at {where} changed (fingerprint {found[:12]}, recorded {wanted.fingerprint[:12]})"
    return None
