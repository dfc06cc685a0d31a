"""Image classification data: sources -> per-image timm augmentation -> batches of (images, labels)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import datasets
import numpy as np
import torch
from PIL import Image
from timm.data import create_transform
from timm.data.random_erasing import RandomErasing
from timm.data.transforms import RandomResizedCropAndInterpolation
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms

from trident.data.base import TridentDataModule, WeightsSource
from trident.data.image_sources import ImageSplits, load_image_source
from trident.errors import ConfigError

if TYPE_CHECKING:
    from omegaconf import DictConfig

Transform = Any  # a torchvision/timm callable: PIL image -> (C, H, W) tensor


class ImageDataset(Dataset[tuple[Tensor, int]]):
    """One split: uint8 arrays or a ``datasets.Dataset`` of PIL images, through ``transform``."""

    def __init__(self, split: tuple[np.ndarray, np.ndarray] | datasets.Dataset, transform: Transform, channels: int) -> None:
        self.split = split
        self.transform = transform
        self.mode = "L" if channels == 1 else "RGB"

    def __len__(self) -> int:
        return len(self.split[1]) if isinstance(self.split, tuple) else len(self.split)

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        if isinstance(self.split, tuple):
            image, label = Image.fromarray(self.split[0][index]), int(self.split[1][index])
        else:
            row = self.split[index]
            image, label = row["image"], int(row["label"])
        return self.transform(image.convert(self.mode)), label


class NormalizedArrays(Dataset[tuple[Tensor, int]]):
    """Un-augmented uint8 arrays of the model's size, normalised once into one tensor: per-image
    PIL conversion would cost more than a small model's forward pass."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, mean: list[float], std: list[float]) -> None:
        pixels = torch.from_numpy(images).float().div_(255)  # (N, H, W) or (N, H, W, C)
        pixels = pixels[:, None] if pixels.ndim == 3 else pixels.permute(0, 3, 1, 2)  # (N, C, H, W)
        self.images = (pixels - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]
        self.labels = torch.from_numpy(labels).long()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        return self.images[index], int(self.labels[index])


def is_identity(augment: dict[str, Any]) -> bool:
    """True when the augmentation settings change nothing (augment=none)."""
    scale = tuple(augment.get("scale", (0.08, 1.0)))
    return (not augment.get("auto_augment") and scale == (1.0, 1.0) and not augment.get("re_prob")
            and not augment.get("hflip"))


# How every split resizes its images (timm's default for ViT, and what its eval transform uses): training and
# evaluation alike, or the network sees other pixels at test time than it trained on.
INTERPOLATION = "bicubic"


def train_transform(image_size: int, mean: list[float], std: list[float], augment: dict[str, Any]) -> Transform:
    """Random resized crop, then RandAugment (timm) or TrivialAugment (torchvision), then random erasing."""
    policy = augment.get("auto_augment")
    scale = tuple(augment.get("scale", (0.08, 1.0)))
    re_prob = float(augment.get("re_prob", 0.0))
    if policy == "trivial":
        return transforms.Compose([
            RandomResizedCropAndInterpolation(image_size, scale=scale, interpolation=INTERPOLATION),
            transforms.TrivialAugmentWide(),
            transforms.ToTensor(),
            transforms.Normalize(mean, std),
            RandomErasing(re_prob, mode="pixel", device="cpu"),
        ])
    if policy is not None and not str(policy).startswith("rand"):
        raise ConfigError(f"augment.auto_augment={policy!r} is not supported: use a timm RandAugment spec "
                          "(e.g. rand-m9-mstd0.5-inc1), trivial, or null")
    return create_transform(
        image_size, is_training=True, auto_augment=policy, scale=scale, hflip=float(augment.get("hflip", 0.0)),
        color_jitter=None, re_prob=re_prob, re_mode="pixel", mean=tuple(mean), std=tuple(std), interpolation=INTERPOLATION,
    )


def eval_transform(image_size: int, mean: list[float], std: list[float]) -> Transform:
    return transforms.Compose([
        transforms.Resize(image_size, interpolation=transforms.InterpolationMode(INTERPOLATION)),
        transforms.CenterCrop(image_size), transforms.ToTensor(), transforms.Normalize(mean, std),
    ])


class ImageSettingsDataModule(TridentDataModule):
    """A data module of images for a patch network: the images' size (square) and channels, the patch size the network
    cuts them into, and their per-channel normalisation (0.5 each unless given, one value a channel), checked and
    defaulted here for every image data module."""

    def __init__(self, image_size: int, in_channels: int, patch_size: int, mean: list[float] | None,
                 std: list[float] | None, num_workers: int, pin_memory: bool, persistent_workers: bool) -> None:
        super().__init__(num_workers=num_workers, pin_memory=pin_memory, persistent_workers=persistent_workers)
        mean, std = list(mean or [0.5] * in_channels), list(std or [0.5] * in_channels)
        if len(mean) != in_channels or len(std) != in_channels:
            example = ",".join(["0.5"] * in_channels)
            raise ConfigError(f"data.mean and data.std need {in_channels} values (data.in_channels), got {mean}, {std}: "
                              f"give one a channel, e.g. data.mean=[{example}] data.std=[{example}]")
        self.image_size, self.in_channels, self.patch_size = image_size, in_channels, patch_size
        self.mean, self.std = mean, std


class ImageDataModule(ImageSettingsDataModule):
    # Settings a source states that the run may change: the weights follow (a ViT's position table is resampled to
    # another image size, trident.weights.transfer), or the user chooses (the images' normalisation: a network fed
    # another scores less, docs/weights.md); the source's value is the default.
    ADAPTABLE_FROM_SOURCE = ("image_size", "mean", "std")

    @classmethod
    def settings_from_source(cls, source: WeightsSource, data: DictConfig, explicit: Sequence[str]) -> dict[str, Any]:
        """The source's image geometry and normalisation, but an adaptable setting the command line set."""
        adapted = {f"data.{key}" for key in cls.ADAPTABLE_FROM_SOURCE} & set(explicit)
        return {key: value for key, value in super().settings_from_source(source, data, explicit).items()
                if key not in adapted}

    def __init__(
        self,
        source: str = "mnist_5k",
        data_dir: str | None = None,
        hub_path: str | None = None,
        hub_config: str | None = None,
        image_column: str = "image",
        label_column: str = "label",
        image_size: int = 28,
        in_channels: int = 1,
        patch_size: int = 4,
        mean: list[float] | None = None,
        std: list[float] | None = None,
        validation_size: float = 500,
        test_size: float = 500,
        train_size: float | None = None,
        split_seed: int = 0,
        test_on_validation: bool = False,
        batch_size: int = 128,
        num_workers: int = 0,
        pin_memory: bool = False,
        persistent_workers: bool = True,
        augment: dict[str, Any] | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__(image_size, in_channels, patch_size, mean, std, num_workers=num_workers, pin_memory=pin_memory,
                         persistent_workers=persistent_workers)
        self.seed = seed  # the training order of epoch e is a function of (seed, e)
        self.source = source
        self.options = {
            "data_dir": data_dir, "hub_path": hub_path, "hub_config": hub_config, "image_column": image_column,
            "label_column": label_column, "validation_size": validation_size, "test_size": test_size,
            "train_size": train_size, "split_seed": split_seed, "test_on_validation": test_on_validation,
            "image_size": image_size,
        }
        self.batch_size = batch_size
        self.augment = dict(augment or {})
        self.data: ImageSplits | None = None
        self.datasets: dict[str, ImageDataset] = {}

    def prepare_data(self) -> None:
        """Nothing to fetch for the packaged sources; hub datasets are downloaded and cached by ``datasets``."""

    def setup(self, stage: str | None = None) -> None:
        if self.data is not None:
            return
        self.data = load_image_source(self.source, self.options)
        train_tf = train_transform(self.image_size, self.mean, self.std, self.augment)
        eval_tf = eval_transform(self.image_size, self.mean, self.std)
        for name, split in self.data.splits.items():
            plain = name != "train" or is_identity(self.augment)
            if plain and isinstance(split, tuple) and split[0].shape[1:3] == (self.image_size, self.image_size):
                self.datasets[name] = NormalizedArrays(*split, self.mean, self.std)
            else:
                self.datasets[name] = ImageDataset(split, train_tf if name == "train" else eval_tf, self.in_channels)

    @property
    def num_classes(self) -> int:
        if self.data is None:
            raise RuntimeError("call setup() before reading num_classes")
        if self.data.class_names:
            return len(self.data.class_names)
        train = self.data.splits["train"]
        return int(np.max(train[1]) + 1) if isinstance(train, tuple) else int(max(train["label"]) + 1)

    def task_inputs(self) -> dict[str, Any]:
        assert self.data is not None, "call setup() before task_inputs()"
        return {
            "num_classes": self.num_classes,
            "image_size": self.image_size,
            "in_channels": self.in_channels,
            "patch_size": self.patch_size,
            "class_names": self.data.class_names or [str(i) for i in range(self.num_classes)],
            "mean": self.mean,
            "std": self.std,
        }

    def save_to(self, run_dir: Path) -> None:
        (run_dir / "classes.json").write_text(json.dumps(self.task_inputs()["class_names"]))

    def split_loader(self, split: str, train: bool) -> DataLoader:
        return self.epoch_loader(self.datasets[split], train, self.batch_size, self.seed)
