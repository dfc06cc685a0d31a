"""Images as the network saw them in training: ``init_from`` takes the source's normalisation (timm's
``pretrained_cfg``, a Hugging Face ``preprocessor_config.json``, a trident run's statistics: test_init_from)
unless the command line sets ``data.mean`` / ``data.std``; training and evaluation resize alike (bicubic)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import transforms

from trident.data.image_text import ImageTextDataModule
from trident.data.images import ImageDataModule
from trident.errors import ConfigError, DataError
from trident.runs.pipeline import build_data_and_task, check_config
from trident.tasks.vit import ImageClassificationTask
from trident.weights.init_from import read_init_source, settings_fixed_by, source_for_run

from .conftest import compose_config

pytestmark = pytest.mark.usefixtures("single_thread")

# task=vit on its default data (MNIST: mean 0.1307, std 0.3081); the model comes from the source.
VIT = ["task=vit", "data.batch_size=8", "logger=none", "augment=none"]


def timm_source(directory: Path, mean: float, std: float) -> Path:
    """A random timm ViT of 28x28 grey images in 7x7 patches, saved as timm saves for the Hub (config.json with its
    pretrained_cfg, which states the statistics it was trained with)."""
    import timm
    from timm.models._hub import save_for_hf

    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=28, patch_size=7, in_chans=1,
                              embed_dim=32, depth=1, num_heads=2, num_classes=10,
                              pretrained_cfg_overlay={"mean": (mean,), "std": (std,)})
    save_for_hf(model, str(directory), safe_serialization=True)
    assert json.loads((directory / "config.json").read_text())["pretrained_cfg"]["mean"] == [mean]
    return directory


def test_a_timm_source_normalises_the_runs_images_with_its_statistics(tmp_path: Path) -> None:
    source = timm_source(tmp_path / "timm", 0.5, 0.25)
    cfg = compose_config([*VIT, f"init_from={source}"], output_dir=tmp_path / "run")
    source_for_run(ImageClassificationTask, cfg, tmp_path / "run", None, False)
    assert (list(cfg.data.mean), list(cfg.data.std)) == ([0.5], [0.25])
    datamodule, task = build_data_and_task(cfg, check_config(cfg), "fit")
    assert (task.mean, task.std) == ([0.5], [0.25])
    images, _ = datamodule.data.splits["validation"]  # type: ignore[union-attr, misc]
    image, _ = datamodule.datasets["validation"][0]
    torch.testing.assert_close(image, (torch.from_numpy(images[0]).float()[None] / 255 - 0.5) / 0.25)


def test_statistics_set_on_the_command_line_win_over_the_sources(tmp_path: Path) -> None:
    source = read_init_source(str(timm_source(tmp_path / "timm", 0.5, 0.25)))
    cfg = compose_config([*VIT, "data.mean=[0.2]", "data.std=[0.3]"], output_dir=tmp_path / "run")
    fixed = settings_fixed_by(cfg, source, ["data.mean", "data.std"])
    assert "data.mean" not in fixed and "data.std" not in fixed
    assert (fixed["data.in_channels"], fixed["data.patch_size"]) == (1, 7), "the shaping options still follow"


def test_a_hugging_face_preprocessor_config_gives_the_statistics(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                    image_size=28, patch_size=7, num_channels=3, num_labels=4)
    transformers.ViTForImageClassification(config).save_pretrained(tmp_path / "hf")
    processor = transformers.ViTImageProcessor(image_mean=[0.4, 0.5, 0.6], image_std=[0.2, 0.25, 0.3])
    processor.save_pretrained(tmp_path / "hf")
    source = read_init_source(str(tmp_path / "hf"))
    assert (source.data_options["mean"], source.data_options["std"]) == ([0.4, 0.5, 0.6], [0.2, 0.25, 0.3])
    (tmp_path / "hf" / "preprocessor_config.json").write_text(json.dumps({"image_mean": 0.5, "image_std": [0.0]}))
    with pytest.raises(DataError, match="its std .* holds a value <= 0"):
        read_init_source(str(tmp_path / "hf"))


def test_evaluation_resizes_as_training_does(tmp_path: Path) -> None:
    """Images not of the model's size: validation resizes them bicubic, as the training crop does."""
    for label in ("a", "b"):
        (tmp_path / label).mkdir()
        for i in range(6):
            pixels = np.random.default_rng(i).integers(0, 256, (40, 40), dtype=np.uint8)
            Image.fromarray(pixels, mode="L").save(tmp_path / label / f"{i}.png")
    module = ImageDataModule(source="imagefolder", data_dir=str(tmp_path), image_size=28, patch_size=7, mean=[0.5],
                             std=[0.5], validation_size=4, test_size=4)
    module.setup()
    crop = module.datasets["train"].transform.transforms[0]
    assert crop.interpolation == transforms.InterpolationMode.BICUBIC
    row = module.data.splits["validation"][0]  # type: ignore[union-attr]
    reference = transforms.Compose([transforms.Resize(28, interpolation=transforms.InterpolationMode.BICUBIC),
                                    transforms.CenterCrop(28), transforms.ToTensor(), transforms.Normalize([0.5], [0.5])])
    torch.testing.assert_close(module.datasets["validation"][0][0], reference(row["image"].convert("L")))


@pytest.mark.parametrize("module", [ImageDataModule, ImageTextDataModule])
def test_image_data_modules_check_normalisation_alike(module: type[ImageDataModule | ImageTextDataModule]) -> None:
    """Both image data modules take their image settings from one base: a mean or std not one value a channel is one
    line naming the fix (data=image_text broadcast three means over packaged grey images before), and the default is 0.5."""
    with pytest.raises(ConfigError, match=r"data.mean and data.std need 1 values .* data.mean=\[0.5\] data.std=\[0.5\]"):
        module(in_channels=1, mean=[0.5, 0.5, 0.5], std=[0.5, 0.5, 0.5])
    assert (module(in_channels=3).mean, module(in_channels=3).std) == ([0.5] * 3, [0.5] * 3)
