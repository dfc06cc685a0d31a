"""``data=digits`` (scikit-learn's 8x8 digits for an MNIST-sized ViT) and ``data.train_size`` (a small
labelled set), checked against scikit-learn's arrays and PIL's resize, not against the code's output."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf
from PIL import Image
from sklearn.datasets import load_digits

from trident.data.image_sources import load_image_source
from trident.data.images import ImageDataModule
from trident.errors import ConfigError
from trident.extras import MissingExtra

from .conftest import CONF_DIR
from .entry_points import run_in_process

DIGITS = load_digits()  # (1797, 8, 8) values 0..16
DEFAULTS = {"validation_size": 300, "test_size": 300, "split_seed": 0, "image_size": 28}


def digits(**options: object) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    return load_image_source("digits", {**DEFAULTS, **options}).splits  # type: ignore[return-value]


def rows(images: np.ndarray, labels: np.ndarray) -> list[tuple[int, bytes]]:
    """The images with their labels, sorted: a multiset that ignores the order."""
    return sorted(zip(labels.tolist(), (image.tobytes() for image in images)))


def test_the_splits_have_the_sizes_asked_and_together_are_the_whole_set_once() -> None:
    splits = digits(image_size=8)  # at 8x8, an image is scikit-learn's own (scaled to 0..255)
    assert [len(splits[name][1]) for name in ("train", "validation", "test")] == [1197, 300, 300]
    reference = np.round(DIGITS.images * 255 / 16).astype(np.uint8)
    together = [np.concatenate([splits[name][i] for name in splits]) for i in (0, 1)]
    # Same multiset of (label, image) as scikit-learn's 1,797: no image in two splits, none lost.
    assert rows(*together) == rows(reference, DIGITS.target)
    by_fraction = digits(validation_size=0.1, test_size=0.2)
    assert [len(by_fraction[name][1]) for name in ("train", "validation", "test")] == [1259, 179, 359]


def test_the_split_is_fixed_by_its_seed() -> None:
    first, again, other = digits(), digits(), digits(split_seed=1)
    assert all(np.array_equal(first[name][0], again[name][0]) for name in first)
    assert not np.array_equal(first["test"][1], other["test"][1])


def test_images_are_scikit_learns_scaled_to_0_1_and_resized_like_pil_bilinear() -> None:
    splits = digits()
    images, labels = splits["train"]
    assert images.shape == (1197, 28, 28) and images.dtype == np.uint8
    # Find each of a few training images in scikit-learn's set by its label and PIL's bilinear resize.
    for image, label in zip(images[:5], labels[:5]):
        candidates = [np.asarray(Image.fromarray((raw / 16).astype(np.float32), mode="F").resize((28, 28), Image.BILINEAR))
                      for raw in DIGITS.images[DIGITS.target == label]]
        distance = min(np.abs(image / 255 - c).max() for c in candidates)
        assert distance <= 0.5 / 255 + 1e-6, "uint8 rounding is the only difference"


def test_the_data_module_gives_normalised_28x28_images_with_the_configs_statistics() -> None:
    config = OmegaConf.load(CONF_DIR / "data" / "digits.yaml")
    module = ImageDataModule(source="digits", validation_size=300, test_size=300, mean=list(config.mean),
                             std=list(config.std), augment={"scale": [1.0, 1.0]})
    module.setup("fit")
    raw = module.data.splits["train"][0] / 255  # type: ignore[union-attr]
    # The statistics in conf/data/digits.yaml are the training pixels' (4 decimals).
    assert (round(float(raw.mean()), 4), round(float(raw.std()), 4)) == (config.mean[0], config.std[0])
    image, label = module.datasets["validation"][0]
    assert image.shape == (1, 28, 28) and 0 <= label <= 9
    pixels = image * config.std[0] + config.mean[0]
    assert float(pixels.min()) >= -1e-6 and float(pixels.max()) <= 1 + 1e-6
    assert module.task_inputs()["num_classes"] == 10


def test_a_small_labelled_set_is_a_fixed_part_of_train_and_leaves_the_other_splits_alone() -> None:
    full, hundred, fifty = digits(), digits(train_size=100), digits(train_size=50)
    assert len(hundred["train"][1]) == 100 and len(digits(train_size=0.5)["train"][1]) == 598
    assert set(rows(*fifty["train"])) <= set(rows(*hundred["train"])) <= set(rows(*full["train"]))
    assert all(np.array_equal(hundred[name][0], full[name][0]) for name in ("validation", "test"))


@pytest.mark.parametrize(("options", "message"), [
    ({"train_size": 0}, "data.train_size=0 asks for 0 of the 1197 training images: give a count from 1 to 1197"),
    ({"train_size": 5000}, "data.train_size=5000 asks for 5000 of the 1197"),
    ({"train_size": "all"}, "data.train_size='all' is not a number"),
    ({"validation_size": 1000, "test_size": 900}, "leave no split of the 1797 digits empty"),
])
def test_bad_sizes_are_one_line(options: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        digits(**options)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_without_scikit_learn_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import trident.extras

    real = trident.extras.importlib.util.find_spec
    monkeypatch.setattr(trident.extras.importlib.util, "find_spec", lambda name: None if name == "sklearn" else real(name))
    with pytest.raises(MissingExtra, match=r"data=digits\) needs trident's \[mnist\] extra"):
        digits()


def test_train_py_exits_2_with_one_line_on_a_bad_train_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    result = run_in_process("train.py", ["task=vit", "data=digits", "data.train_size=0", "logger=none",
                                         f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, monkeypatch)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.last_line.startswith("error: data.train_size=0 asks for 0 of the 1197")
    assert not (tmp_path / "run" / "config_resolved.yaml").exists()
