"""Low-rank adapters (LoRA, Hu et al. 2021) on the backbone's projections, by trident's part names.

``peft`` puts one adapter on one ``nn.Linear``; trident fuses q, k and v into one ``qkv_proj`` (and a
SwiGLU's gate and up into one ``fc_in``), so :class:`LoRALinear` keeps one adapter per slice of the
output rows: ``finetune.targets=[q,v]`` adapts the query and value rows of ``qkv_proj`` and leaves the
key rows alone, as peft's ``target_modules=[q_proj, v_proj]`` does on a Llama. The frozen weight keeps
its name (``qkv_proj.weight``), so checkpoints, ``init_from`` and the exports read it as before; the
adapters are ``<linear>.lora_A.<slice>`` (rank x in) and ``<linear>.lora_B.<slice>`` (slice rows x rank).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trident.backbone.attention import MultiHeadAttention
from trident.backbone.layers import FeedForward

#: The part names ``finetune.targets`` takes: attention query, key, value, output; the feed-forward layers.
LORA_TARGETS = ("q", "k", "v", "o", "mlp")


class LoRALinear(nn.Linear):
    """``nn.Linear`` plus, for each named slice of its output rows, ``scaling * B (A dropout(x))``.

    ``slices`` maps a slice name to its (start, stop) rows. B starts at zero, so the layer starts
    equal to the frozen one; A as peft's default (Kaiming-uniform with a = sqrt(5)).
    """

    def __init__(self, linear: nn.Linear, slices: dict[str, tuple[int, int]], rank: int, alpha: float,
                 dropout: float) -> None:
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        self.weight, self.bias = linear.weight, linear.bias  # the frozen layer's own tensors, names unchanged
        self.slices = dict(slices)
        self.scaling = alpha / rank
        self.enabled = True  # False: the frozen layer alone (adapters_off)
        self.lora_dropout = nn.Dropout(dropout)
        device, dtype = linear.weight.device, linear.weight.dtype
        self.lora_A = nn.ParameterDict(
            {name: nn.Parameter(torch.empty(rank, self.in_features, device=device, dtype=dtype)) for name in slices})
        self.lora_B = nn.ParameterDict(
            {name: nn.Parameter(torch.zeros(stop - start, rank, device=device, dtype=dtype))
             for name, (start, stop) in slices.items()})
        for a in self.lora_A.values():
            nn.init.kaiming_uniform_(a, a=5**0.5)

    def delta_weight(self, name: str) -> Tensor:
        """What slice ``name`` adds to the weight's rows: scaling * B A, (rows, in)."""
        return self.scaling * self.lora_B[name] @ self.lora_A[name]

    def forward(self, x: Tensor) -> Tensor:
        out = F.linear(x, self.weight, self.bias)  # (..., out)
        if not self.enabled:
            return out
        dropped = self.lora_dropout(x)
        pieces, row = [], 0
        for name, (start, stop) in sorted(self.slices.items(), key=lambda item: item[1]):
            if start > row:  # rows no adapter targets add nothing
                pieces.append(out.new_zeros(*out.shape[:-1], start - row))
            pieces.append(self.scaling * F.linear(F.linear(dropped, self.lora_A[name]), self.lora_B[name]))
            row = stop
        if row < self.out_features:
            pieces.append(out.new_zeros(*out.shape[:-1], self.out_features - row))
        return out + torch.cat(pieces, dim=-1)  # (..., out)

    def merged(self) -> nn.Linear:
        """A plain ``nn.Linear`` whose weight holds the adapters: the same outputs, no adapter left."""
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        weight = self.weight.detach().clone()
        for name, (start, stop) in self.slices.items():
            weight[start:stop] += self.delta_weight(name).detach().to(weight.dtype)
        linear.weight = nn.Parameter(weight, requires_grad=self.weight.requires_grad)
        linear.bias = self.bias
        return linear


def lora_slices(module: nn.Module, targets: set[str]) -> dict[str, dict[str, tuple[int, int]]]:
    """The adapted linear layers of one attention or feed-forward ``module``: attribute name -> its slices."""
    chosen: dict[str, dict[str, tuple[int, int]]] = {}
    if isinstance(module, MultiHeadAttention):
        q_rows, kv_rows = module.n_heads * module.head_dim, module.n_kv_heads * module.head_dim
        if module.cross:  # q_proj: [q]; kv_proj: [k; v]
            rows = {"q_proj": {"q": (0, q_rows)}, "kv_proj": {"k": (0, kv_rows), "v": (kv_rows, 2 * kv_rows)}}
        else:  # qkv_proj: [q; k; v]
            rows = {"qkv_proj": {"q": (0, q_rows), "k": (q_rows, q_rows + kv_rows),
                                 "v": (q_rows + kv_rows, q_rows + 2 * kv_rows)}}
        rows["out_proj"] = {"o": (0, module.out_proj.out_features)}
        for attribute, slices in rows.items():
            kept = {name: span for name, span in slices.items() if name in targets}
            if kept:
                chosen[attribute] = kept
    elif isinstance(module, FeedForward) and "mlp" in targets:
        width = module.fc_out.in_features
        chosen["fc_in"] = {"gate": (0, width), "up": (width, 2 * width)} if module.gated else {"in": (0, width)}
        chosen["fc_out"] = {"out": (0, module.fc_out.out_features)}
    return chosen


def add_lora(net: nn.Module, targets: list[str], rank: int, alpha: float, dropout: float) -> None:
    """Put adapters on the ``targets`` parts (:data:`LORA_TARGETS`) of every attention and feed-forward
    layer of ``net``, in place; the names of the existing parameters stay as they were."""
    for module in list(net.modules()):
        for attribute, slices in lora_slices(module, set(targets)).items():
            setattr(module, attribute, LoRALinear(getattr(module, attribute), slices, rank, alpha, dropout))


@contextmanager
def adapters_off(net: nn.Module) -> Iterator[None]:
    """Within the block, every adapter of ``net`` is switched off: ``net`` computes what its frozen base does (the
    reference policy of preference tuning, with no second copy of the weights), as peft's ``disable_adapter``."""
    layers = [module for module in net.modules() if isinstance(module, LoRALinear)]
    for layer in layers:
        layer.enabled = False
    try:
        yield
    finally:
        for layer in layers:
            layer.enabled = True


def has_adapters(net: nn.Module) -> bool:
    """Whether ``net`` holds LoRA adapters (finetune=lora)."""
    return any(isinstance(module, LoRALinear) for module in net.modules())


def merge_lora(net: nn.Module) -> None:
    """Fold every adapter of ``net`` into its weight, in place: ``net`` then has the plain layers of the base."""
    for module in list(net.modules()):
        for attribute, child in list(module.named_children()):
            if isinstance(child, LoRALinear):
                setattr(module, attribute, child.merged())


def is_lora_parameter(name: str) -> bool:
    """Whether the parameter (or state-dict key) ``name`` is an adapter's."""
    return ".lora_A." in name or ".lora_B." in name
