"""A ``finetune=lora`` run's adapters as a ``peft`` LoRA directory (``trident-export --format peft``):
``adapter_config.json`` and ``adapter_model.safetensors`` in the module names of the run's Hugging Face
export, which ``peft.PeftModel.from_pretrained(<the base exported as hf>, DIR)`` loads with the same logits.

Every family the hf export writes has a :class:`PeftLayout`, but CLIP's two towers (refused in one line). Where the family splits a layer trident fuses
(the Llama family's, BERT's and ViT's q, k, v; the Llama family's gate and up), each of trident's per-slice
adapters is one peft adapter. Where the family fuses it too (GPT-2's ``c_attn``, a Conv1D), the slices'
adapters are one exact adapter on the whole layer: A stacks the adapted slices' A (|S| r x in), B places each
slice's B in its own rows and columns, zeros elsewhere (out x |S| r), so B A is the sum of the slices' updates;
its rank is |S| r and its alpha |S| alpha (peft's ``rank_pattern`` and ``alpha_pattern``), so peft's scaling,
alpha / r, stays trident's. A task's trained head (``TridentTask.HEAD``) goes in peft's ``modules_to_save``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from trident.backbone import LoRALinear
from trident.errors import ConfigError
from trident.extras import require_package
from trident.tasks.base import TridentTask
from trident.tasks.networks import merge_network
from trident.weights.adapters import (
    hf_albert,
    hf_bart,
    hf_bert,
    hf_clip,
    hf_electra,
    hf_gemma,
    hf_gpt2,
    hf_roberta,
    hf_t5,
    hf_vit,
    llama_style,
)
from trident.weights.adapters.base import Adapter
from trident.weights.adapters.registry import adapter_for_model_type, adapter_for_network

# One of the family's modules for each slice of a trident layer, or (a str) one module for the whole layer.
Modules = dict[str, str | dict[str, str]]


@dataclass(frozen=True)
class PeftLayout:
    """Where a family's hf export holds trident's adapted layers, in the modules peft adapts."""

    blocks: str  # the family's blocks without their index: "transformer.h"
    modules: Modules  # trident's layer in a block ("self_attn.qkv_proj") -> the family's module(s) in a block
    task_type: str | None  # peft's TaskType: CAUSAL_LM for the decoders; the others have none of theirs
    fan_in_fan_out: bool = False  # weights stored (in, out): GPT-2's Conv1D
    modules_to_save: tuple[str, ...] = field(default=())  # the family's modules holding the task's HEAD


LLAMA = PeftLayout("model.layers", {
    "self_attn.qkv_proj": {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj"},
    "self_attn.out_proj": "self_attn.o_proj", "ffn.fc_in": {"gate": "mlp.gate_proj", "up": "mlp.up_proj"},
    "ffn.fc_out": "mlp.down_proj"}, task_type="CAUSAL_LM")
GPT2 = PeftLayout("transformer.h", {"self_attn.qkv_proj": "attn.c_attn", "self_attn.out_proj": "attn.c_proj",
                                    "ffn.fc_in": "mlp.c_fc", "ffn.fc_out": "mlp.c_proj"},
                  task_type="CAUSAL_LM", fan_in_fan_out=True)


def _encoder(blocks: str, modules: tuple[str, ...], head: str) -> PeftLayout:
    """BERT's and ViT's layout: separate q, k, v, then o, the MLP's in and out (``modules``); ``head`` trains."""
    q, k, v, o, fc_in, fc_out = modules
    return PeftLayout(blocks, {"self_attn.qkv_proj": {"q": q, "k": k, "v": v}, "self_attn.out_proj": o,
                               "ffn.fc_in": fc_in, "ffn.fc_out": fc_out}, task_type=None, modules_to_save=(head,))


BERT = _encoder("bert.encoder.layer", ("attention.self.query", "attention.self.key", "attention.self.value",
                                       "attention.output.dense", "intermediate.dense", "output.dense"), "cls.predictions")
# ViT's modules as transformers < 5 names them (its checkpoints' names), and as transformers 5 does (it renames
# the checkpoints' tensors on load; peft adapts modules by their names in the loaded model).
VIT = (_encoder("vit.encoder.layer", ("attention.attention.query", "attention.attention.key", "attention.attention.value",
                                      "attention.output.dense", "intermediate.dense", "output.dense"), "classifier"),
       _encoder("vit.layers", ("attention.q_proj", "attention.k_proj", "attention.v_proj", "attention.o_proj",
                               "mlp.fc1", "mlp.fc2"), "classifier"))
# The MLM head (transform, and the decoder whose own bias trains) is cls.predictions; ViT's is classifier.
# Gemma's modules (in a block) are named as Llama's; its extra norms are no LoRA targets.
LAYOUTS: dict[str, tuple[PeftLayout, ...]] = {hf_gpt2.FORMAT: (GPT2,), hf_bert.ADAPTER.FORMAT: (BERT,), hf_vit.FORMAT: VIT,
                                             hf_gemma.GEMMA2.FORMAT: (LLAMA,), hf_gemma.GEMMA3.FORMAT: (LLAMA,)}
# Families whose adapters the peft export does not place, each with why: --format hf merges them. CLIP has two stacks;
# ALBERT's shared layers are one module for several of trident's blocks; RoBERTa's, ELECTRA's, BART's and T5's layouts are
# not compared with peft yet.
NO_LAYOUT = {hf_clip.FORMAT: "--format peft writes the adapters of one stack and a CLIPModel has two",
             hf_albert.ADAPTER.FORMAT: "--format peft places an adapter a layer and ALBERT's layers share their modules",
             hf_roberta.ADAPTER.FORMAT: "--format peft has no layout of RoBERTa's modules checked against peft",
             hf_electra.ADAPTER.FORMAT: "--format peft has no layout of ELECTRA's modules checked against peft",
             hf_bart.FORMAT: "--format peft has no layout of BART's modules checked against peft",
             hf_t5.T5.FORMAT: "--format peft has no layout of T5's modules checked against peft",
             hf_t5.MT5.FORMAT: "--format peft has no layout of mT5's modules checked against peft"}


def layout_for(adapter: Adapter, net: nn.Module) -> PeftLayout:
    """The peft layout of the family ``adapter`` writes ``net`` as (the Llama family's four share one); of a
    family whose module names changed between transformers versions, the installed version's."""
    if adapter.FORMAT in NO_LAYOUT:
        raise ConfigError(f"{NO_LAYOUT[adapter.FORMAT]}: export it with --format hf (the adapters merged)")
    layouts = (LLAMA,) if isinstance(adapter, llama_style.Family) else LAYOUTS[adapter.FORMAT]
    if len(layouts) == 1:
        return layouts[0]
    require_package("transformers")
    import transformers

    architecture, settings, _ = adapter.from_trident(net)
    model_class = getattr(transformers, architecture)
    with torch.device("meta"):  # the module names alone: no weights
        names = {name for name, _ in model_class(model_class.config_class(**settings)).named_modules()}
    found = next((layout for layout in layouts if f"{layout.blocks}.0.{layout.modules['self_attn.out_proj']}" in names), None)
    if found is None:
        raise ConfigError(f"transformers {transformers.__version__} names {architecture}'s modules as no layout of "
                          "trident's peft export does: export it with --format hf (the adapters merged)")
    return found


def peft_adapters(module: LoRALinear, modules: str | dict[str, str]) -> dict[str, tuple[Tensor, Tensor]]:
    """The family's module (in a block) -> its peft (A, B) for trident's adapted layer ``module``: per slice
    where ``modules`` splits it, else one adapter of rank |slices| x rank on the whole layer."""
    if isinstance(modules, dict):
        return {modules[name]: (module.lora_A[name], module.lora_B[name]) for name in module.slices}
    ordered = sorted(module.slices.items(), key=lambda item: item[1])  # by their rows
    rank = module.lora_A[ordered[0][0]].shape[0]
    stacked = torch.cat([module.lora_A[name] for name, _ in ordered])  # (|S| r, in)
    placed = stacked.new_zeros(module.out_features, len(ordered) * rank)  # (out, |S| r)
    for column, (name, (start, stop)) in enumerate(ordered):
        placed[start:stop, column * rank:(column + 1) * rank] = module.lora_B[name]
    return {modules: (stacked, placed)}


def hf_base(task: TridentTask) -> str | None:
    """The Hugging Face directory ``task``'s adapters adapt, as peft names the base it loaded (its path): the run's
    ``init_from`` source where it is a directory of a family the hf export writes (its module names are the
    adapter's); None for any other base (a trident run, whose hf export is the base, written wherever the user
    chooses)."""
    base = task.frozen_base
    if base is None or not (Path(base.source) / "config.json").is_file():
        return None
    try:
        config = json.loads((Path(base.source) / "config.json").read_text())
    except (OSError, ValueError):  # not a Hugging Face config: not a base peft loads
        return None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    return base.source if adapter_for_model_type(str(model_type)) is not None else None


def write_peft(task: TridentTask, directory: Path) -> None:
    """``task``'s adapters as peft's LoRA files in ``directory``; a run without adapters, or whose model has no
    Hugging Face export, is one error line."""
    settings = task.hparams.get("lora")  # the LoRA converter's settings (trident.converters.lora)
    if settings is None:
        raise ConfigError("--format peft writes a finetune=lora run's adapters and this run has none: "
                          "export it with --format hf")
    # finetune=qlora: the converters applied after LoRA (its NF4 base) are folded away, the base dequantized: the
    # adapters were trained on those values, and peft puts them on a float base.
    names = [converter.NAME for converter in task.converters]
    merge_network(task.net, task.converters[names.index("lora") + 1:])
    adapter = adapter_for_network(task.net)
    layout = layout_for(adapter, task.net)
    _, _, hf_state = adapter.from_trident(task.net)  # refuses, as the hf export does, a base it cannot write
    prefix = "base_model.model."
    tensors = {prefix + name: tensor for name, tensor in hf_state.items() if name.startswith(layout.modules_to_save)}
    ranks: dict[str, int] = {}  # the family's module (in a block) -> its rank
    for name, module in task.net.named_modules():
        if not isinstance(module, LoRALinear):
            continue
        _, _, block, part = name.split(".", 3)  # "decoder", "blocks", "3", "ffn.fc_in"
        for hf_module, (lora_a, lora_b) in peft_adapters(module, layout.modules[part]).items():
            key = f"{prefix}{layout.blocks}.{block}.{hf_module}"
            tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = lora_a, lora_b
            ranks[hf_module] = lora_a.shape[0]
    save_file({name: tensor.detach().clone().contiguous() for name, tensor in tensors.items()},  # shared (BERT's tied bias): a copy each
              str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    rank, alpha = settings["rank"], settings["alpha"]
    wider = {name: width for name, width in sorted(ranks.items()) if width != rank}  # fused: |S| x rank
    config = {
        "peft_type": "LORA", "task_type": layout.task_type, "r": rank, "lora_alpha": alpha,
        "rank_pattern": wider, "alpha_pattern": {name: alpha * width / rank for name, width in wider.items()},
        "lora_dropout": settings["dropout"], "bias": "none", "fan_in_fan_out": layout.fan_in_fan_out,
        # Exactly the adapted modules: a bare suffix would catch more (BERT's output.dense ends attention.output.dense).
        "target_modules": rf"{re.escape(layout.blocks)}\.\d+\.({'|'.join(re.escape(name) for name in sorted(ranks))})",
        "modules_to_save": list(layout.modules_to_save) or None, "use_rslora": False, "inference_mode": True,
        "base_model_name_or_path": hf_base(task),
    }
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
