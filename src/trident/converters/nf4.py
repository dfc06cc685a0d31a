"""The frozen base in 4-bit NormalFloat (Dettmers et al. 2023, QLoRA): ``finetune=qlora`` is LoRA composed with
this converter (trident.converters: LoRA's adapters are put on first, then the linear weights they wrap quantized;
a merge undoes them in reverse, dequantize then add).

Which weights: every linear of the attention and feed-forward layers (the projections LoRA targets and those it
does not), as torchtune's QLoRA (``FrozenNF4Linear`` beside its NF4 ``LoRALinear``s) and peft with bitsandbytes (every
``nn.Linear`` but the head); the embeddings, the head, the norms, biases and a task's new head keep their precision.
Each weight becomes a torchao ``NF4Tensor`` (``to_nf4``: blocks of ``block_size`` values scaled by their absmax, the
block scales themselves quantized to int8 per ``scaler_block_size`` scales, QLoRA's double quantization), held as the
layer's own ``weight`` parameter (its name unchanged); the layer's ``F.linear`` then runs torchao's ``linear_nf4``
(dequantize and matmul, with the gradient to the input alone: the NF4 weight never trains).

A checkpoint holds no NF4 tensor: the quantized weights are the source's (``init_from``) unchanged as far as the
checkpoints are concerned (trident.weights.frozen_base: quantizing the same tensor gives the same bytes), so they are
left out and refilled from the source, which a load quantizes again (torchao's ``copy_`` into an NF4 weight).
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor, nn

from trident.backbone import FeedForward, MultiHeadAttention, TransformerConfig
from trident.converters.base import Converter
from trident.errors import ConfigError, is_int
from trident.extras import require_package

if TYPE_CHECKING:
    from omegaconf import DictConfig

#: The keys of ``finetune=qlora`` that quantize the base (the task's ``nf4`` hyperparameter).
NF4_KEYS = ("block_size", "scaler_block_size")
#: Lightning's precisions whose plugin casts the network's weights (``convert_module``); 32-true and the mixed ones do not.
CASTING_PRECISIONS = ("bf16-true", "16-true", "64-true", "64", "transformer-engine", "transformer-engine-float16")


def quantized_linears(net: nn.Module) -> dict[str, nn.Linear]:
    """The linears of ``net``'s attention and feed-forward layers, by module name (LoRA's wrapped ones included)."""
    return {f"{owner}.{name}" if owner else name: child
            for owner, module in net.named_modules() if isinstance(module, MultiHeadAttention | FeedForward)
            for name, child in module.named_children() if isinstance(child, nn.Linear)}


def is_nf4(tensor: Tensor) -> bool:
    """Whether ``tensor`` is a quantized base weight (torchao's ``NF4Tensor``; False where torchao is absent)."""
    return type(tensor).__name__ == "NF4Tensor" and hasattr(tensor, "get_original_weight")


def holds(param: Tensor, source: Tensor) -> bool:
    """Whether ``param`` holds ``source`` as loaded: the same values, or (an NF4 weight) ``source`` quantized with
    its block sizes, byte for byte (the same tensor gives the same bytes)."""
    if not is_nf4(param):
        return param.shape == source.shape and torch.equal(source.to(param.dtype), param.detach())
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    if param.shape != source.shape or source.numel() % (param.block_size * param.scaler_block_size):
        return False
    again = to_nf4(source.to(param.dtype).contiguous(), param.block_size, param.scaler_block_size)
    return all(torch.equal(getattr(again, part), getattr(param, part)) for part in again.__tensor_flatten__()[0])


def nf4_bytes(net: nn.Module) -> tuple[int, int]:
    """(bytes, values) of ``net``'s quantized weights as stored: the packed 4-bit codes, the int8 block scales, each
    scale block's factor and the scales' mean, the 16-entry code book."""
    stored = values = 0
    for param in net.parameters():
        if is_nf4(param):
            stored += sum(t.numel() * t.element_size() for t in (getattr(param, part)
                                                                 for part in param.__tensor_flatten__()[0]))
            values += param.numel()
    return stored, values


class NF4Base(Converter):
    """The frozen linears of every attention and feed-forward layer stored in NF4; nothing of them trains."""

    NAME: ClassVar[str] = "nf4"
    FREEZES_SOURCE: ClassVar[bool] = True
    # The weights are quantized in place and the quantized base is what the run starts from: switched off, the base
    # stays NF4 (LoRA's adapters off give the initial policy), as TRL with peft on a bitsandbytes 4-bit base takes
    # the reference policy (``disable_adapter``); a float copy of the base would hold 8 times its bytes and differ
    # from the initial policy by the NF4 error (DPO's loss at the start no longer log 2).
    SWITCHES_OFF: ClassVar[bool] = True

    def __init__(self, settings: dict[str, Any]) -> None:
        super().__init__(settings)
        self.quantized: set[str] = set()  # parameter names of the NF4 weights, in every network it converted

    @classmethod
    def check(cls, cfg: DictConfig, settings: dict[str, Any], backbone: TransformerConfig) -> dict[str, Any]:
        require_package("torchao")
        chosen = {key: settings.get(key) for key in NF4_KEYS}
        for key, example in (("block_size", 64), ("scaler_block_size", 256)):
            if not is_int(chosen[key]) or chosen[key] < 2 or chosen[key] % 2:
                raise ConfigError(f"finetune.{key} must be an even positive integer, got {chosen[key]!r}: set e.g. "
                                  f"finetune.{key}={example}")
        block = chosen["block_size"]
        widths = {"d_model": backbone.d_model, "the attention's n_heads * head_dim": backbone.n_heads * backbone.head_dim,
                  "d_ff": backbone.d_ff}
        uneven = {name: width for name, width in widths.items() if width % block}
        if uneven:
            name, width = next(iter(uneven.items()))
            raise ConfigError(f"finetune=qlora quantizes each row of the linears in blocks of finetune.block_size="
                              f"{block}, which does not divide their input width {name}={width}: choose a block size "
                              f"that divides it (e.g. finetune.block_size={_divisor(width, block)})")
        return chosen

    @classmethod
    def check_run(cls, cfg: DictConfig) -> None:
        """Lightning's true-precision plugins (``trainer.precision=bf16-true``) cast the network with ``module.to``,
        which torchao 0.18's NF4 answers with a dense copy in the new dtype (``set_data``: the codes stay beside it).
        Lightning's EMA (``callbacks=ema``) deep-copies the network and averages every weight of it: torchao 0.18's
        NF4 ``clone`` quantizes the weight again with the default blocks (64, 256), and an NF4 weight has no lerp."""
        precision = str((cfg.get("trainer") or {}).get("precision", ""))
        if precision in CASTING_PRECISIONS:
            raise ConfigError(f"trainer.precision={precision} casts every weight of the network (module.to), and an NF4 "
                              "weight cast so keeps its codes and gains a dense copy of itself (more bytes than "
                              "finetune=lora's base): use precision=bf16 (bf16-mixed: the matmuls in bf16, the adapters "
                              "in float32), or finetune=lora")
        if (cfg.get("callbacks") or {}).get("ema") is not None:
            raise ConfigError("callbacks=ema averages every weight of the network, and finetune=qlora's NF4 base "
                              "cannot be copied or averaged (nor need be: it is frozen): drop callbacks=ema (use "
                              "callbacks=default), or use finetune=lora")

    def apply(self, net: nn.Module) -> None:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

        block, scalers = self.settings["block_size"], self.settings["scaler_block_size"]
        linears = quantized_linears(net)
        blocks = {where: linear.weight.numel() // block for where, linear in linears.items()}
        uneven = [where for where, count in blocks.items() if count % scalers]
        if uneven:  # in_features % block is the config's check (TransformerConfig's widths)
            where, linear = uneven[0], linears[uneven[0]]
            raise ConfigError(f"finetune=qlora cannot quantize {where} ({linear.out_features}x{linear.in_features}): "
                              f"its {blocks[where]} blocks of {block} values do not fill whole groups of finetune."
                              f"scaler_block_size={scalers} scales: choose one that divides every layer's block count "
                              f"(e.g. finetune.scaler_block_size={_divisor(math.gcd(*blocks.values()), scalers)})")
        names = {id(param): name for name, param in net.named_parameters()}
        for linear in linears.values():
            name = names[id(linear.weight)]
            with torch.no_grad():
                linear.weight = nn.Parameter(to_nf4(linear.weight.detach().contiguous(), block, scalers),
                                             requires_grad=False)
            self.quantized.add(name)

    def check_shards(self, net: nn.Module, shards: int) -> None:
        """FSDP2 splits each NF4 weight by its rows, and torchao's NF4 splits its codes, block scales and scale
        groups alike (``fsdp_pre_all_gather``): each weight's rows and groups of ``scaler_block_size`` scales must
        divide evenly over the ranks."""
        block, scalers = self.settings["block_size"], self.settings["scaler_block_size"]
        linears = quantized_linears(net)
        blocks = {where: linear.weight.numel() // block for where, linear in linears.items()}
        uneven = [where for where, linear in linears.items()
                  if linear.out_features % shards or blocks[where] // scalers % shards]
        if uneven:
            where, linear = uneven[0], linears[uneven[0]]
            fits = next((size for size in range(scalers, 1, -1) if size % 2 == 0
                         and all(count % (size * shards) == 0 for count in blocks.values())), None)
            fix = (f"choose finetune.scaler_block_size={fits}" if fits is not None and not linear.out_features % shards
                   else "use trainer=ddp (the adapters are small: each rank holds the whole NF4 base)")
            raise ConfigError(f"finetune=qlora under FSDP splits each NF4 weight's rows and its groups of finetune."
                              f"scaler_block_size={scalers} block scales over {shards} ranks, and {where} "
                              f"({linear.out_features}x{linear.in_features}, {blocks[where] // scalers} groups) does "
                              f"not split evenly: {fix}")

    def trains(self, name: str) -> bool:
        return name not in self.quantized

    def switched_off(self, net: nn.Module) -> AbstractContextManager[None]:
        """The base as the run starts from it: quantized (nothing to undo; LoRA switches its adapters off)."""
        return nullcontext()

    def merge(self, net: nn.Module) -> None:
        """Each NF4 weight back to a float one: torchao's dequantization, in the dtype it was quantized from."""
        for linear in quantized_linears(net).values():
            if is_nf4(linear.weight):
                linear.weight = nn.Parameter(linear.weight.get_original_weight(), requires_grad=False)


def _divisor(width: int, wanted: int) -> int:
    """The largest even divisor of ``width`` not above ``wanted`` (2 at least), the block size a fix suggests."""
    return next((size for size in range(min(wanted, width), 1, -1) if width % size == 0 and size % 2 == 0), 2)
