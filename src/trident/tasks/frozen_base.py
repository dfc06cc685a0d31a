"""The tasks' side of a ``finetune=lora`` run's checkpoints without its frozen base (trident.weights.frozen_base
says what is left out and why): the record, taking the base out when a checkpoint is saved, and putting it back when
one is read. Where a base missing from the network is found is the weights room's business: its readers pass
their finder in :func:`reading` (this room sits below the one that reads sources).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from trident.errors import DataError

#: The checkpoint key of the base's record (source, fingerprint, tensors).
FROZEN_BASE_KEY = "trident_frozen_base"
#: The checkpoint entries that hold the network's weights: the weights, and the EMA's raw weights beside its average.
WEIGHT_ENTRIES = ("state_dict", "current_model_state")
# The network's prefix in a task's state dict.
NET = "net."

@dataclass
class FrozenBase:
    """The base of a LoRA network: ``source`` (init_from, absolute), the ``names`` of the network's tensors it
    fills (state-dict keys, without ``net.``), their ``fingerprint``; ``in_net``: the network holds them now;
    ``finetune``: the mode of the run, as its error lines name it (lora, or qlora: :func:`finetune_of`)."""

    source: str
    names: list[str]
    fingerprint: str
    in_net: bool = field(default=False, compare=False)
    finetune: str = field(default="lora", compare=False)

    def record(self) -> dict[str, Any]:
        return {"source": self.source, "fingerprint": self.fingerprint, "tensors": list(self.names)}

    @classmethod
    def from_record(cls, record: dict[str, Any], finetune: str = "lora") -> FrozenBase:
        return cls(str(record["source"]), list(record["tensors"]), str(record["fingerprint"]), finetune=finetune)


def finetune_of(checkpoint: dict[str, Any]) -> str:
    """The ``finetune`` mode of the run that wrote ``checkpoint`` with its base left out: qlora where its base is
    stored in NF4 (its hyperparameters' ``nf4``), else lora."""
    return "qlora" if (checkpoint.get("hyper_parameters") or {}).get("nf4") else "lora"


#: Finds a base's tensors for the checkpoint at the path being read (None: not known), read with the network's head
#: count (a timm file does not record it).
BaseFinder = Callable[[FrozenBase, Path | None, int | None], dict[str, Tensor]]
# The checkpoint being read (trident.load and the commands) and its reader's finder.
_reading: contextvars.ContextVar[tuple[Path, BaseFinder] | None] = contextvars.ContextVar("reading_checkpoint",
                                                                                          default=None)


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
def reading(path: Path, find: BaseFinder | None) -> Iterator[None]:
    """The checkpoint at ``path`` is being read: a base missing from it is found by ``find`` (beside it first)."""
    token = _reading.set((path, find) if find is not None else None)
    try:
        yield
    finally:
        _reading.reset(token)


def refill_base(checkpoint: dict[str, Any], net: nn.Module, known: FrozenBase | None,
                path: Path | None, n_heads: int | None) -> FrozenBase | None:
    """Put the base back into ``checkpoint``'s weights, from ``net`` when it holds the same base (``known``),
    else from where the reader's finder finds it (``n_heads``: ``net``'s, for a source that does not
    record them); returns the base ``net`` holds once the checkpoint is loaded."""
    record = checkpoint.get(FROZEN_BASE_KEY)
    if not isinstance(record, dict):
        return known
    wanted = FrozenBase.from_record(record, finetune_of(checkpoint))
    if known is not None and known.in_net and known.fingerprint == wanted.fingerprint:
        own = net.state_dict()
        weights = {name: own[name].detach() for name in wanted.names}
    else:
        weights = _find(wanted, path, n_heads)
    for entry in WEIGHT_ENTRIES:
        saved = checkpoint.get(entry)
        if isinstance(saved, dict):
            saved.update({NET + name: weights[name] for name in wanted.names})
    wanted.in_net = True
    return wanted


def _find(wanted: FrozenBase, path: Path | None, n_heads: int | None) -> dict[str, Tensor]:
    reader = _reading.get()
    if reader is None:  # e.g. Lightning's load_from_checkpoint called by hand
        raise DataError(f"{path or 'the checkpoint'} holds a finetune={wanted.finetune} run's adapters without the frozen base they "
                        f"adapt (init_from={wanted.source}): read it with trident.load(<the checkpoint>), which puts "
                        "the base back")
    reading_path, find = reader
    return find(wanted, path if path is not None else reading_path, n_heads)
