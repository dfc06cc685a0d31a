"""A peft LoRA adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) read onto its base: the
Hugging Face directory its ``base_model_name_or_path`` names, with each adapter merged into the weight it adapts
(``W + scaling * B A``, as peft's ``merge_and_unload``), so ``init_from=<adapter>`` starts from the tuned model.

Each adapter's rank is its ``lora_A``'s rows and its alpha ``alpha_pattern``'s where a pattern names the module (peft's
``rank_pattern`` / ``alpha_pattern``). What a plain merge cannot express (DoRA, trained biases, :data:`UNMERGED`) is one line naming the
fix: merge it with peft itself and pass the merged directory."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import Tensor

from trident.errors import DataError

PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", ("adapter_model.safetensors", "adapter_model.bin")
# peft's prefix of every saved tensor name (its PeftModel wraps the base model as base_model.model).
PEFT_PREFIX = "base_model.model."
# LoraConfig settings a plain W + scaling * B A does not express: DoRA's magnitudes, lora_B's biases, trainable token
# rows, layers copied, adapters on bare parameters, an adapter active only after its invocation tokens.
UNMERGED = ("use_dora", "lora_bias", "trainable_token_indices", "layer_replication", "target_parameters",
            "alora_invocation_tokens")
# The head a model with tie_word_embeddings saves no tensor of (Llama's, Qwen's, GPT-2's).
TIED_HEAD = "lm_head.weight"
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
    ``<module>.lora_A/B.weight`` pair adds ``scaling * B A`` to ``<module>.weight`` (an embedding's
    ``lora_embedding_A/B`` adds ``scaling * (B A)^T``); any other tensor of the adapter (peft's ``modules_to_save``: a
    new head; the ``base_layer`` peft saves of a targeted embedding or head) replaces the base's."""
    config = _config(path, source)
    unsupported = [key for key in UNMERGED if config.get(key)]
    if config.get("bias", "none") != "none":
        unsupported.append(f"bias={config['bias']}")
    if config.get("peft_type", "LORA") != "LORA" or unsupported:
        raise DataError(f"{source} is a peft adapter with {', '.join(unsupported) or config.get('peft_type')}, which trident "
                        f"does not merge: {MERGE_IT}")
    adapter = {name.removeprefix(PEFT_PREFIX): tensor for name, tensor in _adapter_weights(path, source).items()}
    downs = {name: tensor for name, tensor in adapter.items() if ".lora_A." in name or ".lora_embedding_A" in name}
    merged = dict(state)
    # modules_to_save and the base_layer of a targeted embedding or head replace the base's first: a LoRA then adds to them.
    for name, tensor in adapter.items():
        if name not in downs and ".lora_B." not in name and ".lora_embedding_B" not in name:
            base = name.replace(".modules_to_save.default.", ".").replace(".modules_to_save.", ".").replace(".base_layer.", ".")
            # A tied base saves no head: peft's own copy of it (modules_to_save) is then the head, untied (untie_tied_head).
            merged[base if base == TIED_HEAD else _base_name(base, state, source)] = tensor
    for name, down in downs.items():  # down: (rank, in)
        embedding = ".lora_embedding_A" in name
        module = name.split(".lora_embedding_A" if embedding else ".lora_A.")[0]
        target = _base_name(f"{module}.weight", state, source)
        up = adapter[name.replace("lora_embedding_A", "lora_embedding_B") if embedding else name.replace(".lora_A.", ".lora_B.")]
        delta = _scaling(config, module, down.shape[0]) * up.double() @ down.double()  # (out, in)
        if embedding or config.get("fan_in_fan_out"):  # an embedding (vocab, dim) and GPT-2's Conv1D store (in, out)
            delta = delta.T
        weight = merged[target]
        merged[target] = (weight.double() + delta).to(weight.dtype)
    return merged


def untie_tied_head(config: dict[str, Any], base: dict[str, Tensor], merged: dict[str, Tensor]) -> dict[str, Any]:
    """``config`` of the merged model: a head the adapter brings to a base that ties it to the embedding (and so saves
    none) is its own, as in peft's model (``tie_word_embeddings`` false)."""
    return config | {"tie_word_embeddings": False} if TIED_HEAD in merged and TIED_HEAD not in base else config


def _scaling(config: dict[str, Any], module: str, rank: int) -> float:
    """peft's ``scaling`` of one adapted module: its alpha (``alpha_pattern``'s first key that ends the module's name,
    as peft's ``get_pattern_key`` matches, else ``lora_alpha``) over its rank (``rank_pattern``'s, which is its
    ``lora_A``'s rows), or over the rank's square root with rsLoRA."""
    patterns = config.get("alpha_pattern") or {}
    key = next((key for key in patterns if re.match(rf"(.*\.)?({key})$", module)), None)
    alpha = float(patterns[key] if key is not None else config["lora_alpha"])
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


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

