"""Image classification with a Vision Transformer as a LightningModule."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from timm.data import Mixup
from torch import Tensor, nn
from torch.export import Dim
from torchmetrics.classification import MulticlassAccuracy, MulticlassConfusionMatrix

from trident.data.base import TridentDataModule
from trident.data.images import ImageDataModule
from trident.errors import ConfigError
from trident.models.properties import CHANNELS, IMAGE_SIZE, PATCH_SIZE, PIXEL_MEAN, PIXEL_STD, READOUT
from trident.models.vit import VisionTransformer, attention_rollout, vit_geometry
from trident.objectives import TRAIN, Outputs
from trident.parallel.fsdp import whole_weights
from trident.parallel.tensor_parallel import is_tensor_parallel
from trident.tasks.base import NetInput, TridentTask
from trident.tasks.class_head import ClassHead, publish_confusion
from trident.tasks.network_builders import vision_transformer
from trident.tasks.teacher import TEACHER, add_teacher, pixels_for_teacher, renormalised, taught, teacher_flops
from trident.tracking.figures import image_grid_figure, publish_figure, unnormalize
from trident.training.flops import vit_flops
from trident.training.optim import parameter_groups

Batch = tuple[Tensor, Tensor]


class ImageClassificationTask(ClassHead, TridentTask):
    NAME = "vit"
    SOURCE_SETTINGS = ("pool",)  # what its checkpoint fixes as init_from
    # The patch grid shapes the weights; the normalisation is what they were trained to see (the run may change it).
    SOURCE_DATA_SETTINGS = ("patch_size", "mean", "std")
    OUTSIDE_NETWORK = VisionTransformer  # Hugging Face's and timm's ViT
    FROM_NETWORK: ClassVar[dict[str, str]] = {READOUT: "task.pool", IMAGE_SIZE: "data.image_size", PATCH_SIZE: "data.patch_size",
                                              CHANNELS: "data.in_channels", PIXEL_MEAN: "data.mean", PIXEL_STD: "data.std"}
    VALIDATION_METRICS = ("val/loss", "val/acc", "val/acc_top5")
    DATA_MODULE: ClassVar[type[TridentDataModule]] = ImageDataModule
    NEEDS_TOKENIZER = False
    READS = "images"
    HEAD: ClassVar[tuple[str, ...]] = ("head.", "head_dist.")  # trains under finetune=lora: the class head and DeiT's distillation head
    STACK = "encoder"
    net: VisionTransformer

    def __init__(
        self,
        backbone: dict[str, Any],
        optimizer: dict[str, Any],
        scheduler: dict[str, Any],
        num_classes: int,
        image_size: int,
        in_channels: int,
        patch_size: int,
        class_names: list[str],
        mean: list[float],
        std: list[float],
        pool: str = "cls",
        label_smoothing: float = 0.0,
        mixup: dict[str, Any] | None = None,
        num_figure_images: int = 16,
        lora: dict[str, Any] | None = None,
        nf4: dict[str, Any] | None = None,
        objective: dict[str, Any] | None = None,
        distill: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(backbone, optimizer, scheduler, lora=lora, nf4=nf4, objective=objective)
        self.net = vision_transformer(self.backbone_config, patch_size=patch_size, in_channels=in_channels,
                                      num_classes=num_classes, pool=pool)
        self.class_names, self.mean, self.std = list(class_names), list(mean), list(std)
        self.num_figure_images = num_figure_images
        mixup = dict(mixup or {})
        self.mixup: Mixup | None = None
        if mixup.get("mixup_alpha", 0) > 0 or mixup.get("cutmix_alpha", 0) > 0:
            # Mixup/CutMix mix pairs of images and their (smoothed) one-hot labels: soft targets.
            self.mixup = Mixup(**mixup, label_smoothing=label_smoothing, num_classes=num_classes)
        self.objective = self.chosen_objective(label_smoothing=label_smoothing)
        record = add_teacher(self, distill, class_names=class_names)  # distill=kd: a frozen teacher of the same classes
        # A teacher trained on other pixel statistics (a timm ImageNet file teaching an MNIST student) sees the
        # student's pixels normalised by its own, as timm's distillation tasks feed it.
        self.teacher_pixels = pixels_for_teacher(record, in_channels, self.mean, self.std)
        top_k = min(5, num_classes)
        # micro: the fraction of images classified correctly (torchmetrics' default, macro, averages classes).
        self.val_top1 = MulticlassAccuracy(num_classes, top_k=1, average="micro")
        self.test_top1 = MulticlassAccuracy(num_classes, top_k=1, average="micro")
        self.val_top5 = MulticlassAccuracy(num_classes, top_k=top_k, average="micro")
        self.test_top5 = MulticlassAccuracy(num_classes, top_k=top_k, average="micro")
        self.test_confusion = MulticlassConfusionMatrix(num_classes)
        self._misclassified: list[tuple[Tensor, int, int]] = []

    @classmethod
    def backbone_geometry(cls, data: dict[str, Any], task: dict[str, Any],
                          model: dict[str, Any] | None = None) -> dict[str, Any]:
        """Grid, prefix (class token, distillation token) and sequence length follow from the data's image and patch
        size, the pooling and the model's distillation token."""
        return vit_geometry(int(data["image_size"]), int(data["patch_size"]), str(task.get("pool", "cls")),
                            bool((model or {}).get("distillation_token", False)))

    def forward(self, images: Tensor) -> Tensor:
        return self.net(images)

    def example_input(self) -> list[NetInput]:
        """Images of the size the position table was made for (fixed), any batch size."""
        conv, grid = self.net.patch_embed.proj, self.net.encoder.cfg.grid
        side = grid[0] * conv.kernel_size[0] if grid else 0
        images = torch.randn(2, conv.in_channels, side, side)  # (B, C, H, W)
        return [NetInput("images", "pixel_values", images, {0: Dim("batch", min=1)})]

    def throughput_units(self, batch: Batch) -> dict[str, int]:
        return {"images": batch[0].size(0)}

    def flops_per_batch(self, batch: Batch) -> int:
        """Model FLOPs of one training step on ``batch`` (forward and backward, for MFU), and the forward of its
        teacher (distill=kd: its own patches, classes and heads)."""
        hp, size = self.hparams, batch[0].size(0)

        def forward(teacher: nn.Module) -> int:
            patches = teacher.patch_embed.proj  # the (D, C, p, p) convolution
            return vit_flops(teacher.encoder.cfg, batch=size, patch_size=patches.kernel_size[0],
                             in_channels=patches.in_channels, num_classes=teacher.head.out_features, training=False)

        return vit_flops(self.net.encoder.cfg, batch=size, patch_size=hp.patch_size, in_channels=hp.in_channels,
                         num_classes=hp.num_classes) + teacher_flops(self, forward)

    def _inputs(self, batch: Batch, stage: str) -> Batch:
        """``batch``'s images and labels (B,); in training under Mixup / CutMix, the mixed images and their mixed
        (smoothed) labels, class probabilities (B, C)."""
        images, labels = batch
        if stage == TRAIN and self.mixup is not None:
            if images.size(0) % 2:
                raise ConfigError("mixup/cutmix need an even data.batch_size")
            images, labels = self.mixup(images, labels)
        return images, labels

    def outputs(self, batch: Batch, stage: str) -> Outputs:
        """The class logits (B, C) of ``batch``'s images (:meth:`_inputs`) and their labels: a distillation token's
        network gives its two heads' average, or in distilled training (a teacher) its class head's logits, its
        distillation head's being what the teacher's term trains. distill=kd: the teacher scores the same images."""
        images, labels = self._inputs(batch, stage)
        logits = self.net(images)
        logits, taught_logits = logits if isinstance(logits, tuple) else (logits, None)  # (B, C) each
        return taught(self, Outputs(logits.float(), labels), stage, lambda teacher: teacher(self._for_teacher(images)).float(),
                      None if taught_logits is None else taught_logits.float())

    def _for_teacher(self, images: Tensor) -> Tensor:
        """``images`` (B, C, H, W) as the teacher reads them: normalised by its own statistics."""
        if self.teacher_pixels is None:
            return images
        return renormalised(images, (self.mean, self.std), self.teacher_pixels)

    def on_fit_start(self) -> None:
        # DeiT: a teacher teaches the distillation token's head; without one, both heads learn the labels through
        # their average (timm's training and fine-tuning of a distilled ViT), as at inference.
        self.net.distilled_training = self.net.head_dist is not None and TEACHER in self.companions

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        # train/loss is logged once per optimizer step, over its global batch (TridentTask.on_before_optimizer_step).
        return self.trained(self.objective(self, batch, TRAIN)[0])

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        loss, outputs = self.objective(self, batch, "val")
        self.val_top1(outputs.logits, outputs.targets)
        self.val_top5(outputs.logits, outputs.targets)
        self.evaluated_loss("val", loss.summed, loss.count)
        self.log("val/acc", self.val_top1, prog_bar=True)
        self.log("val/acc_top5", self.val_top5)

    def test_step(self, batch: Batch, batch_idx: int) -> None:
        images = batch[0]
        loss, outputs = self.objective(self, batch, "test")
        logits, labels = outputs.logits, outputs.targets
        preds = logits.argmax(dim=-1)
        self.test_top1(logits, labels)
        self.test_top5(logits, labels)
        self.test_confusion(preds, labels)
        self.evaluated_loss("test", loss.summed, loss.count)
        self.log("test/acc", self.test_top1)
        self.log("test/acc_top5", self.test_top5)
        for k in torch.nonzero(preds != labels).flatten().tolist():
            if len(self._misclassified) < self.num_figure_images:
                self._misclassified.append((images[k].cpu(), int(labels[k]), int(preds[k])))
        if batch_idx == 0:
            self._attention_figure(images[: min(8, len(images))])

    def on_validation_epoch_end(self) -> None:
        self.log_epoch_loss("val")

    def on_test_epoch_end(self) -> None:
        self.log_epoch_loss("test")
        publish_confusion(self, self.test_confusion, self.class_names)
        if not self.trainer.is_global_zero:
            return
        if self._misclassified:
            images = unnormalize(torch.stack([m[0] for m in self._misclassified]), self.mean, self.std)
            titles = [f"{self.class_names[t]} -> {self.class_names[p]}" for _, t, p in self._misclassified]
            publish_figure(self, "test/misclassified", image_grid_figure(images, titles))
        self._misclassified.clear()

    def _attention_figure(self, images: Tensor) -> None:
        """Attention rollout of the class token (or the mean over patches) over the image."""
        if self.trainer.sanity_checking:
            return
        # Every rank enters: under FSDP, gathering rank 0's weights takes them all. Under tensor parallelism every
        # forward is collective: every rank runs it (each group on its own batch), rank 0 draws it.
        with whole_weights(self.net):
            if not (self.trainer.is_global_zero or is_tensor_parallel(self.net)):
                return
            logits, weights = self.net.forward_with_attention(images)
        if not self.trainer.is_global_zero:
            return
        rollout = attention_rollout(weights)  # (B, T, T)
        prefix = self.net.num_prefix_tokens
        grid = self.net.encoder.cfg.grid
        assert grid is not None
        source = rollout[:, 0, prefix:] if prefix else rollout[:, prefix:, prefix:].mean(dim=1)  # (B, N)
        maps = source.reshape(-1, 1, *grid)
        maps = nn.functional.interpolate(maps, size=images.shape[-2:], mode="bilinear", align_corners=False)[:, 0]
        maps = (maps - maps.amin(dim=(1, 2), keepdim=True)) / (maps.amax(dim=(1, 2), keepdim=True) - maps.amin(dim=(1, 2), keepdim=True) + 1e-8)
        titles = [f"pred {self.class_names[p]}" for p in logits.argmax(dim=-1).tolist()]
        fig = image_grid_figure(unnormalize(images, self.mean, self.std), titles, overlays=maps.float().cpu().numpy())
        publish_figure(self, "test/attention_rollout", fig)

    def parameter_groups(self, weight_decay: float) -> list[dict[str, Any]]:
        """Matrices decay; biases, norm gains, the class token and a learned position table not."""
        return parameter_groups(self.net, weight_decay, self.net.no_weight_decay())
