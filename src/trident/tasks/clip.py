"""Contrastive image-text training (task=clip, CLIP: Radford et al. 2021) as a LightningModule: a text tower and an
image tower (trident.models.clip), the symmetric contrastive loss over the global batch (objective=contrastive), and
as validation and test metrics zero-shot classification by class names and prompt templates and retrieval
recall@1/5/10 both ways."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.export import Dim

from trident.data.base import TridentDataModule, WeightsSource
from trident.data.image_text import ImageTextDataModule, caption_ids
from trident.errors import ConfigError
from trident.models import properties
from trident.models.clip import CLIP, MAX_LOGIT_SCALE
from trident.objectives import TRAIN
from trident.objectives.contrastive import PairedFeatures, paired_features
from trident.tasks.base import NetInput, TridentTask
from trident.tasks.network_builders import check_tower_keys, clip
from trident.training.flops import stack_flops, vit_flops
from trident.training.optim import parameter_groups

if TYPE_CHECKING:
    from omegaconf import DictConfig

Batch = tuple[Tensor, Tensor, Tensor]  # images (B, C, H, W), caption ids (B, T), class labels (B,) (-1: none)
#: The recall@k of retrieval, both ways.
RECALL_AT = (1, 5, 10)
DIRECTIONS = ("image_to_text", "text_to_image")


def recall_at(similarity: Tensor, k: int) -> float:
    """The share of rows of ``similarity`` (N queries, N candidates, the match of query i at column i) whose match is
    among their ``k`` highest-scoring candidates (open_clip's retrieval metric)."""
    top = similarity.topk(min(k, similarity.size(1)), dim=1).indices  # (N, k)
    return float((top == torch.arange(similarity.size(0), device=top.device)[:, None]).any(dim=1).float().mean())


def same_setting(a: Any, b: Any) -> bool:
    """Whether two settings are equal, a number whatever its type (4 and 4.0)."""
    numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in (a, b))
    return float(a) == float(b) if numbers else bool(a == b)


def zero_shot_classifier(net: CLIP, prompts: Tensor) -> Tensor:
    """(C, K, T) ids of K templates filled with each of C class names -> (C, E): each class's normalised mean of its
    normalised prompt features (open_clip's ``build_zero_shot_classifier``)."""
    classes, templates, length = prompts.shape
    features = F.normalize(net.encode_text(prompts.reshape(classes * templates, length)), dim=-1)
    return F.normalize(features.reshape(classes, templates, -1).mean(dim=1), dim=-1)


class ContrastiveImageTextTask(TridentTask):
    NAME = "clip"
    # What a checkpoint of this task fixes as init_from: the projection and the towers' settings, the image geometry and
    # statistics (its context: the backbone's max_seq_len, which the data reads as data.max_length).
    SOURCE_SETTINGS = ("embed_dim", "text", "image")
    SOURCE_DATA_SETTINGS = ("image_size", "patch_size", "in_channels", "mean", "std")
    OUTSIDE_NETWORK = CLIP  # transformers' CLIPModel, open_clip's OpenAI layout
    # The text tower's context is its captions' token length (data.max_length); the backbone is the text tower.
    FROM_NETWORK: ClassVar[dict[str, str]] = {
        properties.PROJECTION_DIM: "task.embed_dim", properties.TEXT_TOWER: "task.text",
        properties.IMAGE_TOWER: "task.image", properties.END_OF_TEXT: "task.eos_id",
        properties.IMAGE_SIZE: "data.image_size", properties.PATCH_SIZE: "data.patch_size",
        properties.CHANNELS: "data.in_channels", properties.MAX_SEQ_LEN: "data.max_length",
        properties.PIXEL_MEAN: "data.mean", properties.PIXEL_STD: "data.std",
    }
    VALIDATION_METRICS = ("val/loss", "val/zero_shot_acc",
                          *(f"val/{way}_r{k}" for way in DIRECTIONS for k in RECALL_AT))
    DATA_MODULE: ClassVar[type[TridentDataModule]] = ImageTextDataModule
    READS = "images and text"
    TRAINS_WITH = ("contrastive",)
    net: CLIP

    def __init__(
        self,
        backbone: dict[str, Any],
        optimizer: dict[str, Any],
        scheduler: dict[str, Any],
        vocab_size: int,
        eos_id: int | None,
        image_size: int,
        in_channels: int,
        patch_size: int,
        mean: list[float],
        std: list[float],
        class_names: list[str] | None = None,
        templates: list[str] | None = None,
        zero_shot_classes: list[str] | None = None,
        embed_dim: int = 64,
        text: dict[str, Any] | None = None,
        image: dict[str, Any] | None = None,
        tokenizer_json: str | None = None,
        lora: dict[str, Any] | None = None,
        nf4: dict[str, Any] | None = None,
        objective: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(backbone, optimizer, scheduler, tokenizer_json, lora=lora, nf4=nf4, objective=objective)
        self.net = clip(self.backbone_config, vocab_size=vocab_size, eos_id=eos_id, embed_dim=embed_dim, text=text,
                        image=image, image_size=image_size, patch_size=patch_size, in_channels=in_channels)
        self.objective = self.chosen_objective()
        self.mean, self.std = list(mean), list(std)
        self.class_names, self.templates = list(class_names or []), list(templates or ["{}"])
        # Zero-shot classification: among the held-out classes, or every class where none is held out.
        self.zero_shot_classes = list(zero_shot_classes or self.class_names)
        self._features: dict[str, list[Tensor]] = {"image": [], "text": [], "labels": []}

    @classmethod
    def validate_config(cls, cfg: DictConfig) -> None:
        """The towers' settings (``task.text.*``, ``task.image.*``) are model settings, checked before any work."""
        super().validate_config(cfg)
        for tower in ("text", "image"):
            check_tower_keys(cfg.task.get(tower), tower)
        # A contrastive loss is not a mean over examples: each micro-batch would be a contrastive batch of its own, with
        # fewer negatives, and the step's gradient not the global batch's (open_clip's --accum-freq caches features).
        accumulation = cfg.trainer.get("accumulate_grad_batches", 1)
        if accumulation != 1:
            raise ConfigError(f"trainer.accumulate_grad_batches={accumulation} would split task=clip's contrastive "
                              "batch into micro-batches with fewer negatives each: set it to 1 and raise "
                              "data.batch_size, or train on more ranks (DDP gathers every rank's features)")

    @classmethod
    def settings_from_source(cls, source: WeightsSource, cfg: DictConfig, explicit: Sequence[str]) -> dict[str, Any]:
        """The towers' settings the source states (``task.text`` and ``task.image``: their sizes, over the text
        tower's, which are the backbone's ``model``) replace the run's whole, but what the command line set for one
        tower that the source does not state (its dropout) is kept; a value it states otherwise is one line."""
        from omegaconf import OmegaConf  # here: a loaded run's task is built without Hydra's config

        fixed = super().settings_from_source(source, cfg, explicit)
        for tower in ("text", "image"):
            if f"task.{tower}" not in fixed:
                continue
            stated = dict(fixed[f"task.{tower}"] or {})
            # The text tower's settings that the source does not override are its backbone's.
            architecture = {**source.model, **stated} if tower == "text" else stated
            for key in explicit:
                setting = key.removeprefix(f"task.{tower}.")
                if setting == key:
                    continue
                value = OmegaConf.select(cfg, key)
                if setting not in architecture:
                    stated[setting] = value
                elif not same_setting(value, architecture[setting]):
                    raise ConfigError(f"{key}={value} contradicts init_from={source.source}, which has {key}="
                                      f"{architecture[setting]}: drop that override (the architecture comes from the weights)")
            fixed[f"task.{tower}"] = stated or None
        return fixed

    def forward(self, images: Tensor, ids: Tensor) -> Tensor:
        return self.net(images, ids)

    def example_input(self) -> list[NetInput]:
        """Images of the size the position table was made for and captions of any length up to the context."""
        conv, grid = self.net.image.patch_embed.proj, self.net.image.encoder.cfg.grid
        side = grid[0] * conv.kernel_size[0] if grid else 0
        batch = Dim("batch", min=1)
        longest = self.net.text.decoder.cfg.max_seq_len
        ids = torch.randint(0, self.net.text.vocab_size, (2, min(8, longest)))  # (B, T)
        return [NetInput("images", "pixel_values", torch.randn(2, conv.in_channels, side, side), {0: batch}),
                NetInput("ids", "input_ids", ids, {0: batch, 1: Dim("length", min=1, max=longest)})]

    def throughput_units(self, batch: Batch) -> dict[str, int]:
        return {"images": batch[0].size(0), "tokens": batch[1].numel()}

    def flops_per_batch(self, batch: Batch) -> int:
        """Model FLOPs of one training step on ``batch`` (forward and backward, for MFU): both towers and their
        projections (the B x B logits are negligible)."""
        image, text = self.net.image, self.net.text
        images = vit_flops(image.encoder.cfg, batch=batch[0].size(0), patch_size=self.hparams.patch_size,
                           in_channels=self.hparams.in_channels, num_classes=self.hparams.embed_dim)
        texts = stack_flops(text.decoder.cfg, *batch[1].shape, causal=True)
        return images + texts + 6 * text.decoder.cfg.d_model * self.hparams.embed_dim * batch[1].size(0)

    def outputs(self, batch: Batch, stage: str) -> PairedFeatures:
        """The normalised features of ``batch``'s images and captions (B, E) and the clamped temperature."""
        images, ids, _ = batch
        image, text = self.net.normalised(images, ids)
        return paired_features(image, text, self.net.scale())

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        # train/loss is logged once per optimizer step, over its global batch (TridentTask.on_before_optimizer_step).
        loss, outputs = self.objective(self, batch, TRAIN)
        assert isinstance(outputs, PairedFeatures)
        # The clamped temperature's log, from the forward's scale (under FSDP the parameter itself is a shard).
        self.step_metric("train/logit_scale", outputs.scale.detach().log().sum() * loss.count, loss.count)
        return self.trained(loss)

    def on_train_batch_end(self, outputs: Any, batch: Batch, batch_idx: int) -> None:
        # CLIP clamps the learned temperature's log after each step, at log(100) (open_clip: clamp_(0, log(100))).
        with torch.no_grad():
            self.net.logit_scale.clamp_(0, MAX_LOGIT_SCALE)

    def _evaluate(self, batch: Batch, stage: str) -> None:
        loss, outputs = self.objective(self, batch, stage)
        self.evaluated_loss(stage, loss.summed, loss.count)
        assert isinstance(outputs, PairedFeatures)
        self._features["image"].append(outputs.image.detach().float())
        self._features["text"].append(outputs.text.detach().float())
        self._features["labels"].append(batch[2])

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: Batch, batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def on_validation_epoch_end(self) -> None:
        self.log_epoch_loss("val")
        self._log_metrics("val")

    def on_test_epoch_end(self) -> None:
        self.log_epoch_loss("test")
        self._log_metrics("test")

    def _gathered(self, name: str) -> Tensor:
        """This epoch's ``name`` rows of every rank, (N, ...) (one rank: its own)."""
        local = torch.cat(self._features[name])
        if self.trainer.world_size == 1:
            return local
        return self.all_gather(local).flatten(0, 1)  # (W, n, ...) -> (W * n, ...): the ranks' batches are equal

    def _log_metrics(self, stage: str) -> None:
        """Retrieval recall@k both ways over the epoch's pairs, and zero-shot accuracy over the images of the zero-shot
        classes; every rank computes them on the gathered features (equal values: no sync)."""
        if not self._features["image"]:
            return
        image, text, labels = (self._gathered(name) for name in ("image", "text", "labels"))
        self._features = {"image": [], "text": [], "labels": []}
        similarity = image @ text.T  # (N, N)
        for way, scores in zip(DIRECTIONS, (similarity, similarity.T), strict=True):
            for k in RECALL_AT:
                self.log(f"{stage}/{way}_r{k}", recall_at(scores, k))
        accuracy = self.zero_shot_accuracy(image, labels, self.zero_shot_classes)
        if accuracy is not None:
            self.log(f"{stage}/zero_shot_acc", accuracy, prog_bar=stage == "val")
            # What guessing scores, for a report to compare against: one of the zero-shot classes at random.
            self.log(f"{stage}/zero_shot_chance", 1 / len(self.zero_shot_classes))
        # Every image of the split among every class name (chance 1 / classes): the names seen in training too.
        every = self.zero_shot_accuracy(image, labels, self.class_names)
        if every is not None and self.class_names != self.zero_shot_classes:
            self.log(f"{stage}/all_classes_acc", every)

    def prompt_ids(self, classes: list[str]) -> Tensor:
        """(C, K, T) ids of every template filled with each class name, encoded as the data encodes captions."""
        assert self.tokenizer is not None, "task=clip holds its data's tokenizer"
        texts = [template.format(name) for name in classes for template in self.templates]
        ids = caption_ids(self.tokenizer, texts, self.net.text.decoder.cfg.max_seq_len)
        return ids.reshape(len(classes), len(self.templates), -1).to(self.device)

    def zero_shot_accuracy(self, image: Tensor, labels: Tensor, classes: list[str]) -> float | None:
        """The share of the images of ``classes`` (normalised features (N, E), class labels (N,)) whose nearest
        embedding among those of ``classes`` is their own class's; None without classes or images of them."""
        if not classes or self.tokenizer is None:
            return None
        indices = torch.tensor([self.class_names.index(name) for name in classes], device=labels.device)
        chosen = (labels[:, None] == indices[None, :]).any(dim=1)
        if not chosen.any():
            return None
        with torch.no_grad():
            classifier = zero_shot_classifier(self.net, self.prompt_ids(classes)).float()  # (C, E)
        predicted = indices[(image[chosen] @ classifier.T).argmax(dim=1)]
        return float((predicted == labels[chosen]).float().mean())

    def parameter_groups(self, weight_decay: float) -> list[dict[str, Any]]:
        """Matrices decay; biases, norm gains, the temperature, the class token and position tables not."""
        return parameter_groups(self.net, weight_decay, self.net.no_weight_decay())
