"""DeiT's distillation token (issue 54 item 5): ``model.distillation_token=true`` for task=vit gives timm's
``VisionTransformerDistilled`` (its ``deit_*_distilled`` files read in with timm's logits in training and at inference,
and written back exactly), trains through the pipeline, and learns from a teacher by DeiT's hard distillation."""

from __future__ import annotations

import math
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
from trident.runs.lifecycle import prepare_networks
from trident.runs.pipeline import build_data_and_task, check_config
from trident.tasks.networks import converting_later
from trident.tasks.teacher import TEACHER
from trident.tasks.vit import ImageClassificationTask
from trident.weights import read_pretrained
from trident.weights.adapters.hf_export import to_transformers
from trident.weights.adapters.timm_vit import timm_to_trident, trident_to_timm
from trident.weights.init_from import settings_fixed_by, source_for_run
from trident.weights.transfer import transfer_weights

from .conftest import compose_config, one_step
from .convert_helpers import net_from, randomise
from .test_distill_tasks import built, train_steps
from .test_vit_pipeline import VIT_SMALL, vit_config

pytestmark = pytest.mark.usefixtures("single_thread")


def timm_deit(**settings: object) -> torch.nn.Module:
    """timm's deit_tiny_distilled_patch16_224 (``settings`` over its shape), every parameter random: the class and
    distillation tokens, the position table, the norms, the biases and both heads."""
    model = timm.create_model("deit_tiny_distilled_patch16_224", pretrained=False, **settings)
    return randomise(model, seed=2).eval()


def assert_same_logits_in_training_and_at_inference(net: torch.nn.Module, reference: torch.nn.Module,
                                                    images: torch.Tensor) -> None:
    """Eval: the heads' average; training with distillation on: (class, distillation) logits. float64, so the
    comparison holds on every CPU whatever order each library sums in."""
    net, reference, images = net.double(), reference.double(), images.double()
    with torch.no_grad():
        torch.testing.assert_close(net.eval()(images), reference.eval()(images), atol=1e-5, rtol=0)
        reference.train().set_distilled_training(True)
        net.train().distilled_training = True
        ours, theirs = net(images), reference(images)
    assert isinstance(ours, tuple) and len(ours) == 2
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    assert not torch.allclose(ours[0], ours[1]), "the two heads read two tokens"


@pytest.mark.parametrize("saved", ["safetensors file", "timm directory"])
def test_timm_deit_tiny_distilled_gives_timms_logits_and_is_written_back_exactly(tmp_path: Path, saved: str) -> None:
    # The whole deit_tiny once; timm's directory, whose config.json names the architecture, of 2 of its 12 blocks.
    reference = timm_deit(num_classes=10, **({} if saved == "safetensors file" else {"depth": 2}))
    if saved == "safetensors file":  # nothing records the heads: model.n_heads= states them
        save_file(reference.state_dict(), str(tmp_path / "deit.safetensors"))
        weights = read_pretrained(tmp_path / "deit.safetensors", n_heads=3)
    else:  # timm's save_pretrained: config.json names the architecture, whose heads are 3
        save_for_hf(reference, str(tmp_path), safe_serialization=True)
        weights = read_pretrained(tmp_path)
    assert (weights.format, weights.classes, weights.model["n_heads"]) == ("timm-vit", 10, 3)
    assert weights.model["distillation_token"] is True
    assert weights.data_options == {"image_size": 224, "patch_size": 16, "in_channels": 3}
    net = net_from(weights)
    assert net.num_prefix_tokens == 2 and net.encoder.pos_encoding.embedding.weight.shape == (198, 192)
    written = trident_to_timm(net.state_dict())
    assert written.keys() == reference.state_dict().keys()
    assert all(torch.equal(written[name], tensor) for name, tensor in reference.state_dict().items())
    images = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(3))
    assert_same_logits_in_training_and_at_inference(net, reference, images)


def test_a_trident_deit_loads_into_timm_strictly() -> None:
    cfg = TransformerConfig(d_model=32, n_heads=2, n_layers=2, d_ff=48, dropout=0.0, norm_eps=1e-6, pos_encoding="learned",
                            distillation_token=True, **vit_geometry(24, 6, "cls", distillation_token=True))
    net = randomise(VisionTransformer(cfg, patch_size=6, in_channels=3, num_classes=7), seed=5)
    reference = timm.create_model("deit_tiny_distilled_patch16_224", pretrained=False, img_size=24, patch_size=6,
                                  embed_dim=32, depth=2, num_heads=2, mlp_ratio=48 / 32, num_classes=7)
    reference.load_state_dict(trident_to_timm(net.state_dict()), strict=True)
    assert_same_logits_in_training_and_at_inference(net, reference, torch.randn(3, 3, 24, 24))


def test_distill_hard_through_the_token_equals_timms_token_distillation_task(tmp_path: Path) -> None:
    # DeiT's hard distillation: distill=kd, divergence hard, weight 0.5, through the distillation token; timm's
    # TokenDistillationTask, hard, the task's loss weighted 0.5 (then the teacher's is too).
    from timm.task.token_distillation import TokenDistillationTask

    shape = {"img_size": 28, "patch_size": 7, "in_chans": 1, "embed_dim": 64, "num_heads": 1, "num_classes": 10}
    student = timm_deit(depth=2, **shape)
    # A deit teacher: its pixel statistics are the student's, which timm's task would otherwise renormalise to.
    teacher = randomise(timm.create_model("deit_tiny_patch16_224", pretrained=False, depth=1, **shape), seed=3).eval()
    save_file(teacher.state_dict(), str(tmp_path / "teacher.safetensors"))
    cfg = compose_config([*VIT_SMALL, "model.distillation_token=true", "model.n_heads=1", "augment=none", "distill=kd",
                          f"distill.teacher={tmp_path / 'teacher.safetensors'}", "distill.n_heads=1",
                          "distill.divergence=hard", "distill.weight=0.5"], output_dir=tmp_path / "run")
    task = built(cfg, tmp_path / "run")
    task.net.load_state_dict(timm_to_trident(student.state_dict()), strict=True)
    task.on_fit_start()
    task.train()
    images, labels = torch.randn(4, 1, 28, 28, generator=torch.Generator().manual_seed(3)), torch.tensor([0, 1, 2, 9])
    ours = task.objective(task, (images, labels), TRAIN)[0]
    theirs = TokenDistillationTask(student, teacher, criterion=torch.nn.CrossEntropyLoss(), distill_type="hard",
                                   task_loss_weight=0.5, verbose=False).train()(images, labels)
    torch.testing.assert_close(ours.summed / 4, theirs["loss"].detach(), atol=1e-5, rtol=1e-5)


def test_init_from_a_timm_deit_file_fixes_the_token_and_gives_timms_logits(tmp_path: Path) -> None:
    reference = timm_deit(img_size=28, patch_size=7, in_chans=1, num_classes=10, embed_dim=64, depth=2, num_heads=1)
    torch.save(reference.state_dict(), tmp_path / "deit.pth")  # what timm users save
    overrides = [o for o in VIT_SMALL if o not in ("model=nano", "data.patch_size=7")]
    # Dropout is the run's own (timm's deit has none): off, training compares too.
    cfg = compose_config([*overrides, f"init_from={tmp_path / 'deit.pth'}", "model.n_heads=1", "model.dropout=0.0",
                          "logger=none"],
                         output_dir=tmp_path / "run")
    assert cfg.model.distillation_token is False  # the default, before the source is read
    source = source_for_run(ImageClassificationTask, cfg, tmp_path / "run", None, False)
    assert cfg.model.distillation_token is True and cfg.data.patch_size == 7
    backbone = check_config(cfg)
    assert (backbone.distillation_token, backbone.num_prefix_tokens) == (True, 2)
    with converting_later():
        _, task = build_data_and_task(cfg, backbone, "fit")
    rows = prepare_networks(task, cfg, source, None, False, False, False)
    assert rows is not None and {row.outcome for row in rows} == {"loaded"}
    images = torch.randn(2, 1, 28, 28, generator=torch.Generator().manual_seed(3))
    assert_same_logits_in_training_and_at_inference(task.net, reference, images)


def test_a_deit_of_other_classes_fine_tunes_with_both_heads_rebuilt_and_both_train_under_lora(tmp_path: Path) -> None:
    save_file(timm_deit(img_size=24, patch_size=6, embed_dim=32, depth=1, num_heads=2, num_classes=5).state_dict(),
              str(tmp_path / "deit.safetensors"))
    weights = read_pretrained(tmp_path / "deit.safetensors", n_heads=2)
    backbone = {**weights.model, "pos_encoding": "learned", "dropout": 0.0,
                **ImageClassificationTask.backbone_geometry({"image_size": 24, "patch_size": 6}, {}, weights.model)}
    images = {"image_size": 24, "in_channels": 3, "patch_size": 6, "mean": [0.5] * 3, "std": [0.5] * 3}
    task = ImageClassificationTask(backbone, {}, {}, num_classes=3, class_names=list("abc"), **images)
    rows = {row.group: (row.outcome, row.note) for row in transfer_weights(task.net, weights.state_dict, "deit")}
    assert rows["head"] == rows["head_dist"] == ("new", "rebuilt: 5 outputs there, 3 here")
    assert rows["dist_token"][0] == rows["cls_token"][0] == "loaded"
    same = ImageClassificationTask(backbone, {}, {}, num_classes=5, class_names=list("abcde"), **images)
    anew = transfer_weights(same.net, weights.state_dict, "deit", new_head=True)
    assert {row.group for row in anew if row.outcome == "new"} == {"head", "head_dist"}
    # finetune=lora: the adapters and the task's heads train, both of them; the rest is frozen.
    tuned = ImageClassificationTask(backbone, {}, {}, num_classes=3, class_names=list("abc"), **images,
                                    lora={"rank": 2, "alpha": 4.0, "dropout": 0.0, "targets": ["qkv_proj"]})
    trained = {name for name, param in tuned.net.named_parameters() if param.requires_grad}
    assert {"head.weight", "head_dist.weight"} <= trained and "dist_token" not in trained


def test_a_source_without_the_token_refuses_it_in_one_line(tmp_path: Path) -> None:
    plain = randomise(timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=28, patch_size=7, in_chans=1,
                                        num_classes=10, embed_dim=64, depth=1, num_heads=1), seed=1)
    save_file(plain.state_dict(), str(tmp_path / "vit.safetensors"))
    source = read_pretrained(tmp_path / "vit.safetensors", n_heads=1)
    assert source.model["distillation_token"] is False
    cfg = vit_config(tmp_path, "model.distillation_token=true")
    with pytest.raises(ConfigError, match=r"^model.distillation_token=True contradicts init_from=.*vit.safetensors, which "
                                          r"has model.distillation_token=False: drop that override") as caught:
        settings_fixed_by(cfg, source, ["model.distillation_token"])
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(("overrides", "message"), [
    (["task.pool=mean"], (r"^model.distillation_token=true needs task.pool=cls .*: set task.pool=cls or "
                         r"model.distillation_token=false$")),
    (["task=lm", "model=nano"], (r"^model.distillation_token=true is DeiT's distillation token, which only a ViT's "
                                r"image stack has: use it with task=vit")),
    (["task=classify", "model=nano"], r"^model.distillation_token=true is DeiT's"),
    (["task=translation", "model=nano"], r"^model.distillation_token=true is DeiT's"),
    (["task=clip", "model=nano"], r"^model.distillation_token=true is DeiT's"),
])
def test_the_token_is_refused_where_it_has_no_meaning(tmp_path: Path, overrides: list[str], message: str) -> None:
    base = VIT_SMALL if overrides[0].startswith("task.") else []
    cfg = compose_config([*base, *overrides, "model.distillation_token=true"], output_dir=tmp_path / "run")
    with pytest.raises(ConfigError, match=message) as caught:
        check_config(cfg)
    assert "\n" not in str(caught.value)


def test_clips_image_tower_and_the_hf_export_refuse_the_token(tmp_path: Path) -> None:
    cfg = compose_config(["task=clip", "model=nano", "+task.image.distillation_token=true"], output_dir=tmp_path / "run")
    with pytest.raises(ConfigError, match=r"^task.image.distillation_token is not a model setting of the image tower"):
        check_config(cfg)
    net = VisionTransformer(TransformerConfig(d_model=32, n_heads=2, n_layers=1, d_ff=48, pos_encoding="learned",
                                              distillation_token=True, **vit_geometry(8, 4, "cls", distillation_token=True)),
                            patch_size=4, in_channels=1, num_classes=3)
    with pytest.raises(ConfigError, match=r"^model.distillation_token=True has no ViT \(hf export\) equivalent"):
        to_transformers(net)


def test_the_token_trains_a_step_through_the_pipeline_without_a_teacher(tmp_path: Path) -> None:
    # timm's training of a distilled ViT without a teacher: both heads learn the labels through their average.
    metrics = one_step(vit_config(tmp_path, "model.distillation_token=true"))
    assert math.isfinite(metrics["train/loss"]) and 0.0 <= metrics["val/acc"] <= 1.0
    assert "train/distillation_loss" not in metrics


def test_a_teacher_teaches_the_distillation_head_through_the_pipeline(tmp_path: Path) -> None:
    # The teacher a DeiT itself (timm's file): its two heads' average teaches.
    teacher = timm_deit(img_size=28, patch_size=7, in_chans=1, embed_dim=64, depth=1, num_heads=1, num_classes=10)
    save_file(teacher.state_dict(), str(tmp_path / "teacher.safetensors"))
    cfg = vit_config(tmp_path, "model.distillation_token=true", "distill=kd", "distill.divergence=hard",
                     f"distill.teacher={tmp_path / 'teacher.safetensors'}", "distill.n_heads=1")
    task, metrics, before = train_steps(cfg, tmp_path / "run", steps=1)
    assert task.net.distilled_training
    images = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        torch.testing.assert_close(task.companions[TEACHER](images), teacher(images), atol=1e-5, rtol=1e-5)
    assert metrics["train/loss"] == pytest.approx(0.5 * metrics["train/label_loss"] + 0.5 * metrics["train/distill_loss"],
                                                  rel=1e-5)
    assert all(torch.equal(before[name], tensor) for name, tensor in task.companions[TEACHER].state_dict().items())
