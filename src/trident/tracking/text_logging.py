"""Log a table of text (generated samples, translations) to every attached logger that can show it."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger
from rich.console import Console
from rich.table import Table
from rich.text import Text


def log_text_table(module: L.LightningModule, key: str, columns: list[str], rows: list[list[Any]]) -> None:
    """W&B gets a ``wandb.Table``; TensorBoard a markdown text; the console a rich table."""
    for logger in module.loggers:
        if isinstance(logger, WandbLogger):
            logger.log_text(key=key, columns=columns, data=rows, step=module.global_step)
        elif isinstance(logger, TensorBoardLogger):
            text = "\n\n".join(" | ".join(str(v) for v in row) for row in rows)
            logger.experiment.add_text(key, text, global_step=module.global_step)
    table = Table(*columns, title=f"{key} (step {module.global_step})", show_lines=True)
    for row in rows:
        # Text, not a str: rich reads a str's brackets as markup, and a chat template's "[INST] ... [/INST]" (or any
        # sampled "[/x]") is a closing tag that matches nothing, which raised and ended the run at its validation.
        table.add_row(*(Text(str(v)) for v in row))
    Console().print(table)
