"""GPU-scale rows: the LM at ``model=base`` and ViT-B/16 (``model=base``, 224 px, patch 16), one
training step in bf16, fp16 and fp32 and compiled in bf16: step time, tokens or images per second,
model FLOPs utilisation against the device's peak (trident.training.flops) and peak memory.

The batch fills the device: the largest power of two up to a cap whose training step fits in
memory. Sizes come from conf/model/base.yaml, the ones ``python train.py model=base`` trains.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import Tensor, nn

from trident.backbone import TransformerConfig
from trident.bench.results import Row, Settings, milliseconds
from trident.bench.timing import Budget, interleaved, training_step
from trident.models import CausalLM
from trident.models.vit import VisionTransformer, vit_geometry
from trident.runs.compose import CONF_DIR
from trident.training.flops import causal_lm_flops, compute_dtype, device_peak_flops, vit_flops

# GPT-2's vocabulary padded to a multiple of 64 (nanoGPT), at GPT-2's context: the usual shape
# for an MFU figure of a base-size LM.
LM_VOCAB, LM_LENGTH, LM_MAX_BATCH = 50304, 1024, 64
VIT_IMAGE, VIT_PATCH, VIT_CLASSES, VIT_MAX_BATCH = 224, 16, 1000, 512
# Lightning's precision setting per compared dtype: autocast dtype and the peak's dtype follow it.
PRECISIONS = {"bf16": ("bf16-mixed", torch.bfloat16), "fp16": ("16-mixed", torch.float16),
              "fp32": ("32-true", torch.float32)}
LM_MFU_TARGET = 0.45  # issue 12: LM model=base in bf16 at a batch that fills the GPU


@dataclass(frozen=True)
class Workload:
    """One model and how to feed it a batch of a given size."""

    name: str
    unit: str  # what a sample is: tokens or images
    build: Callable[[], nn.Module]
    loss: Callable[[nn.Module, int], Callable[[], Tensor]]  # (model, batch) -> loss closure
    flops: Callable[[int], int]  # model FLOPs of one training step at this batch
    units: Callable[[int], int]  # tokens or images per step at this batch
    max_batch: int


def base_config(quick: bool, **geometry: object) -> TransformerConfig:
    """``conf/model/base.yaml`` as a backbone config (tiny sizes under --quick)."""
    if quick:
        return TransformerConfig(d_model=32, n_heads=2, n_layers=1, d_ff=64, **geometry)
    # The size file extends the shared architecture file (its Hydra defaults list): compose as Hydra does.
    size = OmegaConf.load(CONF_DIR / "model" / "base.yaml")
    shared = [OmegaConf.load(CONF_DIR / "model" / f"{name}.yaml") for name in size.pop("defaults", [])]
    sizes = OmegaConf.to_container(OmegaConf.merge(*shared, size))
    sizes.pop("name")  # type: ignore[union-attr]
    return TransformerConfig(**sizes, **geometry)  # type: ignore[arg-type]


def lm_workload(settings: Settings) -> Workload:
    length, vocab = (16, 64) if settings.quick else (LM_LENGTH, LM_VOCAB)
    cfg = base_config(settings.quick, max_seq_len=length, pos_encoding="rope")

    def loss(model: nn.Module, batch: int) -> Callable[[], Tensor]:
        ids = torch.randint(0, vocab, (batch, length + 1), device=settings.device)
        return lambda: F.cross_entropy(model(ids[:, :-1]).flatten(0, 1).float(), ids[:, 1:].flatten())

    return Workload(
        f"LM model=base (d={cfg.d_model}, {cfg.n_layers} layers), {length} tokens, vocab {vocab}", "tokens",
        lambda: CausalLM(cfg, vocab), loss, lambda batch: causal_lm_flops(cfg, vocab, batch, length),
        lambda batch: batch * length, 2 if settings.quick else LM_MAX_BATCH,
    )


def vit_workload(settings: Settings) -> Workload:
    image, patch, classes = (16, 4, 10) if settings.quick else (VIT_IMAGE, VIT_PATCH, VIT_CLASSES)
    cfg = base_config(settings.quick, pos_encoding="learned", norm_eps=1e-6, **vit_geometry(image, patch, "cls"))

    def loss(model: nn.Module, batch: int) -> Callable[[], Tensor]:
        images = torch.randn(batch, 3, image, image, device=settings.device)
        labels = torch.randint(0, classes, (batch,), device=settings.device)
        return lambda: F.cross_entropy(model(images).float(), labels)

    return Workload(
        f"ViT-B/{patch} model=base (d={cfg.d_model}, {cfg.n_layers} layers), {image} px, {classes} classes", "images",
        lambda: VisionTransformer(cfg, patch_size=patch, in_channels=3, num_classes=classes),
        loss, lambda batch: vit_flops(cfg, batch=batch, patch_size=patch, in_channels=3, num_classes=classes),
        lambda batch: batch, 2 if settings.quick else VIT_MAX_BATCH,
    )


def _free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def fitting_step(
    workload: Workload, settings: Settings, dtype: torch.dtype, compiled: bool, start_batch: int
) -> tuple[int, Callable[[], None]]:
    """The largest batch among ``start_batch``, its half, its quarter... whose training step fits in
    the device's memory, with that step (its first call already made: it allocates, or compiles)."""
    batch = start_batch
    while True:
        _free_memory(settings.device)
        torch.manual_seed(0)
        model = workload.build().to(settings.device)
        if compiled:
            model.compile()
        step = training_step(model, workload.loss(model, batch), settings.device, dtype)
        try:
            step()
            return batch, step
        except torch.OutOfMemoryError:
            if batch == 1:
                raise
        del model, step
        batch //= 2


def workload_rows(workload: Workload, group: str, settings: Settings, target: float | None) -> list[Row]:
    # --quick is a smoke test of the rows: one variant (fp16 matmuls crawl on CPUs; compiling takes minutes).
    variants = [("bf16", False)] if settings.quick else [*((name, False) for name in PRECISIONS), ("bf16", True)]
    rows, bf16_batch = [], workload.max_batch
    for dtype_name, compiled in variants:
        precision, dtype = PRECISIONS[dtype_name]
        # The compiled step starts from the eager bf16 batch (compiling each halving would cost minutes).
        found, step = fitting_step(workload, settings, dtype, compiled, bf16_batch if compiled else workload.max_batch)
        if (dtype_name, compiled) == ("bf16", False):
            bf16_batch = found
        seconds = interleaved({"step": step}, Budget(settings.warmup, settings.repeats))["step"]
        peak_flops = device_peak_flops(settings.device, compute_dtype(precision))
        mfu = workload.flops(found) / seconds / peak_flops if peak_flops else None
        memory = (f"peak memory {torch.cuda.max_memory_allocated(settings.device) / 2**30:.1f} GiB"
                  if settings.device.type == "cuda" else "peak memory: CUDA only")
        label = f"{dtype_name}{', compiled' if compiled else ''}"
        checked = target is not None and dtype_name == "bf16"
        rows.append(Row(
            group, f"{workload.name}, {label}: batch {found}",
            f"{milliseconds(seconds)}; {workload.units(found) / seconds:,.0f} {workload.unit}/s",
            f"peak {peak_flops / 1e12:.4g} TFLOP/s ({compute_dtype(precision)})" if peak_flops else "no peak known",
            f"MFU {mfu:.1%}" if mfu is not None else "-",
            f">= {target:.0%} MFU" if checked else "-",
            ("yes" if mfu >= target else "**no**") if checked and mfu is not None else "-",
            f"{memory}; batch: the largest power of two <= {workload.max_batch} that fits; fused AdamW; "
            f"{workload.flops(found) / 1e12:.3g} TFLOP per step (trident.training.flops)",
        ))
        del step
    _free_memory(settings.device)
    return rows


def mfu_rows(settings: Settings) -> list[Row]:
    return [*workload_rows(lm_workload(settings), "mfu", settings, LM_MFU_TARGET),
            *workload_rows(vit_workload(settings), "mfu", settings, None)]
