"""Sequence classification (BERT / GPT fine-tuning) as a LightningModule: the shared stack with a
pooled class head, accuracy, macro-F1, the majority-class baseline and a confusion matrix."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from omegaconf import DictConfig
from torch import Tensor, nn
from torch.optim import Optimizer
from torchmetrics.classification import MulticlassAccuracy, MulticlassConfusionMatrix, MulticlassF1Score

from trident.backbone import bidirectional_pos_encodings, pos_encoding_class
from trident.data.base import TridentDataModule
from trident.data.text_classification import TextClassificationDataModule
from trident.errors import ConfigError, choose
from trident.models import POOLS, SequenceClassifier
from trident.models.properties import MAX_SEQ_LEN, POOLER, READOUT, SCALED_EMBEDDING
from trident.models.sequence_classifier import pooler_activation
from trident.objectives import Outputs
from trident.parallel.fsdp import shards_weights
from trident.tasks.base import NetInput, TridentTask, token_ids
from trident.tasks.class_head import ClassHead, publish_confusion
from trident.tasks.network_builders import sequence_classifier
from trident.tasks.teacher import add_teacher, taught, teacher_flops
from trident.training.finetuning import FROZEN_FOR_GOOD, check_finetuning, layerwise_groups
from trident.training.flops import passes, stack_flops
from trident.training.optim import positional_parameter_names

Batch = tuple[Tensor, Tensor, Tensor]  # ids (B, T), padding mask (B, T), labels (B,)


class SequenceClassificationTask(ClassHead, TridentTask):
    NAME = "classify"
    SOURCE_SETTINGS = ("stack", "pool", "scale_embeddings", "pooler")  # what its checkpoint fixes as init_from
    OUTSIDE_NETWORK = SequenceClassifier  # ALBERT's and RoBERTa's sequence classifiers
    FROM_NETWORK: ClassVar[dict[str, str]] = {SCALED_EMBEDDING: "task.scale_embeddings", POOLER: "task.pooler",
                                              READOUT: "task.pool", MAX_SEQ_LEN: "data.max_seq_len"}
    VALIDATION_METRICS = ("val/loss", "val/acc", "val/macro_f1", "val/majority_acc")
    DATA_MODULE: ClassVar[type[TridentDataModule]] = TextClassificationDataModule
    net: SequenceClassifier

    def __init__(
        self,
        backbone: dict[str, Any],
        vocab_size: int,
        optimizer: dict[str, Any],
        scheduler: dict[str, Any],
        class_names: list[str],
        majority_accuracy: dict[str, float],
        stack: str = "encoder",
        pool: str = "cls",
        scale_embeddings: bool = False,
        freeze_backbone_steps: int = 0,
        layer_decay: float = 1.0,
        head_lr: float | None = None,
        tokenizer_json: str | None = None,
        class_token_in_text: bool = False,
        pooler: bool | str = False,
        lora: dict[str, Any] | None = None,
        nf4: dict[str, Any] | None = None,
        objective: dict[str, Any] | None = None,
        distill: dict[str, Any] | None = None,
    ) -> None:
        check_pool(stack, pool)
        check_finetuning(freeze_backbone_steps, layer_decay, head_lr)
        super().__init__(backbone, optimizer, scheduler, tokenizer_json, lora=lora, nf4=nf4, objective=objective)
        num_classes = len(class_names)
        self.net = sequence_classifier(self.backbone_config, vocab_size=vocab_size, class_names=class_names,
                                       stack=stack, pool=pool, scale_embeddings=scale_embeddings,
                                       class_token_in_text=class_token_in_text, pooler=pooler)
        self.objective = self.chosen_objective()
        add_teacher(self, distill, vocab_size=vocab_size, class_names=class_names)  # distill=kd
        self.class_names, self.majority_accuracy = list(class_names), dict(majority_accuracy)
        self.freeze_backbone_steps, self.layer_decay, self.head_lr = freeze_backbone_steps, layer_decay, head_lr
        # micro accuracy: the fraction of sequences classified correctly; macro-F1 weighs classes equally.
        self.val_acc, self.test_acc = (MulticlassAccuracy(num_classes, average="micro") for _ in range(2))
        self.val_f1, self.test_f1 = (MulticlassF1Score(num_classes, average="macro") for _ in range(2))
        self.test_confusion = MulticlassConfusionMatrix(num_classes)

    def on_networks_converted(self) -> None:
        """A backbone frozen for good stays frozen whatever a converter lets train (its adapters too)."""
        if self.freeze_backbone_steps == FROZEN_FOR_GOOD:
            for _, param in self.net.named_backbone_parameters():
                param.requires_grad_(False)

    @classmethod
    def validate_config(cls, cfg: DictConfig) -> None:
        """Checked before any work: the pool fits the stack, an encoder gets a bidirectional encoding."""
        super().validate_config(cfg)
        task = cfg.task
        check_pool(task.stack, task.pool)
        check_finetuning(task.freeze_backbone_steps, task.layer_decay, task.head_lr)
        pooler_activation(task.pooler)
        if task.freeze_backbone_steps > 0 and shards_weights(cfg.trainer.get("strategy")):
            # The backbone has no optimizer state until it trains: FSDP's loader (whole or sharded checkpoints) refuses
            # a checkpoint saved before that once the optimizer holds it (the test's best checkpoint, a resume).
            raise ConfigError(f"task.freeze_backbone_steps={task.freeze_backbone_steps} does not work with trainer=fsdp "
                              "(a checkpoint saved while the backbone is frozen holds no optimizer state for it, which "
                              "FSDP's loader requires): set task.freeze_backbone_steps=0 or -1 (frozen for good), or use trainer=ddp")
        name = cfg.pos_encoding.name
        if task.stack == "encoder" and not pos_encoding_class(name).supports_bidirectional:
            raise ConfigError(f"pos_encoding={name} cannot serve the bidirectional encoder of task=classify: "
                              f"choose one of {', '.join(bidirectional_pos_encodings())}, or task.stack=decoder")

    @classmethod
    def stack(cls, task: DictConfig) -> str | None:
        return str(task.stack)

    @classmethod
    def other_stack(cls, task: DictConfig, source_stack: str) -> tuple[str, str]:
        pool = "last" if source_stack == "decoder" else "cls"
        return f"task={cls.NAME} with task.stack={task.stack}", f"set task.stack={source_stack} task.pool={pool}"

    def example_input(self) -> list[NetInput]:
        """Right-padded token ids and their padding mask (True at padding), which share batch and length."""
        longest = self.net.cfg.max_seq_len - int(self.net.prepends_cls)  # the class token takes a position
        ids, dynamic = token_ids(self.net.embed.num_embeddings, longest)
        padding = torch.zeros_like(ids, dtype=torch.bool)  # (B, T)
        padding[0, ids.shape[1] // 2:] = True
        return [NetInput("ids", "input_ids", ids, dynamic), NetInput("key_padding_mask", "padding_mask", padding, dynamic)]

    def forward(self, ids: Tensor, padding: Tensor) -> Tensor:
        """``ids``: (B, T) right-padded, ``padding``: (B, T) True at padding -> class logits (B, C)."""
        return self.net(ids, key_padding_mask=padding if padding.any() else None)

    def throughput_units(self, batch: Batch) -> dict[str, int]:
        return {"tokens": int((~batch[1]).sum()), "samples": batch[0].size(0)}

    def flops_per_batch(self, batch: Batch) -> int:
        """Model FLOPs of one training step (the padded batch, as computed) for MFU, and the forward of its teacher
        (distill=kd)."""
        size, length = batch[0].shape

        def flops(net: nn.Module, training: bool) -> int:
            # The head's dense layers (a pooler's, then the class projection) on one pooled vector per text.
            weights = sum(layer.in_features * layer.out_features for layer in net.head.modules() if isinstance(layer, nn.Linear))
            head = passes(training) * 2 * weights * size
            # A [CLS] vector the network prepends (task.pool=cls, no class token in the text) is one more position.
            positions = length + int(net.prepends_cls)
            return stack_flops(net.cfg, size, positions, causal=False, training=training) + head

        return flops(self.net, True) + teacher_flops(self, lambda teacher: flops(teacher, False))

    def on_before_optimizer_step(self, optimizer: Optimizer) -> None:
        """Freezing for N steps: the backbone's gradients are dropped before each of the first N
        steps (so AdamW leaves it, and its moments, alone), then it trains with the head. Dropped
        rather than never computed, so DDP still reduces every parameter it registered."""
        super().on_before_optimizer_step(optimizer)  # the global batch's gradients first
        if self.global_step < self.freeze_backbone_steps:
            for _, param in self.net.named_backbone_parameters():
                param.grad = None

    def outputs(self, batch: Batch, stage: str) -> Outputs:
        """The class logits (B, C) of ``batch``'s texts and their labels (B,)."""
        ids, padding, labels = batch
        mask = padding if padding.any() else None
        # distill=kd: the teacher scores the same texts.
        return taught(self, Outputs(self(ids, padding).float(), labels), stage,
                      lambda teacher: teacher(ids, key_padding_mask=mask).float())

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        # train/loss is logged once per optimizer step, over its global batch (TridentTask.on_before_optimizer_step).
        return self.trained(self.objective(self, batch, "train")[0])

    def _evaluate(self, batch: Batch, stage: str, acc: MulticlassAccuracy, f1: MulticlassF1Score) -> Tensor:
        loss, outputs = self.objective(self, batch, stage)
        acc(outputs.logits, outputs.targets)
        f1(outputs.logits, outputs.targets)
        self.evaluated_loss(stage, loss.summed, loss.count)
        self.log(f"{stage}/acc", acc, prog_bar=stage == "val")
        self.log(f"{stage}/macro_f1", f1)
        # The baseline beside the accuracy: always answering the most frequent training class.
        split = "validation" if stage == "val" else "test"
        self.log(f"{stage}/majority_acc", self.majority_accuracy[split], sync_dist=True)
        return outputs.logits

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        self._evaluate(batch, "val", self.val_acc, self.val_f1)

    def test_step(self, batch: Batch, batch_idx: int) -> None:
        logits = self._evaluate(batch, "test", self.test_acc, self.test_f1)
        self.test_confusion(logits.argmax(dim=-1), batch[2])

    def on_validation_epoch_end(self) -> None:
        self.log_epoch_loss("val")

    def on_test_epoch_end(self) -> None:
        self.log_epoch_loss("test")
        publish_confusion(self, self.test_confusion, self.class_names)

    def _frozen_for_good(self) -> set[str]:
        if self.freeze_backbone_steps != FROZEN_FOR_GOOD:
            return set()
        return {name for name, _ in self.net.named_backbone_parameters()}

    def parameter_groups(self, weight_decay: float) -> list[dict[str, Any]]:
        """One group per depth (layer-wise learning-rate decay), the head's own learning rate, and
        no group for a backbone frozen for good (training.finetuning)."""
        return layerwise_groups(
            self.net, self.net.layer_of, self.net.cfg.n_layers + 1, lr=float(self.optimizer_cfg["lr"]),
            weight_decay=weight_decay, layer_decay=self.layer_decay, head_lr=self.head_lr,
            no_decay_names=positional_parameter_names(self.net), frozen_names=self._frozen_for_good(),
        )


def check_pool(stack: str, pool: str) -> None:
    pools = choose(POOLS, stack, "task.stack")
    if pool not in pools:
        why = " (a decoder's first position sees only itself)" if pool == "cls" and stack == "decoder" else ""
        raise ConfigError(f"task.pool={pool} does not work with task.stack={stack}{why}: choose one of {', '.join(pools)}")
