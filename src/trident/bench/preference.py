"""The weights a DPO run holds (issue 53; the ``lora_dpo`` rows): with LoRA, its reference policy is the same network
with its adapters switched off, so it holds one copy of the base; in full fine-tuning, a frozen copy of the initial
weights beside the policy, two.

Each variant is the task ``python train.py data=preference objective=dpo`` builds (on the GPT-2-small-shaped LM of the
``lora`` rows, trident.bench.lora), built as a run builds it (its reference copied from the loaded weights, then the
converters applied), after one DPO step on random pairs (the reference log-probabilities computed, the gradient
taken). The bytes are read from the tensors: every distinct storage of every parameter and buffer of the task's
networks and companions, a storage shared by tensors (tied embeddings) counted once.
"""

from __future__ import annotations

import torch
from torch import nn

from trident.bench.lora import GPT2_SMALL, GPT2_VOCAB, LABELS, MIB, QUICK, QUICK_VOCAB, VARIANTS, lora_settings
from trident.bench.results import Row, Settings, verdict
from trident.data.preference import PreferenceBatch
from trident.tasks.lm import LanguageModelTask
from trident.tasks.networks import convert_networks, converting_later, load_companions

# Pairs and tokens (prompt and answer) of the DPO step: the step shows what the reference needs, not a speed.
PAIRS, LENGTH, PROMPT = 2, 64, 16
QUICK_PAIRS, QUICK_LENGTH, QUICK_PROMPT = 2, 16, 4
COMPARED = ("full", "lora_qv")
#: Issue 53: a LoRA DPO run holds one copy of the base weights.
TARGET = "one copy of the base weights (the adapters beside it)"


def dpo_task(variant: str, quick: bool) -> LanguageModelTask:
    """``objective=dpo`` on the LM of ``variant`` (None targets: full fine-tuning), built as a run builds it."""
    targets = VARIANTS[variant]
    torch.manual_seed(0)
    with converting_later():  # the reference of full fine-tuning copies the weights the run loaded
        task = LanguageModelTask(QUICK if quick else GPT2_SMALL, vocab_size=QUICK_VOCAB if quick else GPT2_VOCAB,
                                 optimizer={}, scheduler={}, objective={"name": "dpo"},
                                 lora=None if targets is None else lora_settings(targets),
                                 reference="init/reference.safetensors")  # named, never written here
    load_companions(task, started=True)
    convert_networks(task)
    return task


def dpo_step(task: LanguageModelTask, quick: bool) -> None:
    """One DPO loss and backward on random pairs: the reference log-probabilities and the policy's gradient."""
    pairs, length, prompt = (QUICK_PAIRS, QUICK_LENGTH, QUICK_PROMPT) if quick else (PAIRS, LENGTH, PROMPT)
    inputs = torch.randint(0, task.net.vocab_size, (2 * pairs, length), generator=torch.Generator().manual_seed(0))
    targets = torch.full_like(inputs, -100)
    targets[:, prompt - 1 : -1] = inputs[:, prompt:]
    loss, _ = task.objective(task, PreferenceBatch(inputs, targets, torch.zeros(0)), "train")
    loss.summed.backward()


def held_bytes(modules: list[nn.Module]) -> int:
    """Bytes of the distinct storages of every parameter and buffer of ``modules`` (a shared storage once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for module in modules for t in (*module.parameters(), *module.buffers())}
    return sum(storages.values())


def adapter_bytes(task: LanguageModelTask) -> int:
    return sum(p.numel() * p.element_size() for name, p in task.net.named_parameters() if "lora_" in name)


def lora_dpo_rows(settings: Settings) -> list[Row]:
    base = held_bytes([dpo_task("full", settings.quick).net])  # the network as init_from loads it
    held = {}
    for variant in COMPARED:
        task = dpo_task(variant, settings.quick)
        dpo_step(task, settings.quick)
        held[variant] = (held_bytes([task, *task.companions.values()]), adapter_bytes(task))
    copies = {variant: (total - adapters) / base for variant, (total, adapters) in held.items()}

    def summary(variant: str) -> str:
        total, adapters = held[variant]
        return (f"{total / MIB:,.2f} MiB held: {copies[variant]:.2f}x the base's {base / MIB:,.2f} MiB"
                + (f" + {adapters / MIB:,.2f} MiB of adapters" if adapters else ""))

    shape = "GPT-2-small-shaped" if not settings.quick else "quick-sized"
    return [Row(
        "lora_dpo", f"objective=dpo with {LABELS['lora_qv']} of a {shape} LM: the weights the task holds after a DPO "
        "step (its reference: the same network, adapters off)",
        summary("lora_qv"), f"full fine-tuning DPO: {summary('full')} (its reference a frozen copy)",
        f"{copies['lora_qv']:.2f} copies of the base", TARGET, verdict(copies["lora_qv"] == 1.0),
        "bytes of the distinct storages of every parameter and buffer of the task's networks and companions, a shared "
        "storage (tied embeddings) once, after one DPO loss and backward; fp32",
    )]
