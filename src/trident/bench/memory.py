"""Activation memory on any device: the bytes autograd keeps for the backward pass.

CPU PyTorch has no ``max_memory_allocated``, and a process's peak RSS mixes in the allocator's
caching and everything else the process did. What activation checkpointing changes is exactly
the set of tensors saved for backward, which peaks when the forward pass ends: counting them
through ``torch.autograd.graph.saved_tensors_hooks`` is deterministic and device-independent.
"""

from __future__ import annotations

from collections.abc import Callable

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
