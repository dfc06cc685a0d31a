"""Full fine-tuning, LoRA and QLoRA of one Llama-style LM (issue 56): the bytes the network holds (an NF4 weight
counted as stored: codes, block scales, scale factors), the gradient + AdamW-state bytes, the step time and the loss
after the same steps on the same data from the same random-weight base.

The networks are those ``python train.py task=lm`` builds (:class:`trident.tasks.lm.LanguageModelTask`) with the
converters put on by the task (``lora=`` / ``nf4=``: ``finetune=lora`` and ``finetune=qlora``'s settings), so the rows
measure trident's QLoRA, not a copy. The data: token sequences of a seeded random bigram chain (each token followed
by one of 4 successors), learnable by every variant; the loss is the cross-entropy on a held-out batch of the same
chain after :data:`STEPS` AdamW steps at one learning rate. The step times are taken in turns in one process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import Tensor, nn

from trident.bench.results import Row, Settings, milliseconds
from trident.bench.timing import Budget, interleaved, training_step
from trident.converters.nf4 import is_nf4
from trident.runs.compose import CONF_DIR
from trident.tasks.lm import LanguageModelTask

# Llama-style (rope, RMSNorm, SwiGLU, no biases): every linear a whole number of NF4 scale groups (64 x 256 weights).
LLAMA = {"d_model": 256, "n_layers": 2, "n_heads": 4, "d_ff": 768, "max_seq_len": 64, "pos_encoding": "rope",
         "norm": "rmsnorm", "activation": "swiglu", "bias": False, "dropout": 0.0}
QUICK = {**LLAMA, "d_model": 128, "n_layers": 2, "n_heads": 2, "d_ff": 256, "max_seq_len": 32}
VOCAB, QUICK_VOCAB = 1024, 64
BATCH, LENGTH, QUICK_BATCH, QUICK_LENGTH = 4, 64, 2, 32
STEPS, QUICK_STEPS = 20, 3
RANK, LR = 8, 1e-3
SUCCESSORS = 4  # the bigram chain's branching: its entropy is log(4) = 1.386 nats a token
VARIANTS = ("full", "lora", "qlora")
LABELS = {"full": "full fine-tuning", "lora": f"LoRA r={RANK} on q, k, v, o, mlp",
          "qlora": f"QLoRA r={RANK} on q, k, v, o, mlp (NF4 base)"}
MIB = 2**20


@dataclass(frozen=True)
class Measured:
    """One variant after its steps: the network's bytes, its gradient + AdamW-state bytes, the held-out loss."""

    weight_bytes: int
    training_bytes: int
    start_loss: float
    loss: float


def converters(variant: str) -> dict[str, Any]:
    """The task's converter settings of ``variant`` (conf/finetune/qlora.yaml's alpha and blocks, at :data:`RANK`)."""
    finetune = OmegaConf.load(CONF_DIR / "finetune" / "qlora.yaml")
    lora = {"rank": RANK, "alpha": finetune.alpha, "dropout": 0.0, "targets": ["q", "k", "v", "o", "mlp"]}
    nf4 = {"block_size": finetune.block_size, "scaler_block_size": finetune.scaler_block_size}
    return {"full": {}, "lora": {"lora": lora}, "qlora": {"lora": lora, "nf4": nf4}}[variant]


def build(variant: str, quick: bool) -> LanguageModelTask:
    """The same random-weight base (seed 0) under ``variant``'s converters."""
    torch.manual_seed(0)
    return LanguageModelTask(QUICK if quick else LLAMA, vocab_size=QUICK_VOCAB if quick else VOCAB, optimizer={},
                             scheduler={}, **converters(variant))


def bigram_batches(quick: bool, count: int) -> Tensor:
    """``count`` batches of the seeded bigram chain, (count, batch, length + 1)."""
    vocab = QUICK_VOCAB if quick else VOCAB
    batch, length = (QUICK_BATCH, QUICK_LENGTH) if quick else (BATCH, LENGTH)
    generator = torch.Generator().manual_seed(0)
    successors = torch.randint(0, vocab, (vocab, SUCCESSORS), generator=generator)
    ids = torch.empty(count * batch, length + 1, dtype=torch.long)
    ids[:, 0] = torch.randint(0, vocab, (count * batch,), generator=generator)
    for t in range(length):
        ids[:, t + 1] = successors[ids[:, t], torch.randint(0, SUCCESSORS, (count * batch,), generator=generator)]
    return ids.view(count, batch, length + 1)


def held_bytes(net: nn.Module) -> int:
    """Every parameter's bytes as stored (an NF4 weight: its packed codes, scales, factors and code book)."""
    total = 0
    for param in net.parameters():
        parts = [getattr(param, name) for name in param.__tensor_flatten__()[0]] if is_nf4(param) else [param]
        total += sum(t.numel() * t.element_size() for t in parts)
    return total


def loss_on(net: nn.Module, ids: Tensor) -> Tensor:
    return F.cross_entropy(net(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())


def train_and_measure(net: nn.Module, batches: Tensor, held_out: Tensor, device: torch.device) -> Measured:
    """:data:`STEPS` AdamW steps, one batch each, then the bytes of what a step leaves and the held-out loss."""
    optimizer = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=LR, fused=True)
    with torch.no_grad():
        start = loss_on(net.eval(), held_out).item()
    net.train()
    for ids in batches:
        optimizer.zero_grad(set_to_none=True)
        loss_on(net, ids).backward()
        optimizer.step()
    grads = sum(p.grad.numel() * p.grad.element_size() for p in net.parameters() if p.grad is not None)
    state = sum(t.numel() * t.element_size() for per_param in optimizer.state.values()
                for t in per_param.values() if isinstance(t, Tensor))
    with torch.no_grad():
        end = loss_on(net.eval(), held_out).item()
    return Measured(held_bytes(net), grads + state, start, end)


def qlora_rows(settings: Settings) -> list[Row]:
    steps = QUICK_STEPS if settings.quick else STEPS
    data = bigram_batches(settings.quick, steps + 1).to(settings.device)
    nets = {variant: build(variant, settings.quick).net.to(settings.device) for variant in VARIANTS}
    measured = {variant: train_and_measure(net, data[:-1], data[-1], settings.device) for variant, net in nets.items()}
    timed = {variant: training_step(net, lambda net=net: loss_on(net, data[0]), settings.device,
                                    optimizer=torch.optim.AdamW([p for p in net.parameters() if p.requires_grad],
                                                                lr=LR, fused=True))
             for variant, net in nets.items()}
    seconds = interleaved(timed, Budget(settings.warmup, settings.repeats))
    cfg, vocab = nets["full"].cfg, nets["full"].vocab_size
    batch, length = (QUICK_BATCH, QUICK_LENGTH) if settings.quick else (BATCH, LENGTH)
    shape = (f"Llama-style LM, d={cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads, d_ff {cfg.d_ff} (SwiGLU), "
             f"vocab {vocab}; batch {batch} x {length}, {steps} AdamW steps at lr {LR}")
    full = measured["full"]

    def summary(variant: str) -> str:
        m = measured[variant]
        return (f"weights {m.weight_bytes / MIB:,.2f} MiB; grad + AdamW {m.training_bytes / MIB:,.2f} MiB; "
                f"step {milliseconds(seconds[variant])}; held-out loss {m.start_loss:.3f} -> {m.loss:.3f}")

    return [Row("qlora", f"{LABELS[variant]}: {shape}", summary(variant),
                "-" if variant == "full" else f"full: {summary('full')}",
                "-" if variant == "full" else (f"{measured[variant].weight_bytes / full.weight_bytes:.1%} of full's "
                                               f"weight bytes; {seconds['full'] / seconds[variant]:.2f}x full's step "
                                               f"speed; loss {measured[variant].loss - full.loss:+.3f} vs full"),
                "-", "-", f"same random-weight base and bigram data (entropy {math.log(SUCCESSORS):.3f} "
                          f"nats); bytes read from the tensors; step times in turns, median of {settings.repeats}; "
                          f"fp32; {torch.get_num_threads()} torch threads")
            for variant in VARIANTS]
