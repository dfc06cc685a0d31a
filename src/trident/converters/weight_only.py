"""Weight-only post-training quantization (``trident-quantize``): the linears of a network's Transformer blocks in int8
or int4 by torchao, and a quantized checkpoint's record of them put back onto a network built from its settings.

**Which layers**: every ``nn.Linear`` inside a :class:`~trident.backbone.TransformerBlock` (the attention
projections and the feed-forward), which hold nearly all of a model's weights but its vocabulary. The rest keeps the
checkpoint's precision: the embeddings, the output head (the layer rounding hurts most, which llama.cpp's
quantizations keep wider too, and tied to the token embedding in trident's LMs), a pooler, a projection or a patch
embedding outside the blocks, every bias and norm.

**Schemes** (torchao 0.18, on the CPU): int8: ``Int8WeightOnlyConfig``: symmetric, a scale per row (per group of
``group_size`` inputs when given). int4: ``IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(g))``:
symmetric, a scale per group of ``g`` inputs (32 by default). torchao's ``Int4WeightOnlyConfig`` packs for CUDA
kernels only (tinygemm, mslk: "Requires mslk >= 1.0.0" on a CPU), and the CPU's int4 tensor holds each value in an
int8: in memory int4 takes more bytes than int8 (a byte a value as int8, plus a scale and zero point a group); in
the checkpoint it is packed two a byte.

**In a checkpoint** (:data:`QUANTIZED_KEY`): each layer's quantized tensors under torchao's names (``qdata``,
``scale``, ``zero_point``), as plain tensors, so the file reads with ``torch.load(weights_only=True)`` without
torchao (its task and settings are read before the weights); those layers' weights are left out of the state dict
and rebuilt by :func:`restore_quantized` when the checkpoint is read (before its state dict loads).
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from trident.backbone import TransformerBlock
from trident.errors import ConfigError, DataError
from trident.extras import MissingExtra

if TYPE_CHECKING:
    from torchao.core.config import AOBaseConfig

#: The checkpoint key of a quantized checkpoint's record (bits, group size, source, each layer's tensors).
QUANTIZED_KEY = "trident_quantized"
#: The widths trident-quantize writes, and each one's group size when none is given (None: one scale a row).
DEFAULT_GROUP_SIZE: dict[int, int | None] = {8: None, 4: 32}
# int4's symmetric range is [-8, 7]: stored shifted by 8 into a nibble.
_INT4_OFFSET = 8


def require_torchao() -> None:
    """One line naming the ``[quant]`` extra when torchao is not installed."""
    if importlib.util.find_spec("torchao") is None:
        raise MissingExtra("weight-only quantization (trident-quantize, and reading a model it wrote)", "quant")


def torchao_config(bits: int, group_size: int | None) -> AOBaseConfig:
    """torchao's weight-only config for ``bits`` (8 or 4) with a scale per ``group_size`` inputs (None: per row)."""
    require_torchao()
    from torchao.quantization import Int8WeightOnlyConfig, IntxWeightOnlyConfig
    from torchao.quantization.granularity import PerGroup, PerRow

    if bits == 8:
        return Int8WeightOnlyConfig(granularity=PerRow() if group_size is None else PerGroup(group_size))
    assert group_size is not None  # int4 is grouped: DEFAULT_GROUP_SIZE
    return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(group_size))


def scheme(bits: int, group_size: int | None) -> str:
    """The scheme in words, for the table and the record: ``int8, a scale per row``."""
    return f"int{bits} weight-only, symmetric, a scale per " + ("row" if group_size is None else f"{group_size} inputs")


def quantized_layers(net: nn.Module) -> list[str]:
    """The names of the linears of ``net``'s Transformer blocks, in module order (a shared module once)."""
    blocks = [name for name, module in net.named_modules() if isinstance(module, TransformerBlock)]
    return [name for name, module in net.named_modules()
            if isinstance(module, nn.Linear) and any(name.startswith(block + ".") for block in blocks)]


def check_group_size(net: nn.Module, layers: list[str], bits: int, group_size: int | None) -> None:
    """One line when ``group_size`` does not divide a layer's inputs (torchao's int4 would skip the layer silently)."""
    if group_size is None:
        return
    widths = {name: net.get_submodule(name).in_features for name in layers}
    uneven = next((name for name, width in widths.items() if width % group_size), None)
    if uneven is not None:
        fits = math.gcd(*widths.values(), 32)  # a common group size that divides every layer
        raise ConfigError(f"--group-size {group_size} does not divide the {widths[uneven]} inputs of {uneven}: int{bits} "
                          f"groups split each row of a layer evenly; pass a group size dividing every block linear's "
                          f"inputs (e.g. --group-size {fits})")


def quantize_layers(net: nn.Module, layers: Iterable[str], bits: int, group_size: int | None) -> None:
    """Quantize each of ``layers`` of ``net`` in place with torchao (its weight becomes torchao's tensor)."""
    from torchao.quantization import quantize_

    config = torchao_config(bits, group_size)
    for name in layers:
        quantize_(net.get_submodule(name), config)


def stored_layers(net: nn.Module, layers: Iterable[str], bits: int) -> dict[str, dict[str, Tensor]]:
    """Each quantized layer's tensors as a checkpoint holds them: torchao's inner tensors by name, int4 values packed."""
    stored = {}
    for name in layers:
        weight = net.get_submodule(name).weight
        inner, _ = weight.__tensor_flatten__()
        stored[name] = {part: _pack(getattr(weight, part)) if _packed(bits, part) else getattr(weight, part).clone()
                        for part in inner}
    return stored


def restore_quantized(checkpoint: dict[str, Any], net: nn.Module, prefix: str) -> None:
    """A quantized checkpoint's layers rebuilt as torchao tensors on ``net`` (built from the checkpoint's settings)
    and put into its state dict under ``prefix`` (``net.``), before the state dict is loaded; nothing otherwise."""
    record = checkpoint.get(QUANTIZED_KEY)
    if record is None:
        return
    require_torchao()
    bits, group_size = int(record["bits"]), record["group_size"]
    config_layers = [name for name in record["layers"] if not _is_quantized(net.get_submodule(name).weight)]
    # torchao quantizes each layer once (its tensor's type and settings); the stored values replace its own.
    quantize_layers(net, config_layers, bits, group_size)
    for name, stored in record["layers"].items():
        template = net.get_submodule(name).weight
        inner, context = template.__tensor_flatten__()
        parts = {}
        for part in inner:
            expected = getattr(template, part)
            value = stored.get(part)
            if value is not None and _packed(bits, part) and value.numel() == (expected.numel() + 1) // 2:
                value = _unpack(value, expected.shape)  # else its packed shape is named below
            if value is None or value.shape != expected.shape or value.dtype != expected.dtype:
                held = "nothing" if value is None else f"{tuple(value.shape)} {value.dtype}"
                raise DataError(f"the quantized checkpoint holds {held} as {name}.{part}, where this torchao makes "
                                f"{tuple(expected.shape)} {expected.dtype} (it was written with torchao "
                                f"{record.get('torchao')}): quantize the run again with this one")
            parts[part] = value
        checkpoint["state_dict"][f"{prefix}{name}.weight"] = type(template).__tensor_unflatten__(
            parts, context, template.shape, template.stride())


def refuse_quantized(checkpoint: dict[str, Any], path: Path, reason: str) -> None:
    """One line when ``checkpoint`` is trident-quantize's, for a reader that needs float weights (``reason``)."""
    record = checkpoint.get(QUANTIZED_KEY)
    if record is not None:
        raise DataError(f"checkpoint {str(path)!r} holds int{record['bits']} weights written by trident-quantize and "
                        f"{reason}: use the checkpoint it was quantized from, {record['source']}")


def left_out(checkpoint: dict[str, Any], prefix: str) -> set[str]:
    """The state-dict keys a quantized checkpoint holds in its record instead (none for another checkpoint)."""
    record = checkpoint.get(QUANTIZED_KEY) or {}
    return {f"{prefix}{name}.weight" for name in record.get("layers", {})}


def tensor_bytes(tensors: Iterable[Tensor]) -> int:
    """The bytes of ``tensors`` as they are held: a torchao tensor's inner tensors, a tensor that several names
    share (a tied head) once."""
    seen: set[int] = set()
    total = 0
    for tensor in tensors:
        if _is_quantized(tensor):
            inner, _ = tensor.__tensor_flatten__()
            total += tensor_bytes(getattr(tensor, part) for part in inner)
        elif tensor.untyped_storage().data_ptr() not in seen or tensor.numel() == 0:
            seen.add(tensor.untyped_storage().data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total


def _is_quantized(tensor: Tensor) -> bool:
    return hasattr(tensor, "__tensor_flatten__")


def _packed(bits: int, part: str) -> bool:
    return bits == 4 and part == "qdata"


def _pack(values: Tensor) -> Tensor:
    """int4 values in [-8, 7] (an int8 tensor of any shape) -> two a byte, flattened (uint8, ceil(n / 2))."""
    flat = (values.reshape(-1).to(torch.int16) + _INT4_OFFSET).to(torch.uint8)
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    return flat[0::2] | (flat[1::2] << 4)


def _unpack(packed: Tensor, shape: torch.Size) -> Tensor:
    """:func:`_pack`'s bytes -> the int8 values of ``shape``."""
    pairs = torch.stack([packed & 0xF, packed >> 4], dim=1).reshape(-1)  # (2 * bytes,) low nibble first
    return (pairs[: math.prod(shape)].to(torch.int16) - _INT4_OFFSET).to(torch.int8).reshape(shape)
