"""Figures: confusion matrix, misclassified images, attention rollout, attention maps per layer and head.

Saved as PNG under ``<run dir>/figures/`` and logged to W&B when it is attached.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.pytorch.loggers import WandbLogger

# Figures are built without pyplot: no global backend to switch (training runs headless, and a
# notebook importing trident keeps its inline backend) and nothing to close after saving.
from matplotlib.colors import PowerNorm
from matplotlib.figure import Figure
from torch import Tensor


def unnormalize(images: Tensor, mean: list[float], std: list[float]) -> np.ndarray:
    """(B, C, H, W) normalised tensors -> (B, H, W, C) floats in [0, 1] for plotting."""
    m = torch.tensor(mean, device=images.device)[None, :, None, None]
    s = torch.tensor(std, device=images.device)[None, :, None, None]
    return (images.float() * s + m).clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy()


def confusion_matrix_figure(matrix: Tensor, class_names: list[str]) -> Figure:
    size = max(4.0, 0.45 * len(class_names))
    fig = Figure(figsize=(size, size))
    ax = fig.subplots()
    counts = matrix.cpu().numpy()
    ax.imshow(counts, cmap="Blues")
    ax.set(xlabel="predicted", ylabel="true", xticks=range(len(class_names)), yticks=range(len(class_names)))
    ax.set_xticklabels(class_names, rotation=90)
    ax.set_yticklabels(class_names)
    if len(class_names) <= 20:
        for (i, j), value in np.ndenumerate(counts):
            ax.text(j, i, str(value), ha="center", va="center", fontsize=7, color="black" if value < counts.max() / 2 else "white")
    fig.tight_layout()
    return fig


def image_grid_figure(images: np.ndarray, titles: list[str], overlays: np.ndarray | None = None) -> Figure:
    """A grid of images with titles; ``overlays`` (B, H, W) in [0, 1] are drawn on top as heat maps."""
    n = len(images)
    cols = min(8, max(1, n))
    rows = max(1, (n + cols - 1) // cols)
    fig = Figure(figsize=(1.6 * cols, 1.8 * rows))
    axes = fig.subplots(rows, cols, squeeze=False)
    for k, ax in enumerate(axes.flat):
        ax.axis("off")
        if k >= n:
            continue
        image = images[k]
        ax.imshow(image[..., 0] if image.shape[-1] == 1 else image, cmap="gray" if image.shape[-1] == 1 else None)
        if overlays is not None:
            ax.imshow(overlays[k], cmap="jet", alpha=0.45, extent=(-0.5, image.shape[1] - 0.5, image.shape[0] - 0.5, -0.5))
        ax.set_title(titles[k], fontsize=7)
    fig.tight_layout()
    return fig


def attention_grid_figure(maps: Tensor, tick_labels: Sequence[str] | None = None, cell_size: float = 1.8) -> Figure:
    """Attention maps as a layers x heads grid: ``maps`` is (layers, heads, rows, cols), e.g. one
    sequence's weights (queries x keys) or the class token's weights over an image's patch grid.
    ``tick_labels`` name the rows and columns (the tokens) when both are that long."""
    n_layers, n_heads = maps.shape[:2]
    fig = Figure(figsize=(cell_size * n_heads, cell_size * n_layers))
    axes = fig.subplots(n_layers, n_heads, squeeze=False)
    values = maps.detach().float().cpu().numpy()
    for (layer, head), ax in np.ndenumerate(axes):
        # Each map on its own scale, square-root compressed: a few large weights (a query's first
        # keys) would otherwise leave the rest of the map a single colour.
        ax.imshow(values[layer, head], cmap="viridis", norm=PowerNorm(gamma=0.5))
        ax.set_xticks([])
        ax.set_yticks([])
        if tick_labels is not None and len(tick_labels) == values.shape[2] == values.shape[3]:
            ticks = range(len(tick_labels))
            ax.set_xticks(ticks, [repr(t)[1:-1] for t in tick_labels], fontsize=5, rotation=90)
            ax.set_yticks(ticks, [repr(t)[1:-1] for t in tick_labels], fontsize=5)
        if layer == 0:
            ax.set_title(f"head {head}", fontsize=8)
        if head == 0:
            ax.set_ylabel(f"layer {layer}", fontsize=8)
    fig.tight_layout()
    return fig


def publish_figure(module: L.LightningModule, key: str, fig: Figure) -> Path:
    """Save ``fig`` as ``<run dir>/figures/<key>.png`` and log it to W&B if attached."""
    folder = Path(module.trainer.default_root_dir) / "figures"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{key.replace('/', '_')}.png"
    fig.savefig(path, dpi=110)
    for logger in module.loggers:
        if isinstance(logger, WandbLogger):
            logger.log_image(key=key, images=[str(path)], step=module.global_step)
    return path
