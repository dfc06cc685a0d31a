"""Figures for image classification: confusion matrix, misclassified images, attention rollout.

Saved as PNG under ``<run dir>/figures/`` and logged to W&B when it is attached.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import matplotlib

matplotlib.use("Agg")  # no display: render to files
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.loggers import WandbLogger  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from torch import Tensor  # noqa: E402


def unnormalize(images: Tensor, mean: list[float], std: list[float]) -> np.ndarray:
    """(B, C, H, W) normalised tensors -> (B, H, W, C) floats in [0, 1] for plotting."""
    m = torch.tensor(mean, device=images.device)[None, :, None, None]
    s = torch.tensor(std, device=images.device)[None, :, None, None]
    return (images.float() * s + m).clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy()


def confusion_matrix_figure(matrix: Tensor, class_names: list[str]) -> Figure:
    size = max(4.0, 0.45 * len(class_names))
    fig, ax = plt.subplots(figsize=(size, size))
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
    fig, axes = plt.subplots(rows, cols, figsize=(1.6 * cols, 1.8 * rows), squeeze=False)
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


def publish_figure(module: L.LightningModule, key: str, fig: Figure) -> Path:
    """Save ``fig`` as ``<run dir>/figures/<key>.png`` and log it to W&B if attached."""
    folder = Path(module.trainer.default_root_dir) / "figures"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{key.replace('/', '_')}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    for logger in module.loggers:
        if isinstance(logger, WandbLogger):
            logger.log_image(key=key, images=[str(path)], step=module.global_step)
    return path
