"""Speed levers, each a config option: torch.compile, fused optimizer kernels, the SDPA backend
and activation checkpointing, measured on the trident LM training step."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trident.backbone import TransformerConfig
from trident.bench.memory import saved_activation_bytes
from trident.bench.results import Row, Settings, milliseconds, speedup
from trident.bench.timing import Budget, interleaved, synchronize, training_step
from trident.errors import ConfigError
from trident.models import CausalLM

VOCAB = 8000


def _lm(settings: Settings, **overrides: object) -> tuple[CausalLM, Tensor]:
    """The LM row's model (or a tiny one) and a batch of ids (B, T + 1); same seed, same weights."""
    torch.manual_seed(0)
    if settings.quick:
        cfg = TransformerConfig(d_model=32, n_heads=2, n_layers=2, d_ff=64, max_seq_len=16, **overrides)
        batch = 2
    else:
        cfg = TransformerConfig(d_model=256, n_heads=4, n_layers=4, d_ff=1024, max_seq_len=256, **overrides)
        batch = 8
    ids = torch.randint(0, VOCAB, (batch, cfg.max_seq_len + 1), device=settings.device)
    return CausalLM(cfg, VOCAB).to(settings.device), ids


def _loss(model: nn.Module, ids: Tensor) -> Callable[[], Tensor]:
    return lambda: F.cross_entropy(model(ids[:, :-1]).flatten(0, 1).float(), ids[:, 1:].flatten())


def _shape(model: CausalLM, ids: Tensor) -> str:
    return f"d={model.cfg.d_model}, {model.cfg.n_layers} layers, batch {ids.size(0)} x {ids.size(1) - 1}"


def compile_rows(settings: Settings) -> list[Row]:
    eager, ids = _lm(settings)
    compiled = copy.deepcopy(eager)
    compiled.compile()
    step = training_step(compiled, _loss(compiled, ids), settings.device)
    start = time.perf_counter()
    step()  # the first call compiles the forward and backward graphs
    compile_seconds = time.perf_counter() - start
    times = interleaved({
        "compiled": step, "eager": training_step(eager, _loss(eager, ids), settings.device),
    }, Budget(settings.warmup, settings.repeats))
    gain = speedup(times["compiled"], times["eager"])
    return [Row(
        "compile", f"compile=true, LM train step: {_shape(eager, ids)}",
        f"compiled {milliseconds(times['compiled'])}", f"eager {milliseconds(times['eager'])}", f"{gain:.2f}x faster",
        "-", "-", f"first step (compilation) took {compile_seconds:.0f} s",
    )]


def fused_rows(settings: Settings) -> list[Row]:
    model, _ = _lm(settings)
    for param in model.parameters():
        param.grad = torch.randn_like(param)
    kernels = {"fused": {"fused": True}, "foreach": {"foreach": True}, "per-parameter loop": {"foreach": False}}
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-6, **options) for name, options in kernels.items()}

    def step(optimizer: torch.optim.Optimizer) -> Callable[[], None]:
        return lambda: (optimizer.step(), synchronize(settings.device))

    budget = Budget(settings.warmup, settings.repeats)
    times = interleaved({name: step(opt) for name, opt in optimizers.items()}, budget)
    params = sum(p.numel() for p in model.parameters())
    return [Row(
        "fused", f"optimizer.fused, AdamW step on {params / 1e6:.1f} M parameters",
        f"fused {milliseconds(times['fused'])}",
        f"foreach {milliseconds(times['foreach'])}; loop {milliseconds(times['per-parameter loop'])}",
        f"{speedup(times['fused'], times['foreach']):.1f}x vs foreach, "
        f"{speedup(times['fused'], times['per-parameter loop']):.1f}x vs loop",
        "-", "-", "the loop is PyTorch's CPU default; trident's default is fused (foreach when fused=false)",
    )]


def sdpa_rows(settings: Settings) -> list[Row]:
    # A CPU has math and its own flash kernel (fp32); CUDA's flash kernel takes fp16/bf16 only, so
    # on a GPU every kernel is timed under bf16 autocast, as precision=bf16 runs it.
    cuda = settings.device.type == "cuda"
    backends = ("auto", "flash", "efficient", "cudnn", "math") if cuda else ("auto", "flash", "math")
    dtype = torch.bfloat16 if cuda else torch.float32
    models = {name: _lm(settings, sdpa_backend=name) for name in backends}
    steps, refused = {}, []
    for name, (model, ids) in models.items():
        step = training_step(model, _loss(model, ids), settings.device, dtype)
        try:
            step()  # a kernel that refuses these inputs says so at once (trident's ConfigError)
        except ConfigError:
            refused.append(name)
            continue
        steps[name] = step
    times = interleaved(steps, Budget(settings.warmup, settings.repeats))
    model, ids = models["auto"]
    fused = "; ".join(f"{name} {milliseconds(times[name])}" for name in times if name != "math")
    forced = [name for name in times if name not in ("auto", "math")]
    fastest = min(forced, key=times.__getitem__) if forced else None
    notes = ("CUDA: flash, efficient (memory-efficient) and cuDNN kernels, bf16 autocast" if cuda else
             "on a CPU only math and flash (a CPU kernel) exist; efficient and cudnn are CUDA kernels")
    return [Row(
        "sdpa", f"model.sdpa_backend, LM train step{' (bf16)' if cuda else ''}: {_shape(model, ids)}",
        fused, f"math {milliseconds(times['math'])}",
        f"{fastest} {speedup(times[fastest], times['math']):.2f}x vs math" if fastest else "no forced fused kernel ran",
        "-", "-", notes + (f"; refused these inputs: {', '.join(refused)}" if refused else ""),
    )]


def checkpointing_rows(settings: Settings) -> list[Row]:
    plain, ids = _lm(settings)
    recomputed, _ = _lm(settings, activation_checkpointing=True)
    memory = {}
    for name, model in (("plain", plain), ("recomputed", recomputed)):
        model.train()
        memory[name] = saved_activation_bytes(_loss(model, ids))
    times = interleaved({
        "recomputed": training_step(recomputed, _loss(recomputed, ids), settings.device),
        "plain": training_step(plain, _loss(plain, ids), settings.device),
    }, Budget(settings.warmup, settings.repeats))
    mib = 2**20
    return [Row(
        "checkpointing", f"model.activation_checkpointing=true, LM train step: {_shape(plain, ids)}",
        f"{milliseconds(times['recomputed'])}, {memory['recomputed'] / mib:.0f} MiB saved for backward",
        f"off {milliseconds(times['plain'])}, {memory['plain'] / mib:.0f} MiB",
        f"{memory['plain'] / memory['recomputed']:.1f}x less activation memory, "
        f"{times['recomputed'] / times['plain'] - 1:+.0%} time",
        "-", "-", "activation memory = tensors autograd keeps at the end of the forward pass (saved-tensor hooks)",
    )]
