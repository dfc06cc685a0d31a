"""DeiT's distillation token (issue 54 item 5): ``model.distillation_token=true`` for task=vit gives timm's
``VisionTransformerDistilled`` (its ``deit_*_distilled`` files read in with timm's logits in training and at inference,
and written back exactly), trains through the pipeline, and learns from a teacher by DeiT's hard distillation."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import timm
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from timm.models._hub import save_for_hf

from trident.backbone import TransformerConfig
from trident.errors import ConfigError
from trident.models.vit import VisionTransformer, vit_geometry
from trident.objectives.distillation_token import hard_distillation
from trident.runs.lifecycle import prepare_networks
from trident.runs.pipeline import build_data_and_task, build_trainer, check_config
from trident.tasks.networks import converting_later
from trident.tasks.vit import TEACHER, ImageClassificationTask
from trident.weights import read_pretrained
from trident.weights.adapters.hf_export import to_transformers
from trident.weights.adapters.timm_vit import trident_to_timm
from trident.weights.init_from import settings_fixed_by, source_for_run
from trident.weights.transfer import transfer_weights

from .conftest import compose_config, one_step
from .convert_helpers import net_from, randomise
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


def cross_entropy_by_hand(logits: list[float], target: int | list[float]) -> float:
    """-sum_c q_c log softmax(logits)_c, with q one-hot at ``target`` or the probabilities ``target``."""
    log_z = math.log(sum(math.exp(v) for v in logits))
    q = [float(c == target) for c in range(len(logits))] if isinstance(target, int) else target
    return -sum(qc * (v - log_z) for qc, v in zip(q, logits, strict=True))


def test_hard_distillation_equals_a_hand_computation() -> None:
    cls = [[2.0, 0.5, -1.0], [0.0, 1.0, 3.0]]
    dist = [[0.3, -0.2, 1.5], [1.0, 0.0, -0.5]]
    teacher = [[0.1, 4.0, 0.2], [5.0, 1.0, 0.0]]  # argmax 1, 0: not the labels
    labels = [0, 2]
    loss = hard_distillation(torch.tensor(cls), torch.tensor(dist), torch.tensor(labels), torch.tensor(teacher))
    class_half = (cross_entropy_by_hand(cls[0], 0) + cross_entropy_by_hand(cls[1], 2)) / 2
    teacher_half = (cross_entropy_by_hand(dist[0], 1) + cross_entropy_by_hand(dist[1], 0)) / 2
    assert float(loss.summed) == pytest.approx(2 * (0.5 * class_half + 0.5 * teacher_half), rel=1e-6)
    assert int(loss.count) == 2
    assert float(loss.parts["class_loss"][0]) == pytest.approx(class_half, rel=1e-6)
    assert float(loss.parts["distillation_loss"][0]) == pytest.approx(teacher_half, rel=1e-6)
    # Label smoothing (0.1 over 3 classes) smooths the labels only; Mixup's class probabilities are read as they are.
    smoothed = hard_distillation(torch.tensor(cls), torch.tensor(dist), torch.tensor(labels), torch.tensor(teacher),
                                 label_smoothing=0.1)
    smooth = [[0.1 / 3 + 0.9 * (c == label) for c in range(3)] for label in labels]
    smooth_half = (cross_entropy_by_hand(cls[0], smooth[0]) + cross_entropy_by_hand(cls[1], smooth[1])) / 2
    assert float(smoothed.summed) == pytest.approx(2 * (0.5 * smooth_half + 0.5 * teacher_half), rel=1e-6)
    mixed = [[0.7, 0.3, 0.0], [0.0, 0.4, 0.6]]
    soft = hard_distillation(torch.tensor(cls), torch.tensor(dist), torch.tensor(mixed), torch.tensor(teacher))
    mixed_half = (cross_entropy_by_hand(cls[0], mixed[0]) + cross_entropy_by_hand(cls[1], mixed[1])) / 2
    assert float(soft.summed) == pytest.approx(2 * (0.5 * mixed_half + 0.5 * teacher_half), rel=1e-6)


def test_the_tasks_distilled_loss_equals_timms_token_distillation_task(tmp_path: Path) -> None:
    # timm's TokenDistillationTask, hard, the task's loss weighted 0.5 (then the teacher's is too): DeiT's.
    from timm.task.token_distillation import TokenDistillationTask

    shape = {"img_size": 24, "patch_size": 6, "embed_dim": 32, "num_heads": 2, "num_classes": 5}
    student = timm_deit(depth=2, **shape)
    # A deit teacher: its pixel statistics are the student's, which timm's task would otherwise renormalise to.
    teacher = randomise(timm.create_model("deit_tiny_patch16_224", pretrained=False, depth=1, **shape), seed=3)
    save_file(student.state_dict(), str(tmp_path / "student.safetensors"))
    save_file(teacher.state_dict(), str(tmp_path / "teacher.safetensors"))
    weights = read_pretrained(tmp_path / "student.safetensors", n_heads=2)
    backbone = {**weights.model, "pos_encoding": "learned", "dropout": 0.0,
                **ImageClassificationTask.backbone_geometry({"image_size": 24, "patch_size": 6}, {}, weights.model)}
    task = ImageClassificationTask(backbone, optimizer={}, scheduler={}, num_classes=5, image_size=24, in_channels=3,
                                   patch_size=6, class_names=list("abcde"), mean=[0.5] * 3, std=[0.5] * 3)
    task.net.load_state_dict(weights.state_dict, strict=True)
    task.companions[TEACHER] = net_from(read_pretrained(tmp_path / "teacher.safetensors", n_heads=2))
    task.on_fit_start()
    task.train()
    images, labels = torch.randn(4, 3, 24, 24, generator=torch.Generator().manual_seed(3)), torch.tensor([0, 1, 2, 4])
    ours = task.distilled((images, labels))
    theirs = TokenDistillationTask(student, teacher, criterion=torch.nn.CrossEntropyLoss(), distill_type="hard",
                                   task_loss_weight=0.5, verbose=False).train()(images, labels)
    torch.testing.assert_close(ours.summed / 4, theirs["loss"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.parts["distillation_loss"][0], theirs["distill_loss"].detach(), atol=1e-5, rtol=1e-5)


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
    cfg = vit_config(tmp_path, "model.distillation_token=true", "trainer.limit_train_batches=1", "trainer.max_epochs=1")
    datamodule, task = build_data_and_task(cfg, check_config(cfg), "fit")
    teacher = randomise(VisionTransformer(task.backbone_config, patch_size=7, in_channels=1, num_classes=10), seed=7)
    teacher.eval().requires_grad_(False)
    task.companions[TEACHER] = teacher  # what distill.teacher's companion holds
    before = {name: tensor.clone() for name, tensor in teacher.state_dict().items()}
    head_dist = task.net.head_dist.weight.detach().clone()
    # The loss of a batch: half the class head's cross entropy on the labels, half the distillation head's on the
    # teacher's argmax, both read off the encoder's two prefix tokens.
    task.on_fit_start()
    task.train()
    images, labels = torch.randn(4, 1, 28, 28), torch.tensor([1, 2, 3, 4])
    loss = task.distilled((images, labels))
    features = task.net.forward_features(images)
    taught = teacher(images).argmax(dim=-1)
    expected = (0.5 * F.cross_entropy(task.net.head(features[:, 0]), labels, label_smoothing=0.1)
                + 0.5 * F.cross_entropy(task.net.head_dist(features[:, 1]), taught))
    torch.testing.assert_close(loss.summed / 4, expected)
    trainer = build_trainer(cfg.trainer, max_steps=1, max_epochs=1, limit_val_batches=1, num_sanity_val_steps=0,
                            logger=False, enable_checkpointing=False, callbacks=[], enable_progress_bar=False,
                            enable_model_summary=False)
    trainer.fit(task, datamodule=datamodule)
    assert {"train/loss", "train/class_loss", "train/distillation_loss"} <= trainer.callback_metrics.keys()
    assert all(torch.equal(before[name], tensor) for name, tensor in teacher.state_dict().items())
    assert not torch.equal(task.net.head_dist.weight, head_dist), "the distillation head trained"
