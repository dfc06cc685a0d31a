"""Review of DeiT's distillation token with distill=kd (issue 54 items 4 and 5): the cases the first tests left
out, each against timm's reference (timm.task.distillation's teacher normalisation, VisionTransformerDistilled)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import timm
import torch
from safetensors.torch import save_file
from timm.models._hub import save_for_hf

from trident.backbone import TransformerConfig
from trident.errors import ConfigError
from trident.models.vit import VisionTransformer, vit_geometry
from trident.objectives import TRAIN
from trident.runs.pipeline import build_data_and_task, check_config
from trident.tasks.teacher import TEACHER, TEACHER_RECORD
from trident.training.flops import vit_flops
from trident.weights.adapters.timm_vit import timm_to_trident
from trident.weights.transfer import transfer_weights

from .convert_helpers import randomise
from .test_distill_tasks import built, save_as_run
from .test_flops_mfu import counted_training_flops, tiny_cfg
from .test_vit_pipeline import vit_config

pytestmark = pytest.mark.usefixtures("single_thread")

#: The student's data (conf/data/mnist.yaml) and a teacher trained on other statistics (its timm config.json's).
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
TEACHER_MEAN, TEACHER_STD = 0.5, 0.25


def timm_teacher_directory(path: Path) -> torch.nn.Module:
    """A timm DeiT for 28-pixel single-channel images saved as timm saves it (config.json with its mean and std)."""
    teacher = timm.create_model("deit_tiny_distilled_patch16_224", pretrained=False, img_size=28, patch_size=7,
                                in_chans=1, embed_dim=64, depth=1, num_heads=1, num_classes=10)
    teacher = randomise(teacher, seed=4).eval()
    teacher.pretrained_cfg = {**teacher.pretrained_cfg, "mean": (TEACHER_MEAN,), "std": (TEACHER_STD,)}
    save_for_hf(teacher, str(path), safe_serialization=True)
    return teacher


def test_the_teacher_sees_the_pixels_normalised_by_its_own_statistics(tmp_path: Path) -> None:
    # timm's DistillationTeacher.normalize_input: the student's input, un-normalised by the student's statistics and
    # normalised by the teacher's (a teacher fed the student's normalisation scores other images).
    reference = timm_teacher_directory(tmp_path / "teacher")
    cfg = vit_config(tmp_path, "model.distillation_token=true", "augment=none", "distill=kd", "distill.divergence=hard",
                     f"distill.teacher={tmp_path / 'teacher'}")
    task = built(cfg, tmp_path / "run")
    assert list(cfg.data.mean) == [MNIST_MEAN]  # the student keeps its data's statistics
    task.on_fit_start()
    task.train()
    images = torch.randn(3, 1, 28, 28, generator=torch.Generator().manual_seed(5))  # normalised for the student
    outputs = task.outputs((images, torch.tensor([0, 1, 2])), TRAIN)
    pixels = images * MNIST_STD + MNIST_MEAN
    with torch.no_grad():
        expected = reference((pixels - TEACHER_MEAN) / TEACHER_STD)
    torch.testing.assert_close(outputs.teacher, expected, atol=1e-5, rtol=1e-5)
    assert isinstance(task.companions[TEACHER], torch.nn.Module)


def test_a_trident_run_teacher_keeps_its_own_statistics_and_the_students_own_need_no_change(tmp_path: Path) -> None:
    teacher_cfg = vit_config(tmp_path / "teacher_cfg", f"data.mean=[{TEACHER_MEAN}]", f"data.std=[{TEACHER_STD}]")
    teacher = save_as_run(build_data_and_task(teacher_cfg, check_config(teacher_cfg), "fit")[1], tmp_path / "teacher")
    cfg = vit_config(tmp_path, "distill=kd", f"distill.teacher={teacher}")
    task = built(cfg, tmp_path / "run")
    record = json.loads((tmp_path / "run" / TEACHER_RECORD).read_text())
    assert (record["mean"], record["std"]) == ([TEACHER_MEAN], [TEACHER_STD])
    assert task.teacher_pixels == ([TEACHER_MEAN], [TEACHER_STD])
    same = vit_config(tmp_path / "same", "distill=kd", f"distill.teacher={teacher}", f"data.mean=[{TEACHER_MEAN}]",
                      f"data.std=[{TEACHER_STD}]")
    assert built(same, tmp_path / "same" / "run").teacher_pixels is None  # the teacher reads the inputs as they are


def test_a_teacher_of_other_channels_is_refused_in_one_line(tmp_path: Path) -> None:
    # A bare timm file (no statistics beside it) of RGB images teaching an MNIST student.
    rgb = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=28, patch_size=7, in_chans=3,
                            embed_dim=64, depth=1, num_heads=1, num_classes=10)
    save_file(rgb.state_dict(), str(tmp_path / "rgb.safetensors"))
    cfg = vit_config(tmp_path, "distill=kd", f"distill.teacher={tmp_path / 'rgb.safetensors'}", "distill.n_heads=1")
    with pytest.raises(ConfigError, match=r"^distill.teacher=.*rgb.safetensors reads images of 3 channels, the student 1 "
                                          r"\(data.in_channels\): pass a teacher of the student's channels$") as caught:
        built(cfg, tmp_path / "run")
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("distilled_training", [False, True])
def test_a_deits_training_flops_count_both_heads(distilled_training: bool) -> None:
    # The throughput's FLOPs (MFU): a distilled ViT's step runs its two heads, in training as at inference.
    cfg = tiny_cfg("gelu", pos_encoding="learned", distillation_token=True,
                   **vit_geometry(16, 4, "cls", distillation_token=True))
    model = VisionTransformer(cfg, patch_size=4, in_channels=3, num_classes=10).train()
    model.distilled_training = distilled_training
    images = torch.randn(3, 3, 16, 16)

    def step() -> torch.Tensor:
        logits = model(images)
        return torch.cat(logits) if isinstance(logits, tuple) else logits

    expected = vit_flops(cfg, batch=3, patch_size=4, in_channels=3, num_classes=10)
    assert expected == counted_training_flops(step)


def test_init_from_a_deit_at_another_image_size_resamples_both_prefix_tokens_as_timm() -> None:
    # timm's deit checkpoint_filter_fn: resample_abs_pos_embed with num_prefix_tokens=2 (class and distillation rows
    # kept); the 56-pixel network then gives timm's logits.
    from timm.models.deit import checkpoint_filter_fn

    shape = {"patch_size": 7, "in_chans": 1, "embed_dim": 32, "depth": 1, "num_heads": 2, "num_classes": 5}
    small = randomise(timm.create_model("deit_tiny_distilled_patch16_224", pretrained=False, img_size=28, **shape),
                      seed=1).eval()
    large = timm.create_model("deit_tiny_distilled_patch16_224", pretrained=False, img_size=56, **shape).eval()
    large.load_state_dict(checkpoint_filter_fn(small.state_dict(), large))
    cfg = TransformerConfig(d_model=32, n_heads=2, n_layers=1, d_ff=128, dropout=0.0, norm_eps=1e-6,
                            pos_encoding="learned", distillation_token=True,
                            **vit_geometry(56, 7, "cls", distillation_token=True))
    net = VisionTransformer(cfg, patch_size=7, in_channels=1, num_classes=5).eval()
    rows = {row.group: row.note for row in transfer_weights(net, timm_to_trident(small.state_dict()), "deit")}
    assert rows["encoder.pos_encoding.embedding"] == "resampled 4x4 -> 8x8"
    images = torch.randn(2, 1, 56, 56, generator=torch.Generator().manual_seed(6)).double()
    with torch.no_grad():
        torch.testing.assert_close(net.double()(images), large.double()(images), atol=1e-6, rtol=0)
