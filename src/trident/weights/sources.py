"""The sources ``init_from=`` reads, as weights: a trident checkpoint or run directory, the copy of a source inside a
run (``<run>/init``), a Hugging Face model directory (a peft adapter on one), a timm ViT file or an open_clip
directory; and where a ``finetune=lora`` checkpoint's frozen base is found again (:func:`find_base`). What a source
fixes in a run's config is trident.weights.init_from's business; this module reads (no config library:
``trident.load`` and the commands that do not train import it).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from torch import Tensor

from trident.backbone import pos_encoding_class
from trident.converters import converters_of
from trident.converters.weight_only import refuse_quantized
from trident.errors import DataError
from trident.parallel.distributed_checkpoint import holds_shards
from trident.tasks.frozen_base import FrozenBase
from trident.tasks.networks import merge_converters
from trident.weights.adapters.normalisation import with_outside_statistics
from trident.weights.checkpoint_files import checkpoint_of, read_checkpoint
from trident.weights.frozen_base import BASE_VARIABLE, base_difference
from trident.weights.pretrained import PretrainedWeights

# Backbone settings a fine-tuning run chooses for itself: they do not change what the weights compute.
TRAINING_SETTINGS = ("dropout", "attn_dropout", "attn_impl", "sdpa_backend", "activation_checkpointing", "drop_path")
# TransformerConfig fields that come from the pos_encoding group and the data, not from the model group.
DERIVED_SETTINGS = ("pos_encoding", "pos_encoding_options", "max_seq_len", "grid", "num_prefix_tokens")
# The copy of the source inside the run directory: the run stays self-contained.
COPY_DIR = "init"

def read_init_source(path: str, n_heads: int | None = None, setting: str = "init_from") -> PretrainedWeights:
    """The source ``init_from=path`` names: a trident checkpoint, a run directory, or the copy of a
    source inside a run (``<run>/init``). ``n_heads`` (``model.n_heads=``) states the head count of a
    timm file, which does not record it. ``setting``: the setting that names it, as error lines say
    (``distill.teacher`` reads its teacher here too)."""
    location = Path(path)
    if not location.exists():
        raise DataError(f"{setting}={path} not found: pass a trident checkpoint (.ckpt), a train.py run directory, "
                        "a Hugging Face model directory, a timm ViT file or an open_clip directory")
    if (location / "source.json").is_file():
        return read_source_copy(location)
    # A Hugging Face directory, a peft adapter on one (adapter_config.json) or a timm file.
    if any((location / name).is_file() for name in ("config.json", "adapter_config.json")) or (
            location.is_file() and location.suffix != ".ckpt"):
        return _from_outside(path, n_heads)
    if (location.is_dir() and not holds_shards(location) and not any(location.glob("checkpoints/*.ckpt"))
            and not any(location.glob("*.ckpt"))):
        from trident.weights.adapters.registry import file_adapter_for  # here: only a directory of no trident run

        if file_adapter_for(location) is not None:  # a format its files name (open_clip's directory)
            return _from_outside(path, n_heads)
        raise DataError(f"{setting}={path} is a directory that holds no model: pass a trident checkpoint or run "
                        "directory (checkpoints/*.ckpt), or a Hugging Face model directory (config.json + weights)")
    return _from_trident_checkpoint(path, checkpoint_of(location), setting)


def _from_trident_checkpoint(path: str, checkpoint_path: Path, setting: str) -> PretrainedWeights:
    # The task's side (Lightning): a trident checkpoint source only; a LoRA run's own copy of its source, which its
    # readers find first (find_base), is read without it.
    from trident.weights.checkpoints import load_task_checkpoint
    from trident.weights.task_class import task_class_of

    checkpoint = read_checkpoint(checkpoint_path, setting)
    # A quantized model's int8/int4 layers serve evaluation (trident.load): a run starts from, or distils from, floats.
    refuse_quantized(checkpoint, checkpoint_path, f"{setting} reads float weights")
    task_class = task_class_of(checkpoint, checkpoint_path)
    settings: dict[str, Any] = dict(checkpoint.get("hyper_parameters") or {})
    backbone = dict(settings.get("backbone") or {})
    if not backbone:
        raise DataError(f"{setting}={path}: {str(checkpoint_path)!r} holds no backbone settings: it was not written by train.py")
    model = {k: v for k, v in backbone.items() if k not in TRAINING_SETTINGS and k not in DERIVED_SETTINGS}
    # What the weights' own task says they were built with (TridentTask.SOURCE_SETTINGS, SOURCE_DATA_SETTINGS).
    task_options, data_options = task_class.stated_as_source(settings)
    # A bounded position table (learned) has one row per position: its length is part of the weights.
    if backbone.get("grid") is None and pos_encoding_class(backbone["pos_encoding"]).bounded_length:
        data_options["max_seq_len"] = backbone["max_seq_len"]
    tokenizer_json = checkpoint.get("tokenizer_json")
    state_dict = {k.removeprefix("net."): v for k, v in checkpoint["state_dict"].items() if k.startswith("net.")}
    if converters_of(settings):  # a converted run (finetune=lora) hands on its weights with its converters folded in
        task = load_task_checkpoint(task_class, checkpoint_path, find_base)
        merge_converters(task)
        state_dict = task.net.state_dict()
    return PretrainedWeights(
        source=str(path), format="trident", task=task_class.NAME, model=model,
        pos_encoding=backbone["pos_encoding"], pos_encoding_options=dict(backbone.get("pos_encoding_options") or {}),
        task_options=task_options, data_options=data_options,
        state_dict=state_dict,
        tokenizer=Tokenizer.from_str(tokenizer_json) if tokenizer_json else None,
        tokenizer_settings=dict(checkpoint.get("tokenizer_settings") or {}),
    )


def _from_outside(path: str, n_heads: int | None) -> PretrainedWeights:
    """A Hugging Face model directory or a timm ViT file, read by :mod:`trident.weights.adapters`."""
    # Imported here: safetensors and the adapters load only when a source needs them.
    from trident.weights.adapters.outside_network import as_source
    from trident.weights.adapters.reading import read_network

    return as_source(with_outside_statistics(read_network(path, n_heads=n_heads), Path(path)))


def read_source_copy(folder: Path, weights: bool = True) -> PretrainedWeights:
    """A source as :func:`copy_source` left it in a run directory (``weights=False``: its record and tokenizer alone,
    the state dict empty)."""
    # A record states every field its version had: one an earlier version named otherwise (the head's rows) is dropped,
    # read by nothing after the source's settings were fixed.
    fields = {f.name for f in dataclasses.fields(PretrainedWeights)}
    described = {k: v for k, v in json.loads((folder / "source.json").read_text()).items() if k in fields}
    tokenizer = folder / "tokenizer.json"
    return PretrainedWeights(
        **described,
        state_dict=torch.load(folder / "weights.pt", map_location="cpu", weights_only=True) if weights else {},
        tokenizer=Tokenizer.from_file(str(tokenizer)) if tokenizer.is_file() else None,
    )



def find_base(wanted: FrozenBase, checkpoint: Path | None, n_heads: int | None = None) -> dict[str, Tensor]:
    """The base's tensors from the run's copy of its source beside ``checkpoint``, else ``$TRIDENT_BASE`` when set,
    else the recorded ``init_from``: the first that exists and holds the recorded fingerprint; else one error line.
    ``n_heads``: the head count of the network, for a source that does not record it (a timm file)."""
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
            differs = base_difference(wanted, weights, str(candidate))
            if differs is None:
                return weights
    raise DataError(f"{where} holds a finetune={wanted.finetune} run's adapters without the frozen base they adapt, "
                    f"{shown} ({len(wanted.names)} tensors), and {differs}: {fix}")
