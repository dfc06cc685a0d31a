"""Rows about the pipeline around the model: Lightning's overhead over a bare loop, token-budget
batching against random batching, and data-loader workers."""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger

from trident.backbone import TransformerConfig
from trident.bench.results import Row, Settings, milliseconds, verdict
from trident.bench.timing import synchronize
from trident.data.batching import TokenBudgetBatchSampler
from trident.data.images import ImageDataModule
from trident.data.lm import LMDataModule
from trident.data.translation import TranslationDataModule
from trident.tasks.lm import LanguageModelTask
from trident.training.callbacks import Throughput
from trident.training.optim import optimizers_for

OPTIMIZER = {"name": "adamw", "lr": 1e-3, "weight_decay": 0.1, "fused": True}
SCHEDULER = {"name": "cosine", "warmup_steps": 10}


def cache_dir() -> str:
    """The prepared-data cache train.py uses (conf/paths: $TRIDENT_CACHE_DIR or outputs/cache)."""
    return os.environ.get("TRIDENT_CACHE_DIR", "outputs/cache")


class StepClock(L.Callback):
    """Records when each training batch ends: the intervals are the per-step wall-clock times."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        synchronize(pl_module.device)
        self.ends.append(time.perf_counter())


def _intervals(ends: list[float], skip: int) -> list[float]:
    """Step times after the first ``skip`` steps (loader start-up, first-call work)."""
    return [b - a for a, b in zip(ends[skip:], ends[skip + 1 :])]


def _bare_loop(task: LanguageModelTask, loader: Any, steps: int, device: torch.device) -> list[float]:
    """What a user would write by hand: the same model, batches, loss, optimizer, schedule and clipping."""
    task.to(device)  # Lightning's teardown moved it back to the CPU
    configured = optimizers_for(task.net, OPTIMIZER, SCHEDULER, steps)
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    task.train()
    ends = []
    batches: Iterator[Any] = iter(loader)
    for _ in range(steps):
        inputs, targets = (t.to(device, non_blocking=True) for t in next(batches))
        loss = F.cross_entropy(task.net(inputs).flatten(0, 1).float(), targets.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(task.net.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        synchronize(device)
        ends.append(time.perf_counter())
    return ends


def pipeline_rows(settings: Settings) -> list[Row]:
    quick = settings.quick
    block, batch, steps = (16, 2, 6) if quick else (256, 8, 12)
    cfg = TransformerConfig(
        d_model=32 if quick else 256, n_heads=2 if quick else 4, n_layers=1 if quick else 4,
        d_ff=64 if quick else 1024, max_seq_len=block,
    )
    datamodule = LMDataModule(source="shakespeare", block_size=block, batch_size=batch, cache_dir=cache_dir())
    datamodule.prepare_data()
    datamodule.setup("fit")
    inputs = datamodule.task_inputs()
    task = LanguageModelTask(backbone=vars(cfg), vocab_size=inputs["vocab_size"], optimizer=OPTIMIZER,
                             scheduler=SCHEDULER)
    skip = 2
    lightning_times: list[float] = []
    bare_times: list[float] = []
    with tempfile.TemporaryDirectory() as log_dir:

        def run_lightning() -> None:
            clock = StepClock()
            trainer = L.Trainer(
                accelerator=settings.device.type, devices=1, max_steps=steps, precision="32-true",
                gradient_clip_val=1.0, limit_val_batches=0, num_sanity_val_steps=0, log_every_n_steps=10,
                logger=CSVLogger(log_dir), callbacks=[Throughput(window=5), clock], enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False,
            )
            trainer.fit(task, datamodule=datamodule)
            lightning_times.extend(_intervals(clock.ends, skip))

        def run_bare() -> None:
            bare_times.extend(_intervals(_bare_loop(task, datamodule.train_dataloader(), steps, settings.device), skip))

        for round_index in range(max(2, settings.repeats // 2)):  # rounds in turns, the first alternating
            for run in (run_lightning, run_bare) if round_index % 2 == 0 else (run_bare, run_lightning):
                run()
    lightning, bare = statistics.median(lightning_times), statistics.median(bare_times)
    overhead = lightning / bare - 1
    return [Row(
        "pipeline",
        f"LM train step in the Lightning pipeline vs a bare loop: d={cfg.d_model}, {cfg.n_layers} layers, "
        f"batch {batch} x {block} Shakespeare tokens",
        f"Lightning {milliseconds(lightning)}", f"bare loop {milliseconds(bare)}", f"{overhead:+.1%} overhead",
        "<= +3%", verdict(overhead <= 0.03),
        "same model, data loader, AdamW, cosine schedule, clipping; Lightning also logs (CSV), measures "
        "throughput/MFU; steady-state median per step, start-up and validation excluded",
    )]


def _translation_lengths(quick: bool) -> tuple[np.ndarray, np.ndarray, str]:
    if quick:  # no corpus to prepare in a quick run: log-normal lengths like sentences
        rng = np.random.default_rng(0)
        src = np.clip(rng.lognormal(3.0, 0.5, 2000), 3, 200).astype(np.int64)
        return src, np.clip((src * rng.uniform(0.8, 1.3, src.size)).astype(np.int64), 3, 200), "synthetic lengths"
    datamodule = TranslationDataModule(source="bible", cache_dir=cache_dir(), max_len=256, max_tokens=2048)
    datamodule.prepare_data()
    datamodule.setup("fit")
    src, tgt = datamodule.datasets["train"].lengths()
    return src, tgt, "Bible en-de training split"


def _padding_fraction(batches: list[np.ndarray], src: np.ndarray, tgt: np.ndarray) -> float:
    real = sum(int(src[b].sum() + tgt[b].sum()) for b in batches)
    padded = sum(len(b) * int(src[b].max() + tgt[b].max()) for b in batches)
    return 1 - real / padded


def batching_rows(settings: Settings) -> list[Row]:
    max_tokens = 2048
    src, tgt, corpus = _translation_lengths(settings.quick)
    sampler = TokenBudgetBatchSampler(src, tgt, max_tokens, seed=0)
    bucketed = [np.asarray(b) for b in sampler.global_batches(0)]
    per_batch = round(len(src) / len(bucketed))
    order = np.random.default_rng(0).permutation(len(src))
    random = [order[i : i + per_batch] for i in range(0, len(order), per_batch)]
    ours, theirs = _padding_fraction(bucketed, src, tgt), _padding_fraction(random, src, tgt)
    return [Row(
        "batching", f"Translation padding fraction, {corpus} ({len(src)} pairs): token budget {max_tokens} vs "
        f"random batches of {per_batch} pairs",
        f"bucketed {ours:.1%} padding", f"random {theirs:.1%} padding", f"{theirs / max(ours, 1e-9):.1f}x less padding",
        "-", "-", "random batches hold the same mean number of pairs as the bucketed ones",
    )]


def workers_rows(settings: Settings) -> list[Row]:
    """Per-step time of ViT training on augmented MNIST, batches made in the main process or by workers."""
    augment = {"auto_augment": "rand-n1-m5-mstd0.5", "scale": [0.75, 1.0], "re_prob": 0.1, "hflip": 0.0}
    batch, steps = (8, 4) if settings.quick else (128, 12)
    results = {}
    for workers in (0, 2):
        datamodule = ImageDataModule(source="mnist_5k", batch_size=batch, num_workers=workers, augment=augment)
        datamodule.setup("fit")
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(28 * 28, 10))
        optimizer = torch.optim.AdamW(model.parameters(), fused=True)
        ends = []
        for images, labels in datamodule.train_dataloader():
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            ends.append(time.perf_counter())
            if len(ends) > steps:
                break
        results[workers] = statistics.median(_intervals(ends, 1))
    return [Row(
        "workers",
        f"Augmented MNIST batches of {batch} (RandAugment, crops, erasing) per step: 2 workers vs in-process",
        f"num_workers=2 {milliseconds(results[2])}", f"num_workers=0 {milliseconds(results[0])}",
        f"{results[0] / results[2]:.2f}x faster with workers", "-", "-",
        "a linear model, so the step is data-bound: the most workers can give; with 2 cores they compete "
        "with training for the same cores",
    )]
