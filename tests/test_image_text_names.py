"""data=image_text's zero-shot classes (issue 54): MNIST's eights and nines never train, their names are learnt from a
second source (scikit-learn's 8x8 digits, ``data.name_source``), and a zero-shot class whose name no training caption
holds is refused in one line (its word would stay as initialised: zero-shot accuracy at chance)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from torch import Tensor

from trident.data.image_sources import load_image_source
from trident.data.image_text import ImageTextDataModule, framed, word_tokenizer
from trident.data.images import NormalizedArrays
from trident.errors import ConfigError

from .conftest import compose_config
from .test_vit_pipeline import write_idx

DIGITS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def _default(overrides: list[str] | None = None) -> ImageTextDataModule:
    cfg = compose_config(["task=clip", *(overrides or [])])
    return ImageTextDataModule(**{k: v for k, v in cfg.data.items() if k not in ("_target_", "name", "max_seq_len")})


def _rows(images: Tensor) -> set[bytes]:
    """Each image (N, C, H, W) as bytes, to find one set's images in another."""
    return {row.numpy().tobytes() for row in images}


@pytest.fixture(scope="module")
def default() -> ImageTextDataModule:
    data = _default()
    data.setup("fit")
    return data


def test_held_out_mnist_images_never_train_and_the_name_source_trains_every_class(default: ImageTextDataModule) -> None:
    mnist = load_image_source("mnist_5k", default._source_options()).splits
    # The name source's digits, upscaled into a 20 x 20 box centred on the 28 x 28 field (MNIST's framing).
    digits = {split: (framed(images, 20, 28), labels) for split, (images, labels) in
              load_image_source("digits", default._source_options() | {"image_size": 20}).splits.items()}

    def normalised(split: tuple[np.ndarray, np.ndarray]) -> set[bytes]:
        return _rows(NormalizedArrays(*split, default.mean, default.std).images)

    train = default.datasets["train"].pairs
    assert isinstance(train.images, NormalizedArrays)
    trained = _rows(train.images.images)
    held_out = [DIGITS.index("eight"), DIGITS.index("nine")]
    mnist_train = mnist["train"]
    seen = ~np.isin(mnist_train[1], held_out)
    assert normalised((mnist_train[0][seen], mnist_train[1][seen])) <= trained, "MNIST's other digits train"
    assert not normalised((mnist_train[0][~seen], mnist_train[1][~seen])) & trained, "MNIST's eights and nines never train"
    for split in ("validation", "test"):
        assert not normalised(mnist[split]) & trained, f"no MNIST {split} image trains"
        evaluated = default.datasets[split].pairs
        assert isinstance(evaluated.images, NormalizedArrays)
        assert _rows(evaluated.images.images) == normalised(mnist[split]), f"{split}: MNIST's images only"
        assert set(held_out) <= set(evaluated.labels)
    # All 1,797 digits (every split of the name source, none evaluated) train, in all ten classes.
    every_digit = normalised(tuple(np.concatenate(parts) for parts in zip(*digits.values(), strict=True)))
    assert len(train.labels) == int(seen.sum()) + 1797 and every_digit <= trained
    digit_labels = train.labels[int(seen.sum()):]
    assert set(digit_labels) == set(range(10))


def test_the_word_of_each_zero_shot_class_occurs_in_training_captions(default: ImageTextDataModule) -> None:
    captions = default.datasets["train"].pairs.captions
    assert default.zero_shot_classes == ["eight", "nine"]
    split = word_tokenizer(["x"]).pre_tokenizer
    words = {word for caption in captions for word, _ in split.pre_tokenize_str(caption.lower())}
    for name in default.zero_shot_classes:
        assert name in words, f"{name!r} trains in no caption"
        assert sum(name in caption.split(" ")[-1] for caption in captions) >= 100


def test_a_smaller_name_source_is_a_fixed_sample_of_it(default: ImageTextDataModule) -> None:
    data = _default(["data.name_source_size=300"])
    data.setup("fit")
    mnist_seen = len(default.datasets["train"].pairs.labels) - 1797
    train = data.datasets["train"].pairs
    assert isinstance(train.images, NormalizedArrays) and isinstance(default.datasets["train"].pairs.images,
                                                                      NormalizedArrays)
    assert len(train.labels) == mnist_seen + 300
    assert _rows(train.images.images) <= _rows(default.datasets["train"].pairs.images.images)


def test_framed_images_are_resized_into_a_centred_box_of_the_field() -> None:
    images = np.full((2, 8, 8), 255, dtype=np.uint8)
    out = framed(images, 4, 10)
    assert out.shape == (2, 10, 10) and out.dtype == np.uint8
    assert (out[:, 3:7, 3:7] == 255).all() and out.sum() == 2 * 16 * 255, "a 4 x 4 white box at the centre, black around"
    assert (framed(images, 8, 8) == images).all(), "a frame of the whole field leaves the images as they are"


@pytest.mark.parametrize(("overrides", "message"), [
    (["data.name_source=null"], (r"data.zero_shot_classes \['eight', 'nine'\]: no training caption holds their names "
                                 r"\(data.name_source=None\).* set data.name_source=digits .*or data.zero_shot_classes=\[\]")),
    (["data.name_source=mnist_5k"], r"data.name_source=mnist_5k is data.source: its validation and test images would"),
    (["data.name_source=cifar"], r"data.name_source=cifar is not a packaged source: choose one of"),
    (["data.name_source_size=0"], r"data.name_source_size=0: give a count from 1 to the 1797 images"),
    (["data.name_source_frame=29"], r"data.name_source_frame=29: give a side from 1 to data.image_size=28"),
])
def test_contradictions_are_one_line(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as error:
        _default(overrides).setup("fit")
    assert "\n" not in str(error.value)


def test_without_a_name_source_and_no_held_out_class_mnist_alone_trains_every_class() -> None:
    """The behaviour before a name source, less the hold-out that could not succeed: MNIST's ten digits train."""
    data = _default(["data.name_source=null", "data.zero_shot_classes=[]"])
    data.setup("fit")
    assert set(data.datasets["train"].pairs.labels) == set(range(10))
    assert len(data.datasets["train"].pairs.labels) == 4000


def test_a_tokenizer_file_only_warns_of_an_untrained_name(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A tokenizer file may be a pre-trained CLIP's whose text tower knows the names: a warning, not a refusal."""
    path = tmp_path / "tokenizer.json"
    words = "a photo of the digit eight nine zero one two three four five six seven handwritten number picture ."
    word_tokenizer([words]).save(str(path))
    data = _default([f"data.tokenizer={path}", "data.name_source=null"])
    with caplog.at_level(logging.WARNING, logger="trident.data.image_text"):
        data.setup("fit")
    assert "no training caption holds their names" in caplog.text


def test_a_name_source_of_other_classes_is_refused(tmp_path: Path) -> None:
    """Fashion-MNIST has ten classes as MNIST has: its clothes would train captioned "zero" ... "nine" (found by the
    review: only the count was compared)."""
    images, labels = np.zeros((600, 28, 28)), np.arange(600) % 10
    for split, count in (("train", 600), ("t10k", 10)):
        write_idx(tmp_path / f"{split}-images-idx3-ubyte.gz", images[:count])
        write_idx(tmp_path / f"{split}-labels-idx1-ubyte.gz", labels[:count])
    data = _default(["data.name_source=fashion_mnist", f"data.data_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"data.name_source=fashion_mnist's classes \['T-shirt/top', .* are not "
                                          r"data.source=mnist_5k's \['0', .*digits for mnist_5k\), or data.name_source=null"):
        data.setup("fit")


def test_a_name_trained_only_inside_a_template_word_is_not_refused() -> None:
    """Zero-shot classification encodes the templates filled with each name: with the template "{}s" the captions and the
    prompts hold "eights", never the bare "eight", which the check must not ask for (found by the review)."""
    data = _default(["data.templates=['the {}s']"])
    data.setup("fit")
    assert "the eights" in data.datasets["train"].pairs.captions
    with pytest.raises(ConfigError, match=r"data.zero_shot_classes \['eight', 'nine'\]: no training caption"):
        _default(["data.templates=['the {}s']", "data.name_source=null"]).setup("fit")
