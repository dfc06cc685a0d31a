"""``load_network(path)``: the network a trident checkpoint or run directory trained, without its task, for the
commands that need the network alone (``trident-export --format hf``, ``trident-sample``, ``trident-chat``): they
then start without Lightning (and torchmetrics, which imports transformers and matplotlib).

The network is rebuilt as its task's constructor builds it (trident.tasks.network_builders), converted as the
task's lifecycle converts it (the converters its hyperparameters record, e.g. ``lora=``; not merged), and given the
checkpoint's weights, a ``finetune=lora`` run's frozen base put back from where it is found
(trident.weights.sources.find_base). A checkpoint whose task has no builder, or of an earlier version whose
hyperparameters lack a setting the builder reads, is read as its task (:func:`trident.load`), which gives the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer
from torch import nn

from trident.converters import Converter, converters_of
from trident.converters.weight_only import refuse_quantized
from trident.errors import DataError
from trident.tasks.frozen_base import FROZEN_BASE_KEY, NET, reading, refill_base
from trident.tasks.network_builders import build_from_settings, build_others_from_settings
from trident.tasks.networks import convert_network, merge_network
from trident.tasks.task_in_checkpoint import TASK_KEY
from trident.weights.checkpoint_files import checkpoint_of, read_checkpoint

if TYPE_CHECKING:
    from trident.tasks.base import TridentTask


@dataclass
class TrainedNetwork:
    """A task's ``net`` as its checkpoint holds it (CPU, eval mode, its converters applied and not merged), with
    what the commands read beside it: the task's hyperparameters, its tokenizer and the tokenizer's settings (an
    init_from source's chat template and special tokens)."""

    net: nn.Module
    settings: dict[str, Any]
    tokenizer: Tokenizer | None
    tokenizer_settings: dict[str, str] = field(default_factory=dict)
    converters: list[Converter] = field(default_factory=list)
    #: The task's other trained networks, which the hf export writes beside ``net`` (task=electra's generator).
    others: dict[str, nn.Module] = field(default_factory=dict)

    def merge_converters(self) -> None:
        """Fold the converters into the network's plain layers (an export writes the base's layout)."""
        merge_network(self.net, self.converters)
        self.converters = []


def load_network(path: Path) -> TrainedNetwork:
    """The network of the checkpoint (or run directory: its best, else last checkpoint) at ``path``."""
    checkpoint_path = checkpoint_of(Path(path))
    checkpoint = read_checkpoint(checkpoint_path, "the checkpoint argument")
    refuse_quantized(checkpoint, checkpoint_path, "an export writes float weights")
    settings = dict(checkpoint.get("hyper_parameters") or {})
    net = build_from_settings(checkpoint.get(TASK_KEY), settings)
    if net is None:
        return _as_task(checkpoint_path)
    converters = converters_of(settings)
    convert_network(net, converters)
    if FROZEN_BASE_KEY in checkpoint:  # a finetune=lora checkpoint leaves its frozen base out: found again
        from trident.weights.sources import find_base  # reads init_from sources: only for such a checkpoint

        with reading(checkpoint_path, find_base):
            refill_base(checkpoint, net, None, checkpoint_path, int(settings["backbone"]["n_heads"]))
    weights = {name.removeprefix(NET): tensor for name, tensor in checkpoint["state_dict"].items()
               if name.startswith(NET)}
    missing, unexpected = net.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise DataError(f"checkpoint {str(checkpoint_path)!r} does not hold the network its settings build "
                        f"({(missing or unexpected)[0]}): pass a checkpoint written by train.py")
    others = build_others_from_settings(checkpoint.get(TASK_KEY), settings)
    for name, other in others.items():
        prefix = f"{name}."
        other.load_state_dict({key.removeprefix(prefix): tensor for key, tensor in checkpoint["state_dict"].items()
                               if key.startswith(prefix)}, strict=True)
        other.eval()
    tokenizer_json = checkpoint.get("tokenizer_json")
    return TrainedNetwork(net.eval(), settings, Tokenizer.from_str(tokenizer_json) if tokenizer_json else None,
                          dict(checkpoint.get("tokenizer_settings") or {}), converters, others)


def network_of(task: TridentTask) -> TrainedNetwork:
    """The ``net`` of a task already built (the same module, not a copy) with what the commands read beside it."""
    others = {name: network for name, network in task.networks().items() if name != "net"}
    return TrainedNetwork(task.net, dict(task.hparams), task.tokenizer, dict(task.tokenizer_settings),
                          list(task.converters), others)


def _as_task(checkpoint: Path) -> TrainedNetwork:
    from trident.weights.load import load

    return network_of(load(checkpoint))
