"""task=vit through train.py's pipeline: precisions, image encodings, augmentation, data sources, figures."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from trident.data.image_sources import load_image_source, read_idx
from trident.errors import ConfigError, DataError
from trident.runs.pipeline import check_config, train
from trident.tracking.wandb_files import wait_for_offline_runs

from .conftest import compose_config, one_step

VIT_SMALL = [
    "task=vit", "model=nano", "data.patch_size=7", "data.batch_size=16", "trainer.max_epochs=1",
    "trainer.limit_train_batches=3", "trainer.limit_val_batches=1", "trainer.limit_test_batches=1",
    "trainer.num_sanity_val_steps=0", "trainer.log_every_n_steps=1", "print_config=false",
    "callbacks.progress_bar=null", "callbacks.model_summary=null",
]


def vit_config(tmp_path: Path, *overrides: str):
    return compose_config([*VIT_SMALL, *overrides], output_dir=tmp_path / "run")


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_one_step_in_each_precision(precision: str, tmp_path: Path) -> None:
    metrics = one_step(vit_config(tmp_path, f"precision={precision}"))
    assert np.isfinite(metrics["train/loss"]) and 0.0 <= metrics["val/acc"] <= 1.0


@pytest.mark.parametrize("encoding", ["learned", "sinusoidal", "rope", "none"])
def test_one_step_with_each_image_encoding(encoding: str, tmp_path: Path) -> None:
    metrics = one_step(vit_config(tmp_path, f"pos_encoding={encoding}", "task.pool=mean"))
    assert np.isfinite(metrics["val/loss"]) and "val/acc_top5" in metrics


@pytest.mark.parametrize("encoding", ["alibi", "relative"])
def test_one_dimensional_encodings_fail_at_config_time(encoding: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"pos_encoding={encoding} measures 1-D distances"):
        check_config(vit_config(tmp_path, f"pos_encoding={encoding}"))


def test_patch_size_not_dividing_the_image_fails_at_config_time(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="patch size 5 does not divide image size 28"):
        check_config(vit_config(tmp_path, "data.patch_size=5"))


@pytest.mark.parametrize("augment", ["randaugment", "trivialaugment", "mixup", "none"])
def test_each_augmentation_preset_trains(augment: str, tmp_path: Path) -> None:
    metrics = one_step(vit_config(tmp_path, f"augment={augment}"))
    assert np.isfinite(metrics["train/loss"])


def test_run_logs_accuracy_and_figures_to_wandb(tmp_path: Path) -> None:
    metrics = train(vit_config(tmp_path, "callbacks.throughput.window=1"))
    run_dir = tmp_path / "run"
    for name in ("confusion_matrix", "misclassified", "attention_rollout"):
        assert (run_dir / "figures" / f"test_{name}.png").stat().st_size > 1000
    (run,) = wait_for_offline_runs(run_dir)
    assert run.summary["test/acc"] == pytest.approx(metrics["test/acc"])
    logged = {k.split("/")[0] + "/" + k.split("/")[1] for row in run.history for k in row if k.startswith("test/")}
    assert {"test/confusion_matrix", "test/attention_rollout", "test/acc_top5", "test/acc", "test/loss"} <= logged
    assert {"val/acc", "val/acc_top5", "val/loss"} <= set(metrics)
    assert run.metric("train/loss") and all(v > 0 for v in run.metric("throughput/images_per_sec"))
    assert run.metric("throughput/images_per_sec"), "images/s logged by the Throughput callback"
    assert (run_dir / "classes.json").read_text().startswith('["0"')


def write_idx(path: Path, array: np.ndarray) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(n).to_bytes(4, "big") for n in array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def test_fashion_mnist_reads_any_folder_of_idx_files(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    write_idx(tmp_path / "train-images-idx3-ubyte.gz", rng.integers(0, 255, (30, 28, 28)))
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", np.arange(30) % 10)
    write_idx(tmp_path / "t10k-images-idx3-ubyte.gz", rng.integers(0, 255, (8, 28, 28)))
    write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", np.arange(8) % 10)
    assert read_idx(tmp_path / "t10k-labels-idx1-ubyte.gz").tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1][:8]
    data = load_image_source("fashion_mnist", {"data_dir": str(tmp_path), "validation_size": 5, "test_size": 0, "split_seed": 0})
    sizes = {name: len(split[1]) for name, split in data.splits.items()}
    assert sizes == {"train": 25, "validation": 5, "test": 8} and data.class_names[9] == "Ankle boot"
    with pytest.raises(DataError, match="apt-get install dataset-fashion-mnist"):
        load_image_source("fashion_mnist", {"data_dir": str(tmp_path / "nope"), "validation_size": 5, "test_size": 0, "split_seed": 0})


def test_imagefolder_goes_through_datasets_load_dataset(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    for label in ("cat", "dog"):
        (tmp_path / "pets" / label).mkdir(parents=True)
        for i in range(12):
            Image.fromarray(rng.integers(0, 255, (20, 20, 3), dtype=np.uint8)).save(tmp_path / "pets" / label / f"{i}.png")
    metrics = train(vit_config(
        tmp_path, "data=imagefolder", f"data.data_dir={tmp_path / 'pets'}", "data.image_size=16", "data.patch_size=4",
        "data.validation_size=4", "data.batch_size=4", "logger=none", "debug=fast_dev_run",
    ))
    assert 0.0 <= metrics["test/acc"] <= 1.0
    with pytest.raises(DataError, match="image folder"):
        load_image_source("imagefolder", {"data_dir": str(tmp_path / "none"), "validation_size": 1, "test_size": 0, "split_seed": 0})


def test_mnist_5k_splits_are_disjoint_and_real() -> None:
    data = load_image_source("mnist_5k", {"validation_size": 500, "test_size": 500, "split_seed": 0})
    train_x, val_x, test_x = (data.splits[s][0] for s in ("train", "validation", "test"))
    assert (len(train_x), len(val_x), len(test_x)) == (4000, 500, 500)
    seen = {x.tobytes() for x in train_x}
    assert not any(x.tobytes() in seen for x in test_x)
    assert set(np.unique(data.splits["test"][1])) == set(range(10))


def test_real_fashion_mnist_when_installed() -> None:
    if not Path("/usr/share/datasets/fashion-mnist").is_dir():
        pytest.skip("Debian package dataset-fashion-mnist not installed (.ci/run installs it)")
    data = load_image_source("fashion_mnist", {"validation_size": 5000, "test_size": 10000, "split_seed": 0})
    assert {n: len(s[1]) for n, s in data.splits.items()} == {"train": 55000, "validation": 5000, "test": 10000}


def test_unaugmented_arrays_take_the_tensor_path_with_the_same_pixels() -> None:
    from trident.data.images import ImageDataModule, NormalizedArrays, eval_transform

    module = ImageDataModule(patch_size=7, mean=[0.1307], std=[0.3081], augment={"scale": [1.0, 1.0]})
    module.setup()
    assert isinstance(module.datasets["validation"], NormalizedArrays)
    assert isinstance(module.datasets["train"], NormalizedArrays)  # augment=none: nothing to do per image
    images, labels = module.data.splits["validation"]  # type: ignore[union-attr, misc]
    reference = eval_transform(28, [0.1307], [0.3081])
    for i in (0, 7, 499):
        image, label = module.datasets["validation"][i]
        np.testing.assert_allclose(image.numpy(), reference(Image.fromarray(images[i])).numpy(), rtol=1e-6, atol=1e-6)
        assert label == labels[i]


def test_init_from_loads_timm_weights_through_the_pipeline(tmp_path: Path) -> None:
    import torch
    from timm.models.vision_transformer import VisionTransformer as TimmViT

    import trident

    reference = TimmViT(img_size=28, patch_size=7, in_chans=1, num_classes=10, embed_dim=64, depth=2, num_heads=1)
    weights = tmp_path / "timm_vit.pth"
    torch.save(reference.state_dict(), weights)
    # Sizes, patch size and norm eps come from the file: no model.* or data.patch_size on the command line.
    overrides = [o for o in VIT_SMALL if o not in ("model=nano", "data.patch_size=7")]
    train(compose_config([*overrides, f"init_from={weights}", "logger=none", "test=false", "trainer.limit_train_batches=1",
                          "optimizer.lr=1e-30"], output_dir=tmp_path / "run"))
    task = trident.load(tmp_path / "run")
    assert (task.hparams.patch_size, task.net.encoder.cfg.d_model, task.net.encoder.cfg.norm_eps) == (7, 64, 1e-6)
    torch.testing.assert_close(task.net.patch_embed.proj.weight, reference.patch_embed.proj.weight)
    (tmp_path / "bad.pth").write_text("garbage")
    with pytest.raises(DataError, match="bad.pth"):
        train(vit_config(tmp_path, f"init_from={tmp_path / 'bad.pth'}", "logger=none", "debug=fast_dev_run"))
    with pytest.raises(ConfigError, match="model.pretrained was replaced by init_from"):
        train(vit_config(tmp_path, f"+model.pretrained={weights}", "logger=none", "debug=fast_dev_run"))


def test_headline_command_composes_vit_base_on_the_default_data(tmp_path: Path) -> None:
    cfg = vit_config(tmp_path, "model=base")
    backbone = check_config(cfg)
    assert (backbone.d_model, backbone.n_layers, backbone.n_heads) == (768, 12, 12)
    assert backbone.grid == (4, 4)  # 28x28 digits with the test's 7x7 patches
