"""Activation memory on any device: the bytes autograd keeps for the backward pass; a process's own peak RSS.

CPU PyTorch has no ``max_memory_allocated``, and a process's peak RSS mixes in the allocator's
caching and everything else the process did. What activation checkpointing changes is exactly
the set of tensors saved for backward, which peaks when the forward pass ends: counting them
through ``torch.autograd.graph.saved_tensors_hooks`` is deterministic and device-independent.
"""

from __future__ import annotations

import re
import resource
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor


def saved_activation_bytes(forward: Callable[[], Tensor]) -> int:
    """Bytes of distinct storages autograd saves while ``forward()`` runs (before backward).

    Storages are counted once however many ops save them (a residual input is saved by several).
    Tensors saved inside a non-reentrant checkpoint are held by the checkpoint's own hooks,
    which take precedence, so they are (rightly) not counted: they are recomputed, not kept.
    """
    storages: dict[int, int] = {}

    def pack(tensor: Tensor) -> Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        forward()
    return sum(storages.values())


def peak_rss_bytes() -> int:
    """This process's peak resident memory. Linux's ``ru_maxrss`` carries the peak of the process that started
    this one over fork and exec (rank 0's in a rank it starts, the bench's in a run it starts), so it is read
    from ``VmHWM``, the high-water mark of this process's own address space, where Linux has it."""
    status = Path("/proc/self/status")
    found = re.search(r"^VmHWM:\s+(\d+) kB$", status.read_text(), re.MULTILINE) if status.is_file() else None
    if found:
        return int(found.group(1)) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # macOS: bytes, and no /proc
