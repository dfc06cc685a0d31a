"""A ``finetune=lora`` run's adapters as a ``peft`` LoRA directory (``trident-export --format peft``):
``adapter_config.json`` and ``adapter_model.safetensors`` in the module names of the run's Hugging Face
export, which ``peft.PeftModel.from_pretrained(<the base exported as hf>, DIR)`` loads with the same logits.

Written for the Llama family (Llama, Mistral, Qwen2, Qwen3: rope, rmsnorm, swiglu), whose q, k, v, gate and
up are Linears of their own, so each of trident's per-slice adapters is one peft adapter. GPT-2 fuses q, k
and v into one ``c_attn`` (a Conv1D): trident's q-only adapter would be a rank-3r adapter there whose zero
blocks peft would train, not the adapter that was trained; such a run is refused (``--format hf`` merges it).
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file
from torch import Tensor

from trident.backbone import LoRALinear
from trident.errors import ConfigError
from trident.tasks.base import TridentTask
from trident.weights.adapters import llama_style
from trident.weights.adapters.registry import adapter_for_network

# trident's (module, slice) -> the Llama family's module, in a block.
HF_MODULES = {
    ("self_attn.qkv_proj", "q"): "self_attn.q_proj", ("self_attn.qkv_proj", "k"): "self_attn.k_proj",
    ("self_attn.qkv_proj", "v"): "self_attn.v_proj", ("self_attn.out_proj", "o"): "self_attn.o_proj",
    ("ffn.fc_in", "gate"): "mlp.gate_proj", ("ffn.fc_in", "up"): "mlp.up_proj", ("ffn.fc_out", "out"): "mlp.down_proj",
}
BLOCKS = "decoder.blocks."


def write_peft(task: TridentTask, directory: Path) -> None:
    """``task``'s adapters as peft's LoRA files in ``directory``; a run without adapters, or whose model peft
    cannot hold them for, is one error line."""
    if task.lora is None:
        raise ConfigError("--format peft writes a finetune=lora run's adapters and this run has none: "
                          "export it with --format hf")
    adapter = adapter_for_network(task.net)
    if not isinstance(adapter, llama_style.Family):
        raise ConfigError(f"--format peft writes adapters of the Llama family (rope, rmsnorm, swiglu), and this run "
                          f"exports as {adapter.ARCHITECTURES[0]}, whose fused projections peft cannot adapt per "
                          "part: export it with --format hf (the adapters merged into the weights)")
    tensors: dict[str, Tensor] = {}
    for name, module in task.net.named_modules():
        if not isinstance(module, LoRALinear):
            continue
        block, _, part = name.removeprefix(BLOCKS).partition(".")  # "3", "self_attn.qkv_proj"
        for piece in module.slices:
            prefix = f"base_model.model.model.layers.{block}.{HF_MODULES[part, piece]}"
            tensors[f"{prefix}.lora_A.weight"] = module.lora_A[piece].detach().contiguous()
            tensors[f"{prefix}.lora_B.weight"] = module.lora_B[piece].detach().contiguous()
    save_file(tensors, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    targets = sorted({key.split(".")[-3] for key in tensors})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": task.lora["rank"], "lora_alpha": task.lora["alpha"],
        "lora_dropout": task.lora["dropout"], "target_modules": targets, "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "modules_to_save": None, "inference_mode": True, "base_model_name_or_path": None,
    }
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
