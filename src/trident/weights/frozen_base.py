"""A ``finetune=lora`` run's checkpoints without its frozen base.

Under LoRA the ``init_from`` weights do not train: every checkpoint of the run (``last.ckpt``, ``best-*``,
step checkpoints, the EMA's swapped copy, an average of them, what ``log_model=best`` uploads) holds only
what trains (the adapters, a new head) and every other tensor the source did not give as it is (a resampled
position table, buffers), plus :data:`FROZEN_BASE_KEY`: where the base came from (``init_from`` made
absolute), the names of the tensors it fills and their fingerprint (trident.tasks.frozen_base takes them out
and puts them back). Every reader refills them (the task's ``on_load_checkpoint``, with trident.weights.sources'
``find_base``)
from, in this order: the network itself when it already holds the base (a run that tests or resumes), the
run's own copy of its source (``<run>/init``, beside the checkpoint), then ``$TRIDENT_BASE`` (where a moved
base is now) if set, else the recorded ``init_from``. The fingerprint must
match; a base found nowhere, or changed, is one error line.

The fingerprint is sha256 over each base tensor's name, dtype, shape and bytes as trident reads them from the
source, one hash per tensor in threads (hashlib releases the GIL), so it costs about a read of the weights
over the cores; sizes and mtimes of files would miss a base rewritten in place and break on a copy.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from trident.converters.nf4 import holds
from trident.errors import DataError
from trident.tasks.frozen_base import FROZEN_BASE_KEY, FrozenBase, finetune_of
from trident.weights.lora_adapter import base_of

if TYPE_CHECKING:
    from trident.tasks.task_in_checkpoint import TaskInCheckpoint

__all__ = ["BASE_VARIABLE", "FROZEN_BASE_KEY", "base_difference", "base_from_source", "fingerprint",
           "frozen_base_of", "keep_base_out"]

#: Where a moved base is now (a reader's override of the recorded ``init_from``).
BASE_VARIABLE = "TRIDENT_BASE"


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
    source's tensor of their name unchanged (or quantized from it: finetune=qlora's NF4 base, quantized again when read). A parameter the source did not give as it is (resampled, new)
    stays in the checkpoints."""
    names = [name for name, tensor in net.state_dict(keep_vars=True).items()
             if isinstance(tensor, nn.Parameter) and not tensor.requires_grad and name in weights
             and holds(tensor, weights[name])]
    return FrozenBase(source, names, fingerprint(weights, names), in_net=True)


def keep_base_out(task: TaskInCheckpoint, weights: dict[str, Any], init_from: str, saved: dict[str, Any] | None,
                  resumed: bool) -> None:
    """finetune=lora: the run's checkpoints leave out the frozen base, the ``weights`` of ``init_from`` that the
    network holds (weights.frozen_base); a resumed run's base goes into the network from its source first, checked
    against its checkpoint's record (a checkpoint written before records none: it holds every weight)."""
    if not resumed:  # the record names it as the run's adapter.json does
        task.frozen_base = frozen_base_of(task.net, base_of(init_from), weights)
    elif saved is not None and FROZEN_BASE_KEY in saved:
        task.frozen_base = base_from_source(task.net, saved[FROZEN_BASE_KEY], weights, init_from, finetune_of(saved))
    # FSDP loads a checkpoint's weights itself, before the task's on_load_checkpoint: the base is in the network by
    # then, and the checkpoint's part alone is loaded.
    task.strict_loading = False


def base_from_source(net: nn.Module, record: dict[str, Any], weights: dict[str, Tensor], given: str,
                     finetune: str) -> FrozenBase:
    """A resumed run's base (``record``, from its checkpoint) put into ``net`` from the ``weights`` of its source
    (``given``: how the run names it), before the checkpoint is loaded (FSDP loads the saved part alone);
    ``finetune``: the run's mode (lora, qlora), as the error line names it."""
    wanted = FrozenBase.from_record(record, finetune)
    differs = base_difference(wanted, weights, given)
    if differs is not None:
        raise DataError(f"resume: the run's checkpoint holds its finetune={wanted.finetune} adapters without the frozen base they "
                        f"adapt, init_from={wanted.source} ({len(wanted.names)} tensors), and {differs}: resume with "
                        "init_from=<the base the run was trained on>")
    net.load_state_dict({name: weights[name] for name in wanted.names}, strict=False)
    wanted.in_net = True
    return wanted


def base_difference(wanted: FrozenBase, weights: dict[str, Tensor], where: str) -> str | None:
    """How ``weights`` (read from ``where``) differ from the recorded base; None: they are it."""
    missing = [name for name in wanted.names if name not in weights]
    if missing:
        return f"{where} lacks {missing[0]}"
    found = fingerprint(weights, wanted.names)
    if found != wanted.fingerprint:
        return f"the weights at {where} changed (fingerprint {found[:12]}, recorded {wanted.fingerprint[:12]})"
    return None
