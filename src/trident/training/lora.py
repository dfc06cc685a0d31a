"""``finetune=lora``: the settings check, the frozen base, what trains, and the adapter as a run's artifact.

Under LoRA the base network is frozen; the adapters (:mod:`trident.backbone.lora`) and the task's
head (``TridentTask.HEAD``: the classifier a fine-tuning adds, peft's ``modules_to_save``) train.
A run writes ``<run>/adapter/adapter.safetensors`` (those trainable tensors alone) and ``adapter.json``
(the base it adapts and the LoRA settings), which ``init_from=<base> finetune=lora
finetune.adapter=<run>`` puts back on the base.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from trident.backbone import TransformerConfig
from trident.backbone.lora import LORA_TARGETS
from trident.errors import ConfigError, DataError, is_int, is_number
from trident.weights.checkpoints import read_checkpoint

FINETUNE_MODES = ("full", "lora")
#: The keys of ``finetune=lora`` that build the adapters (the task's ``lora`` hyperparameter).
LORA_KEYS = ("rank", "alpha", "dropout", "targets")
ADAPTER_DIR, ADAPTER_WEIGHTS, ADAPTER_CONFIG = "adapter", "adapter.safetensors", "adapter.json"


def lora_settings(cfg: DictConfig, backbone: TransformerConfig) -> dict[str, Any] | None:
    """The ``finetune`` group checked against ``backbone``: the adapters' settings, or None for full fine-tuning."""
    finetune: dict[str, Any] = OmegaConf.to_container(cfg.get("finetune") or {"name": "full"}, resolve=True)  # type: ignore[assignment]
    mode = finetune.get("name")
    if mode not in FINETUNE_MODES:
        raise ConfigError(f"finetune={mode} is not a fine-tuning mode: choose one of {', '.join(FINETUNE_MODES)}")
    if mode == "full":
        return None
    if not cfg.get("init_from"):
        raise ConfigError("finetune=lora adapts a trained model and none is given: add init_from=<a run, checkpoint or "
                          "Hugging Face directory> (or use finetune=full to train from scratch)")
    settings = {key: finetune.get(key) for key in LORA_KEYS}
    targets = settings["targets"]
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise ConfigError(f"finetune.targets must be a list of parts, got {targets!r}: set e.g. finetune.targets=[q,v] "
                          f"(parts: {', '.join(LORA_TARGETS)})")
    unknown = [t for t in targets if t not in LORA_TARGETS]
    if unknown:
        raise ConfigError(f"finetune.targets names {', '.join(unknown)}, which the model does not have: choose among "
                          f"{', '.join(LORA_TARGETS)} (attention query, key, value, output; the feed-forward layers)")
    width = min(_widths(backbone)[t] for t in targets)
    rank = settings["rank"]
    if not is_int(rank) or not 0 < rank <= width:
        raise ConfigError(f"finetune.rank must be an integer from 1 to {width} (the narrowest targeted layer), "
                          f"got {rank!r}: set e.g. finetune.rank=8")
    if not is_number(settings["alpha"]) or settings["alpha"] <= 0:
        raise ConfigError(f"finetune.alpha must be a positive number, got {settings['alpha']!r}: set e.g. finetune.alpha=16")
    if not is_number(settings["dropout"]) or not 0 <= settings["dropout"] < 1:
        raise ConfigError(f"finetune.dropout must be in [0, 1), got {settings['dropout']!r}: set e.g. finetune.dropout=0.05")
    return settings


def _widths(cfg: TransformerConfig) -> dict[str, int]:
    """The smaller side of each targeted part's weight (a rank above it adds nothing)."""
    q_rows, kv_rows = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return {"q": min(cfg.d_model, q_rows), "k": min(cfg.d_model, kv_rows), "v": min(cfg.d_model, kv_rows),
            "o": min(cfg.d_model, q_rows), "mlp": min(cfg.d_model, cfg.d_ff)}


def trainable_parameters(net: nn.Module) -> dict[str, float]:
    """What trains, for the log and the W&B run: the count, the total, the share."""
    params = list(net.parameters())  # shared (tied) tensors once
    trainable = sum(p.numel() for p in params if p.requires_grad)
    total = sum(p.numel() for p in params)
    return {"params/trainable": trainable, "params/total": total, "params/trainable_share": trainable / total}


def save_adapter(net: nn.Module, run_dir: Path, base: str, settings: dict[str, Any], best: str | None) -> Path:
    """Write the trainable tensors of ``net`` (adapters, head) and what they adapt to ``<run_dir>/adapter``:
    those of the ``best`` checkpoint when there is one (the weights ``trident.load(run)`` gives), else ``net``'s."""
    directory = run_dir / ADAPTER_DIR
    directory.mkdir(parents=True, exist_ok=True)
    trainable = {name for name, p in net.named_parameters() if p.requires_grad}
    weights = (net.state_dict() if best is None else
               {k.removeprefix("net."): v for k, v in read_checkpoint(Path(best), "the best checkpoint")["state_dict"].items()})
    save_file({n: t.detach().contiguous() for n, t in weights.items() if n in trainable}, str(directory / ADAPTER_WEIGHTS))
    (directory / ADAPTER_CONFIG).write_text(json.dumps({"base": base, "lora": settings}, indent=2) + "\n")
    return directory


def load_adapter(net: nn.Module, source: str, settings: dict[str, Any]) -> None:
    """Put the adapter of ``source`` (a LoRA run or its ``adapter`` directory) on ``net``, which has the
    adapters of ``settings``; a missing adapter, other settings or other shapes is one error line."""
    path = Path(source)
    directory = path / ADAPTER_DIR if (path / ADAPTER_DIR).is_dir() else path
    if not (directory / ADAPTER_WEIGHTS).is_file() or not (directory / ADAPTER_CONFIG).is_file():
        raise DataError(f"finetune.adapter={source} holds no {ADAPTER_WEIGHTS} and {ADAPTER_CONFIG}: pass a "
                        f"finetune=lora run directory or its {ADAPTER_DIR}/ directory")
    saved = json.loads((directory / ADAPTER_CONFIG).read_text())["lora"]
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
