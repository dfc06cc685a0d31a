"""Full fine-tuning against LoRA of one GPT-2-small-shaped LM: what trains, the bytes its gradients and AdamW
state take, the peak resident memory and the step time.

The network is the one ``python train.py task=lm`` builds (:class:`trident.tasks.lm.LanguageModelTask`), and
LoRA is put on it when the task is built (``lora=`` the ``finetune=lora`` settings: the lifecycle applies the
LoRA converter, trident.tasks.networks), so the row measures trident's LoRA, not a copy. Gradient and optimizer-state bytes are read
from the real tensors after a step (every ``.grad`` and every tensor of ``optimizer.state``), never computed
from the parameter counts. A process's peak RSS only grows, so the full model's peak would hide the adapters'
in one process: each variant's peak comes from a fresh child process (``python -m trident.bench.lora
<variant>``) that builds it and trains two steps; the step times come from the parent, the variants in turns.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn

from trident.bench.memory import peak_rss_bytes
from trident.bench.results import Row, Settings, milliseconds, verdict
from trident.bench.timing import Budget, adamw, interleaved, training_step
from trident.runs.compose import CONF_DIR
from trident.tasks.lm import LanguageModelTask
from trident.training.finetuning import trainable_parameters

# GPT-2 small (124 M parameters, tied embeddings): width, layers, heads, feed-forward, vocabulary, positions.
GPT2_SMALL = {"d_model": 768, "n_layers": 12, "n_heads": 12, "d_ff": 3072, "max_seq_len": 1024,
              "pos_encoding": "learned", "activation": "gelu_tanh", "dropout": 0.1}
GPT2_VOCAB = 50257
QUICK = {"d_model": 32, "n_layers": 2, "n_heads": 2, "d_ff": 64, "max_seq_len": 32,
         "pos_encoding": "learned", "activation": "gelu_tanh", "dropout": 0.1}
QUICK_VOCAB = 64
BATCH, LENGTH = 8, 256
QUICK_BATCH, QUICK_LENGTH = 2, 16
RANK = 8
#: The compared variants: None is full fine-tuning, else the adapted parts (finetune.targets).
VARIANTS: dict[str, list[str] | None] = {"full": None, "lora_qv": ["q", "v"], "lora_all": ["q", "k", "v", "o", "mlp"]}
LABELS = {"full": "full fine-tuning", "lora_qv": f"LoRA r={RANK} on q, v", "lora_all": f"LoRA r={RANK} on q, k, v, o, mlp"}
#: Issue 41: LoRA r=8 on q and v needs at most 1 % of full fine-tuning's gradient + optimizer-state bytes.
STATE_SHARE_TARGET = 0.01
TARGET_VARIANT = "lora_qv"
MIB = 2**20


@dataclass(frozen=True)
class Measured:
    """One variant after a training step: what trains, and the bytes of its gradients and AdamW state."""

    trainable: int
    total: int
    grad_bytes: int
    state_bytes: int

    @property
    def training_bytes(self) -> int:
        return self.grad_bytes + self.state_bytes


def lora_settings(targets: list[str]) -> dict[str, Any]:
    """``finetune=lora``'s adapter settings (conf/finetune/lora.yaml: alpha, dropout) at rank :data:`RANK`."""
    finetune = OmegaConf.load(CONF_DIR / "finetune" / "lora.yaml")
    return {"rank": RANK, "alpha": finetune.alpha, "dropout": finetune.dropout, "targets": targets}


def build(variant: str, quick: bool) -> LanguageModelTask:
    """The LM task of ``variant`` (its base frozen and adapters added by the task, as under finetune=lora)."""
    targets = VARIANTS[variant]
    torch.manual_seed(0)
    return LanguageModelTask(QUICK if quick else GPT2_SMALL, vocab_size=QUICK_VOCAB if quick else GPT2_VOCAB,
                             optimizer={}, scheduler={}, lora=None if targets is None else lora_settings(targets))


def step_of(net: nn.Module, quick: bool, device: torch.device) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW over ``net`` (frozen parameters get no state) and a closure training one step on a random batch."""
    vocab = QUICK_VOCAB if quick else GPT2_VOCAB
    batch, length = (QUICK_BATCH, QUICK_LENGTH) if quick else (BATCH, LENGTH)
    ids = torch.randint(0, vocab, (batch, length + 1), generator=torch.Generator().manual_seed(0)).to(device)
    optimizer = adamw(net)
    step = training_step(net, lambda: F.cross_entropy(net(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()),
                         device, optimizer=optimizer)
    return optimizer, step


def training_state(net: nn.Module, optimizer: torch.optim.Optimizer) -> Measured:
    """Counted from the tensors a step left: every parameter's ``.grad``, every tensor in ``optimizer.state``."""
    grads = sum(p.grad.numel() * p.grad.element_size() for p in net.parameters() if p.grad is not None)
    state = sum(t.numel() * t.element_size() for per_param in optimizer.state.values()
                for t in per_param.values() if isinstance(t, torch.Tensor))
    counts = trainable_parameters(net)
    return Measured(int(counts["params/trainable"]), int(counts["params/total"]), grads, state)


def _peak_mib() -> float:
    return peak_rss_bytes() / 2**20


def child_peak(variant: str, quick: bool) -> dict[str, float]:
    """Peak RSS of a fresh process that builds ``variant`` and trains two steps (the second has the first's
    AdamW state and a new set of gradients), and its RSS before building anything (imports)."""
    command = [sys.executable, "-m", "trident.bench.lora", variant, *(["--quick"] if quick else [])]
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    done = subprocess.run(command, check=True, capture_output=True, text=True, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> None:
    """The child process: prints ``{"imports_mib": ..., "peak_mib": ...}`` as its last line."""
    variant, quick = argv[0], "--quick" in argv[1:]
    imports = _peak_mib()
    net = build(variant, quick).net
    _, step = step_of(net, quick, torch.device("cpu"))
    step()
    step()
    print(json.dumps({"imports_mib": imports, "peak_mib": _peak_mib()}))


def lora_rows(settings: Settings) -> list[Row]:
    # Peak RSS is the memory of a CPU run (on a GPU the tensors live in device memory).
    peaks = {variant: child_peak(variant, settings.quick) for variant in VARIANTS} if settings.device.type == "cpu" \
        else {}
    nets = {variant: build(variant, settings.quick).net.to(settings.device) for variant in VARIANTS}
    steps = {variant: step_of(net, settings.quick, settings.device) for variant, net in nets.items()}
    seconds = interleaved({variant: step for variant, (_, step) in steps.items()},
                          Budget(settings.warmup, settings.repeats))
    measured = {variant: training_state(nets[variant], optimizer) for variant, (optimizer, _) in steps.items()}
    full = measured["full"]
    cfg = nets["full"].cfg
    batch, length = (QUICK_BATCH, QUICK_LENGTH) if settings.quick else (BATCH, LENGTH)
    shape = (f"{full.total:,} parameters: d={cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads, "
             f"d_ff {cfg.d_ff}, vocab {nets['full'].vocab_size}, learned positions {cfg.max_seq_len}")

    def summary(variant: str) -> str:
        m = measured[variant]
        peak = peaks.get(variant)
        memory = f"peak RSS {peak['peak_mib']:,.0f} MiB" if peak else "peak RSS: CPU only"
        return (f"{m.trainable:,} trainable ({m.trainable / m.total:.2%}); grad + AdamW state "
                f"{m.training_bytes / MIB:,.2f} MiB; {memory}; step {milliseconds(seconds[variant])}")

    rows = []
    for variant in VARIANTS:
        m = measured[variant]
        share = m.training_bytes / full.training_bytes
        checked = variant == TARGET_VARIANT
        peak = peaks.get(variant)
        rows.append(Row(
            "lora", f"{LABELS[variant]} of a GPT-2-small-shaped LM ({shape}), batch {batch} x {length}, AdamW",
            summary(variant), "-" if variant == "full" else f"full: {summary('full')}",
            "-" if variant == "full" else (f"{share:.2%} of full's grad + optimizer-state bytes; "
                                           f"{seconds['full'] / seconds[variant]:.2f}x full's step speed"),
            f"<= {STATE_SHARE_TARGET:.0%} of full's grad + optimizer-state bytes" if checked else "-",
            verdict(share <= STATE_SHARE_TARGET) if checked else "-",
            f"bytes read from every .grad and optimizer.state tensor after a step (fused AdamW: 2 moments and a "
            f"step counter per trainable tensor); peak RSS of a fresh child process building this variant and "
            f"training 2 steps (its imports alone: {peak['imports_mib']:,.0f} MiB), so no variant's peak hides "
            f"another's; step times in the parent, variants in turns, median of {settings.repeats}; fp32; "
            f"{torch.get_num_threads()} torch threads" if peak else "peak RSS measured on CPU runs only",
        ))
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
