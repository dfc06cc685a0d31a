"""A peft LoRA adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) read onto its base: the
Hugging Face directory its ``base_model_name_or_path`` names, with each adapter merged into the weight it adapts
(``W + scaling * B A``, as peft's ``merge_and_unload``), so ``init_from=<adapter>`` starts from the tuned model.

What a plain merge cannot express (DoRA, trained biases, per-module ranks or alphas) is one line naming the fix:
merge it with peft itself and pass the merged directory."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import Tensor

from trident.errors import DataError

PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", ("adapter_model.safetensors", "adapter_model.bin")
# peft's prefix of every saved tensor name (its PeftModel wraps the base model as base_model.model).
PEFT_PREFIX = "base_model.model."
MERGE_IT = ("merge it onto its base with peft (PeftModel.from_pretrained(base, adapter).merge_and_unload()"
            ".save_pretrained(<dir>)) and pass that directory")


def is_peft_adapter(path: Path) -> bool:
    """Whether ``path`` is a peft adapter directory (and not a model directory beside one)."""
    return path.is_dir() and (path / PEFT_CONFIG).is_file() and not (path / "config.json").is_file()


def peft_base(path: Path, source: str) -> Path:
    """The local base model directory the adapter's ``base_model_name_or_path`` names, or one line."""
    config = _config(path, source)
    base = config.get("base_model_name_or_path")
    if not base or not (Path(base) / "config.json").is_file():
        raise DataError(f"{source} is a peft adapter whose base ({base or 'unnamed'}) is not a local model directory: "
                        f"set base_model_name_or_path in its {PEFT_CONFIG} to the base's directory, or {MERGE_IT}")
    return Path(base)


def merge_peft(path: Path, state: dict[str, Tensor], source: str) -> dict[str, Tensor]:
    """``state`` (the base's tensors, Hugging Face names) with the adapter of ``path`` merged in: each
    ``<module>.lora_A/B.weight`` pair adds ``scaling * B A`` to ``<module>.weight``; any other tensor of the adapter
    (peft's ``modules_to_save``: a new head) replaces the base's."""
    config = _config(path, source)
    unsupported = [key for key in ("use_dora", "rank_pattern", "alpha_pattern") if config.get(key)]
    if config.get("bias", "none") != "none":
        unsupported.append(f"bias={config['bias']}")
    if config.get("peft_type", "LORA") != "LORA" or unsupported:
        raise DataError(f"{source} is a peft adapter with {', '.join(unsupported) or config.get('peft_type')}, which trident "
                        f"does not merge: {MERGE_IT}")
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    adapter = {name.removeprefix(PEFT_PREFIX): tensor for name, tensor in _adapter_weights(path, source).items()}
    merged = dict(state)
    for name, tensor in adapter.items():
        if ".lora_B." in name:
            continue
        if ".lora_A." not in name:  # modules_to_save: the tuned copy replaces the base's
            merged[_base_name(name.replace(".modules_to_save.default.", "."), state, source)] = tensor
            continue
        module = name.split(".lora_A.")[0]
        target = _base_name(f"{module}.weight", state, source)
        delta = scaling * adapter[name.replace(".lora_A.", ".lora_B.")].double() @ tensor.double()  # (out, in)
        weight = state[target]
        if config.get("fan_in_fan_out"):  # GPT-2's Conv1D stores (in, out)
            delta = delta.T
        merged[target] = (weight.double() + delta).to(weight.dtype)
    return merged


def _config(path: Path, source: str) -> dict[str, Any]:
    try:
        config = json.loads((path / PEFT_CONFIG).read_text())
    except (OSError, ValueError) as err:
        raise DataError(f"{source}/{PEFT_CONFIG} cannot be read ({type(err).__name__}): save the adapter again") from None
    if not isinstance(config, dict):
        raise DataError(f"{source}/{PEFT_CONFIG} is not a JSON object: save the adapter again")
    return config


def _adapter_weights(path: Path, source: str) -> dict[str, Tensor]:
    for name in PEFT_WEIGHTS:
        if (path / name).is_file():
            if name.endswith(".safetensors"):
                return load_file(str(path / name))
            return torch.load(path / name, map_location="cpu", weights_only=True)
    raise DataError(f"{source} is a peft adapter without weights: expected one of {', '.join(PEFT_WEIGHTS)}")


def _base_name(name: str, state: dict[str, Tensor], source: str) -> str:
    """The base's name of an adapted tensor (the base may be saved with or without the model's prefix)."""
    for candidate in (name, name.split(".", 1)[-1]):
        if candidate in state:
            return candidate
    raise DataError(f"{source} adapts {name}, which its base does not hold: pass the adapter of this base, or {MERGE_IT}")

