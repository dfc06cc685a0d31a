"""Test-only callback that train.py loads by ``_target_``: what each rank of a run holds and computes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
from torch.distributed.tensor import DTensor


class RecordRank(L.Callback):
    """Writes ``rank<r>.json`` into the run directory: this rank's training loss at every step (its
    own batch, before any averaging over ranks) and the parameters it holds (its shards under FSDP)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.held: dict[str, Any] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        params = list(pl_module.parameters())
        self.held = {
            "total": sum(p.numel() for p in params),
            "local": sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params),
            "dtensors": sum(isinstance(p, DTensor) for p in params),
            "tensors": len(params),
        }

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        record = {"world_size": trainer.world_size, "losses": self.losses, "params": self.held}
        (Path(trainer.default_root_dir) / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))
