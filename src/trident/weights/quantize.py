"""trident-quantize's weights: a run's checkpoint -> a checkpoint of the same task whose block linears are int8 or int4
(trident.converters.weight_only: which layers, torchao's schemes, the record), which every reader of a trident
checkpoint loads (``trident.load``, trident-sample, trident-chat, trident-harness, eval.py), and the bytes of the
network's tensors before and after, measured from the tensors.

The quantized checkpoint holds the task's settings, tokenizer and weights and no training state (optimizer,
schedulers, loops, callbacks): it is a model to use, not a run to resume. A converted run (``finetune=lora``) is
quantized with its converters folded in: the file holds every weight and records no converter.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

from trident.converters import CONVERTERS
from trident.converters.weight_only import (
    QUANTIZED_KEY,
    check_group_size,
    quantize_layers,
    quantized_layers,
    refuse_quantized,
    require_torchao,
    scheme,
    stored_layers,
    tensor_bytes,
)
from trident.errors import DataError

# What a run's checkpoint holds to train on, which the quantized model leaves behind (callbacks=ema's raw weights,
# current_model_state, included: the state dict holds the average, which is quantized); and a finetune=lora
# checkpoint's record of the base it leaves out (the quantized file holds every weight).
_TRAINING_STATE = ("optimizer_states", "lr_schedulers", "loops", "callbacks", "current_model_state",
                   "trident_frozen_base")


@dataclass
class QuantizedCheckpoint:
    """What trident-quantize wrote: where, from which checkpoint, how, which layers, and the bytes of the network's
    tensors (``before``: as trained; ``after``: as torchao holds them in memory; ``stored``: in the file, int4 packed
    two a byte; ``layers_before``/``layers_after``: the quantized layers' weights alone)."""

    path: Path
    source: Path
    bits: int
    group_size: int | None
    layers: list[str]
    bytes: dict[str, int]

    def record(self) -> dict[str, Any]:
        """The plain values of the report's JSON."""
        return {"quantized": str(self.path), "source": str(self.source), "bits": self.bits,
                "group_size": self.group_size, "scheme": scheme(self.bits, self.group_size), "layers": self.layers,
                "bytes": self.bytes}


def quantize_checkpoint(source: Path, out: Path, bits: int, group_size: int | None) -> QuantizedCheckpoint:
    """Quantize the block linears of the task in ``source`` (a checkpoint file) and write the quantized checkpoint
    to ``out`` (a file), atomically."""
    require_torchao()
    from trident.tasks.frozen_base import NET
    from trident.tasks.networks import merge_converters
    from trident.weights.checkpoint_files import read_checkpoint
    from trident.weights.checkpoints import AtomicCheckpointIO
    from trident.weights.load import load

    checkpoint = read_checkpoint(source, "the run argument", weights=False)
    refuse_quantized(checkpoint, source, "is quantized already")
    task = load(source)
    merge_converters(task)  # a LoRA run's adapters folded into the weights they adapt
    net = task.net
    layers = quantized_layers(net)
    if not layers:
        raise DataError(f"checkpoint {str(source)!r} holds a network without Transformer blocks: trident-quantize "
                        "quantizes the linears of a run's blocks")
    check_group_size(net, layers, bits, group_size)
    sizes = {"before": tensor_bytes(net.state_dict().values()),
             "layers_before": tensor_bytes(net.get_submodule(name).weight for name in layers)}
    quantize_layers(net, layers, bits, group_size)
    stored = stored_layers(net, layers, bits)
    sizes["after"] = tensor_bytes(net.state_dict().values())
    sizes["layers_after"] = tensor_bytes(net.get_submodule(name).weight for name in layers)
    sizes["stored"] = (sizes["after"] - sizes["layers_after"]
                       + tensor_bytes(part for parts in stored.values() for part in parts.values()))
    kept = {f"{NET}{name}.weight" for name in layers}
    written = {key: value for key, value in checkpoint.items() if key not in _TRAINING_STATE}
    written["state_dict"] = {key: value for key, value in task.state_dict().items() if key not in kept}
    # Folded in above: the checkpoint records no converter, or reading it would convert the network again.
    written["hyper_parameters"] = {key: None if key in CONVERTERS else value
                                   for key, value in (checkpoint.get("hyper_parameters") or {}).items()}
    written[QUANTIZED_KEY] = {"bits": bits, "group_size": group_size, "source": str(source),
                              "torchao": version("torchao"), "layers": stored}
    AtomicCheckpointIO().save_checkpoint(written, out)
    return QuantizedCheckpoint(out, source, bits, group_size, layers, sizes)
