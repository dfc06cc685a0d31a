"""Copy a source's weights into a task's network by parameter name and shape, and say what happened:
one table of loaded / newly initialised / dropped parameters.

Matching is by name, so any task whose ``net`` names its parts like the source's (``embed``,
``encoder.*``, ``decoder.*``, ``head``) takes them, whatever the task. A ``head`` whose output count
differs (another number of classes) is rebuilt; one with the same count is kept, unless
``init_new_head=true`` says that the classes mean other things (MNIST digits -> Fashion-MNIST): then
it keeps the task's own initialisation. ``init_only=embeddings`` loads the embedding tables alone. A ViT's learned position table of another grid (fine-tuning
at another image size) is resampled as timm does. A token table of another size is another
vocabulary; any other shape that differs does not fit.
"""

from __future__ import annotations

import csv
import logging
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from lightning.pytorch.loggers import Logger, WandbLogger
from torch import Tensor, nn

from trident.errors import ConfigError, choose
from trident.models.vit import patch_grid

log = logging.getLogger(__name__)

POSITION_TABLE = "encoder.pos_encoding.embedding.weight"  # a learned table: (prefix + positions, D)


@dataclass(frozen=True)
class TransferRow:
    """One group of parameters (e.g. ``encoder.blocks``) with one outcome."""

    outcome: str  # loaded | new | dropped
    group: str
    tensors: int
    parameters: int
    note: str


#: The networks' output layers by module name: the classifier head, and the second head of DeiT's distillation token.
HEADS = ("head", "head_dist")


def group_of(name: str) -> str:
    """``encoder.blocks.3.ffn.fc_in.weight`` -> ``encoder.blocks``; ``head.weight`` -> ``head``."""
    parts = name.split(".")
    module = parts[:-1] or parts
    for i, part in enumerate(module):
        if part.isdigit():
            return ".".join(module[:i])
    return ".".join(module)


def _is_token_table(name: str, here: Tensor, there: Tensor) -> bool:
    """A token embedding (``embed``, ``src_embed``, CLIP's ``text.embed``...) whose number of rows (tokens) differs."""
    module = name.split(".")[-2] if "." in name else name
    return module.endswith("embed") and here.ndim == 2 and here.shape[1] == there.shape[1]


def _what_shapes(name: str) -> str:
    """The settings that shape tensor ``name``, for the line that says it does not fit."""
    if ".self_attn." in name or ".cross_attn." in name:
        return "(its heads, key/value heads and head size: model.n_heads, model.n_kv_heads, model.head_dim)"
    if "pos_encoding" in name or "patch" in name:
        return "and data geometry (image size, channels, context length)"
    return "(model.d_model, model.d_ff, model.n_layers)"


def _is_head(name: str, here: Tensor, there: Tensor) -> bool:
    """An output layer (``head``, DeiT's ``head_dist``) that differs in its number of outputs only."""
    return name.split(".")[0] in HEADS and here.ndim == there.ndim and here.shape[1:] == there.shape[1:]


def new_head_option(value: object) -> bool:
    """``init_new_head``: true or false, nothing else (a scratch run's head is new anyway)."""
    if not isinstance(value, bool):
        raise ConfigError(f"init_new_head must be true or false, got {value!r}: true initialises the classifier "
                          "head anew even when init_from's class count is the same")
    return value


def embeddings_only_option(value: object) -> bool:
    """``init_only``: null (every parameter that fits) or embeddings (the embedding tables alone)."""
    return choose({"null": False, "embeddings": True}, "null" if value is None else str(value), "init_only")


def _embedding_tables(target: dict[str, Tensor]) -> set[str]:
    """The token or patch embeddings (``embed``, ``src_embed``, ``patch_embed``...) and what is tied to
    them (an LM's output layer): what ``init_only=embeddings`` loads."""
    tables = {n for n in target if n.split(".")[0].endswith("embed")}
    storage = {target[n].data_ptr() for n in tables}
    return {n for n, t in target.items() if t.data_ptr() in storage}


def _classifier_head(target: dict[str, Tensor]) -> set[str]:
    """The ``head`` (and DeiT's ``head_dist``) tensors, when they are the network's own: an LM's output layer tied to
    its token table (tie_embeddings) is not, and cannot start anew alone."""
    heads = {n for n in target if n.split(".")[0] in HEADS}
    others = {t.data_ptr() for n, t in target.items() if n not in heads}
    return set() if any(target[n].data_ptr() in others for n in heads) else heads


def _heads_to_skip(target: dict[str, Tensor], source: str) -> set[str]:
    """What ``init_new_head=true`` leaves as initialised: the classifier head, which must exist."""
    head = _classifier_head(target)
    if not head:
        from trident.tasks.registry import TASKS  # here: every task's imports, for this error line only

        # The classifiers: the tasks whose network's own head (HEAD) trains anew.
        classifiers = ", ".join(f"task={name}" for name, task in TASKS.items() if "head." in task.HEAD)
        raise ConfigError(f"init_new_head=true, but this task's network has no head of its own (an LM's output layer "
                          f"is its token table): drop init_new_head, or fine-tune a classifier ({classifiers}) "
                          f"from init_from={source}")
    return head


def _resampled_positions(net: nn.Module, weights: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, str]]:
    """``weights`` with a ViT's position table of another square grid resampled to ``net``'s grid (timm's
    bicubic resampling; the class token's row kept), and the table's note; else ``weights`` as they are."""
    table, here, image = weights.get(POSITION_TABLE), net.state_dict().get(POSITION_TABLE), patch_grid(net)
    if image is None or table is None or here is None or table.shape == here.shape:
        return weights, {}
    grid, prefix = image
    side = math.isqrt(max(table.shape[0] - prefix, 0))
    if side * side != table.shape[0] - prefix or table.shape[1] != here.shape[1]:
        return weights, {}  # not a square grid of this width: refused as not fitting
    from trident.weights.adapters.timm_vit import resample_position_table  # imports timm: only here

    resampled = resample_position_table(table, grid, prefix)  # (prefix + h*w, D)
    return weights | {POSITION_TABLE: resampled}, {group_of(POSITION_TABLE): f"resampled {side}x{side} -> {grid[0]}x{grid[1]}"}


def transfer_weights(net: nn.Module, weights: dict[str, Tensor], source: str, new_head: bool = False,
                     notes: dict[str, str] | None = None, embeddings_only: bool = False) -> list[TransferRow]:
    """Load ``weights`` into ``net`` where name and shape match (the head too, unless ``new_head``; the
    embeddings alone if ``embeddings_only``); returns the table's rows, a loaded group's note from
    ``notes`` (e.g. a head count the file does not record)."""
    weights, resampled = _resampled_positions(net, weights)
    target = net.state_dict()
    held_back = (weights.keys() & target.keys()) - _embedding_tables(target) if embeddings_only else set()
    mismatched = {n: (tuple(weights[n].shape), tuple(t.shape)) for n, t in target.items()
                  if n in weights and n not in held_back and weights[n].shape != t.shape}
    for name, (there, here) in mismatched.items():
        if _is_token_table(name, target[name], weights[name]):
            raise ConfigError(
                f"init_from={source} has a vocabulary of {there[0]} tokens ({name}), this run's tokenizer {here[0]}: "
                "leave the data's tokenizer unset (the run then uses the tokenizer that came with the weights) or give it "
                "the tokenizer the weights were trained with"
            )
        if not _is_head(name, target[name], weights[name]):
            raise ConfigError(
                f"init_from={source} does not fit this model: {name} is {there} there, {here} here; use a source of "
                f"the same architecture {_what_shapes(name)}"
            )
    skipped = _heads_to_skip(target, source) - set(mismatched) if new_head else set()
    not_loaded = mismatched.keys() | skipped | held_back
    loaded = {n: w for n, w in weights.items() if n in target and n not in not_loaded}
    if not loaded:
        raise ConfigError(f"init_from={source} shares no parameter with this task's network (it names none of "
                          f"{', '.join(sorted({group_of(n) for n in target})[:4])}...): use weights of a task with this backbone")
    with torch.no_grad():
        for name, value in loaded.items():
            target[name].copy_(value)
    new_notes = {group_of(n): f"rebuilt: {mismatched[n][0][0]} outputs there, {mismatched[n][1][0]} here" for n in mismatched}
    new_notes |= {group_of(n): f"init_new_head=true: {target[n].shape[0]} outputs, initialised anew" for n in skipped}
    held_back_notes = {group_of(n): "init_only=embeddings: not loaded" for n in held_back}
    kept = {group_of(n): f"kept: {target[n].shape[0]} outputs there and here (init_new_head=true starts it anew)"
            for n in loaded.keys() & _classifier_head(target)}
    rows = _rows("loaded", {n: target[n] for n in loaded}, (notes or {}) | resampled | kept)
    rows += _rows("new", {n: t for n, t in target.items() if n not in loaded}, new_notes | held_back_notes)
    rows += _rows("dropped", {n: w for n, w in weights.items() if n not in target or n in held_back}, held_back_notes)
    return rows


def _rows(outcome: str, tensors: dict[str, Tensor], notes: dict[str, str]) -> list[TransferRow]:
    groups: dict[str, list[Tensor]] = defaultdict(list)
    for name, tensor in tensors.items():
        groups[group_of(name)].append(tensor)
    return [TransferRow(outcome, group, len(ts), sum(t.numel() for t in ts), notes.get(group, ""))
            for group, ts in groups.items()]


def report_transfer(rows: list[TransferRow], out: Path, loggers: list[Logger]) -> None:
    """Log the table (console, W&B table) and keep it with the run (``<run>/init/weights.csv``)."""
    header = ["outcome", "group", "tensors", "parameters", "note"]
    for logger in loggers:
        if isinstance(logger, WandbLogger):
            logger.log_text(key="init_from/weights", columns=header, data=[list(vars(r).values()) for r in rows], step=0)
    width = max(len(r.group) for r in rows)
    lines = [f"{'outcome':8} {'group':{width}} {'tensors':>7} {'parameters':>11}  note"]
    lines += [f"{r.outcome:8} {r.group:{width}} {r.tensors:>7} {r.parameters:>11,}  {r.note}" for r in rows]
    log.info("init_from: weights loaded, newly initialised and dropped\n%s", "\n".join(lines))
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(header)
        writer.writerows([r.outcome, r.group, r.tensors, r.parameters, r.note] for r in rows)
