"""A ``finetune=lora`` run's adapter as an artifact: ``<run>/adapter/adapter.safetensors`` (the tensors that
trained: adapters and a new head, kilobytes to a few MB) and ``adapter.json`` (the base it adapts: the
``init_from`` path made absolute, or the name as given, and the LoRA settings).
``init_from=<base> finetune=lora finetune.adapter=<run>`` puts it back on that base, and on no other."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from trident.converters import LORA_KEYS
from trident.errors import ConfigError, DataError
from trident.weights.checkpoint_files import read_checkpoint

ADAPTER_DIR, ADAPTER_WEIGHTS, ADAPTER_CONFIG = "adapter", "adapter.safetensors", "adapter.json"


def base_of(init_from: str) -> str:
    """How ``adapter.json`` names the base: an existing path absolute (the same base from another working
    directory), anything else (a registry name) as given."""
    path = Path(init_from)
    return str(path.resolve()) if path.exists() else init_from


def save_adapter(net: nn.Module, run_dir: Path, base: str, settings: dict[str, Any], best: str | None) -> Path:
    """Write the trainable tensors of ``net`` (adapters, head) and what they adapt to ``<run_dir>/adapter``:
    those of the ``best`` checkpoint when there is one (the weights ``trident.load(run)`` gives), else ``net``'s."""
    directory = run_dir / ADAPTER_DIR
    directory.mkdir(parents=True, exist_ok=True)
    trainable = {name for name, p in net.named_parameters() if p.requires_grad}
    weights = (net.state_dict() if best is None else
               {k.removeprefix("net."): v for k, v in read_checkpoint(Path(best), "the best checkpoint")["state_dict"].items()})
    save_file({n: t.detach().contiguous() for n, t in weights.items() if n in trainable}, str(directory / ADAPTER_WEIGHTS))
    (directory / ADAPTER_CONFIG).write_text(json.dumps({"base": base_of(base), "lora": settings}, indent=2) + "\n")
    return directory


def load_adapter(net: nn.Module, source: str, settings: dict[str, Any], base: str) -> None:
    """Put the adapter of ``source`` (a LoRA run or its ``adapter`` directory) on ``net``, which has the
    adapters of ``settings`` on the weights of ``base`` (``init_from``); a missing adapter, another base,
    other settings or other shapes is one error line."""
    path = Path(source)
    directory = path / ADAPTER_DIR if (path / ADAPTER_DIR).is_dir() else path
    if (directory / "adapter_config.json").is_file():  # peft's: it holds the tuned model's difference, not trident's
        raise DataError(f"finetune.adapter={source} is a peft adapter: pass it as init_from={source} (trident merges it "
                        "onto the base its adapter_config.json names) and leave finetune.adapter unset")
    if not (directory / ADAPTER_WEIGHTS).is_file() or not (directory / ADAPTER_CONFIG).is_file():
        raise DataError(f"finetune.adapter={source} holds no {ADAPTER_WEIGHTS} and {ADAPTER_CONFIG}: pass a "
                        f"finetune=lora run directory or its {ADAPTER_DIR}/ directory")
    described = json.loads((directory / ADAPTER_CONFIG).read_text())
    if described["base"] != base_of(base):
        raise ConfigError(f"finetune.adapter={source} adapts init_from={described['base']}, not init_from={base}: set "
                          f"init_from={described['base']} (an adapter is only valid on the weights it was trained on)")
    saved = described["lora"]
    if saved != settings:
        differ = ", ".join(f"finetune.{k}={saved[k]}" for k in LORA_KEYS if saved.get(k) != settings.get(k))
        raise ConfigError(f"finetune.adapter={source} was trained with {differ}: set {differ} to rebuild it")
    try:
        weights = load_file(str(directory / ADAPTER_WEIGHTS))
    except (SafetensorError, OSError) as err:
        raise DataError(f"finetune.adapter={source}: {ADAPTER_WEIGHTS} cannot be read ({err}): pass another adapter") from err
    target = net.state_dict()
    wrong = [n for n, t in weights.items() if n not in target or target[n].shape != t.shape]
    if wrong:
        raise DataError(f"finetune.adapter={source} does not fit this model ({wrong[0]}): pass the adapter of a run "
                        "of this task on this base")
    net.load_state_dict(weights, strict=False)


class AdapterFiles:
    """The LoRA converter's artifact files (trident.converters.ArtifactFiles): written after a run, read back by
    ``finetune.adapter``."""

    save = staticmethod(save_adapter)
    load = staticmethod(load_adapter)
