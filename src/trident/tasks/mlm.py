"""Masked language modelling (BERT) as a LightningModule: per-batch seeded masking, loss on the
selected positions only, masked-token loss / perplexity / accuracy, a table of filled-in blocks."""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import torch
from omegaconf import DictConfig
from torch import Tensor
from torchmetrics.classification import MulticlassAccuracy

from trident.backbone import bidirectional_pos_encodings, pos_encoding_class
from trident.data.base import TridentDataModule
from trident.data.masking import Masking, mask_tokens, masking_generator
from trident.data.mlm import MLMDataModule
from trident.data.special_tokens import IGNORE_INDEX
from trident.data.tokenization import plain_encoder
from trident.errors import ConfigError, is_int
from trident.models import MaskedLM
from trident.models.properties import MAX_SEQ_LEN, SCALED_EMBEDDING
from trident.objectives import TRAIN, Outputs
from trident.tasks.base import FILL_MASK, NetInput, TridentTask, token_input
from trident.tasks.network_builders import masked_lm
from trident.tracking.text_logging import log_text_table
from trident.training.chunked_loss import DEFAULT_LOSS_CHUNK, check_loss_chunk
from trident.training.flops import masked_lm_flops
from trident.training.run_checks import check_seed

log = logging.getLogger(__name__)

# Streams of masks: one per stage, so validation masks never depend on how long training ran.
STAGES = {"train": 0, "val": 1, "test": 2}


class MaskedLanguageModelTask(TridentTask):
    NAME = "mlm"
    SOURCE_SETTINGS = ("scale_embeddings",)  # what its checkpoint fixes as init_from
    OUTSIDE_NETWORK = MaskedLM  # BERT
    FROM_NETWORK: ClassVar[dict[str, str]] = {SCALED_EMBEDDING: "task.scale_embeddings", MAX_SEQ_LEN: "data.max_seq_len"}
    VALIDATION_METRICS = ("val/loss", "val/ppl", "val/acc")
    DATA_MODULE: ClassVar[type[TridentDataModule]] = MLMDataModule
    STACK = "encoder"
    TRAINS_WITH = ("masked_tokens",)
    CAPABILITIES = frozenset({FILL_MASK})
    net: MaskedLM
    HEAD = ("transform.", "head.bias")  # trains under finetune=lora

    def __init__(
        self,
        backbone: dict[str, Any],
        vocab_size: int,
        optimizer: dict[str, Any],
        scheduler: dict[str, Any],
        mask_id: int,
        pad_id: int,
        num_regular_tokens: int,
        mask_rate: float = 0.15,
        mask_token_fraction: float = 0.8,
        random_token_fraction: float = 0.1,
        scale_embeddings: bool = False,
        seed: int = 0,
        num_examples: int = 4,
        tokenizer_json: str | None = None,
        lora: dict[str, Any] | None = None,
        nf4: dict[str, Any] | None = None,
        objective: dict[str, Any] | None = None,
        loss_chunk: int | None = DEFAULT_LOSS_CHUNK,
    ) -> None:
        super().__init__(backbone, optimizer, scheduler, tokenizer_json, lora=lora, nf4=nf4, objective=objective)
        self.net = masked_lm(self.backbone_config, vocab_size=vocab_size, scale_embeddings=scale_embeddings)
        self.objective = self.chosen_objective()
        self.loss_chunk = check_loss_chunk(loss_chunk)  # tokens per chunk of the loss (trident.training.chunked_loss)
        self.masking = Masking(mask_rate, mask_token_fraction, random_token_fraction)
        self.mask_id, self.pad_id, self.num_regular_tokens = mask_id, pad_id, num_regular_tokens
        self.seed, self.num_examples = seed, num_examples
        # micro: the fraction of masked tokens predicted exactly (macro would average token classes).
        self.val_acc = MulticlassAccuracy(vocab_size, average="micro")
        self.test_acc = MulticlassAccuracy(vocab_size, average="micro")
        self._examples: list[list[Any]] = []

    @classmethod
    def validate_config(cls, cfg: DictConfig) -> None:
        """Checked before any work: text data, masking rates, room for a mask, a bidirectional encoding."""
        super().validate_config(cfg)
        check_loss_chunk(cfg.task.get("loss_chunk"))
        if "block_size" not in cfg.data or "tokenizer" not in cfg.data:
            raise ConfigError(
                f"data={cfg.data.name} is not text data for task={cfg.task.name}: choose a language-modelling data option "
                "(shakespeare, bible_kjv, text_files, wikitext103, tinystories)"
            )
        # Checked here because this hook runs before the backbone's checks and the task's constructor.
        block_size = cfg.data.block_size
        if not is_int(block_size) or block_size < 1:
            raise ConfigError(f"data.block_size must be an integer >= 1, got {block_size!r}: set e.g. data.block_size=128")
        check_seed(cfg.task.seed, "task.seed")
        num_examples = cfg.task.get("num_examples", 0)  # task=electra, which shares these checks, shows no table
        if not is_int(num_examples) or num_examples < 0:
            raise ConfigError(
                f"task.num_examples must be an integer >= 0 (0: no table), got {num_examples!r}: "
                "set e.g. task.num_examples=4"
            )
        masking = Masking(cfg.task.mask_rate, cfg.task.mask_token_fraction, cfg.task.random_token_fraction)
        masking.check_room(block_size)
        name = cfg.pos_encoding.name
        if not pos_encoding_class(name).supports_bidirectional:
            raise ConfigError(
                f"pos_encoding={name} cannot serve the bidirectional encoder of task={cfg.task.name}: "
                f"choose one of {', '.join(bidirectional_pos_encodings())}"
            )
        if name == "none":
            log.warning(
                "pos_encoding=none with task=%s: without a causal mask the encoder sees an unordered bag of "
                "tokens, so every [MASK] of a block gets the same prediction (a baseline for position ablations)",
                cfg.task.name,
            )

    def forward(self, ids: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        return self.net(ids, key_padding_mask=key_padding_mask)

    @classmethod
    def other_stack(cls, task: DictConfig, source_stack: str) -> tuple[str, str]:
        return f"task={cls.NAME}", f"fine-tune it with task=lm or task=classify task.stack={source_stack}"

    def example_input(self) -> list[NetInput]:
        return token_input(self.net)

    def throughput_units(self, batch: Tensor) -> dict[str, int]:
        return {"tokens": batch.numel(), "samples": batch.size(0)}

    def flops_per_batch(self, batch: Tensor) -> int:
        """Model FLOPs of one training step on ``batch`` (forward and backward, for MFU)."""
        size, length = batch.shape
        return masked_lm_flops(self.net.cfg, self.net.vocab_size, size, length, size * self.masking.count(length))

    def mask(self, ids: Tensor, stage: str, index: int) -> tuple[Tensor, Tensor]:
        """Masks for batch ``index`` of ``stage`` (training: the batch counter across epochs, which a
        resumed run restores), different on every DDP rank; returns (inputs, targets). The ranks of one
        tensor-parallel group compute on one batch together: they share its data-parallel rank, and its masks."""
        shard = self._trainer.distributed_sampler_kwargs if self._trainer is not None else None
        generator = masking_generator(ids.device, self.seed, STAGES[stage], index, shard["rank"] if shard else 0)
        return mask_tokens(
            ids, self.masking, mask_id=self.mask_id, num_regular_tokens=self.num_regular_tokens, generator=generator
        )

    def outputs(self, batch: tuple[Tensor, Tensor], stage: str) -> Outputs:
        """``batch``: masked inputs and their targets (B, T) (:meth:`mask`) -> the logits of the selected positions
        only (N, V), in training with ``task.loss_chunk`` the head and its states (N, D) (trident.objectives.base),
        and their original tokens (N,): N, the count of trained tokens, may be 0."""
        inputs, targets = batch
        select = targets != IGNORE_INDEX  # (B, T)
        if stage == TRAIN and self.loss_chunk:
            return Outputs(self.net(inputs, select=select, chunk=self.loss_chunk), targets[select])
        # Validation and test read the whole logits for their accuracy and examples (no graph holds them there): a
        # chunked loss beside them would run the head twice.
        return Outputs(self.net(inputs, select=select).float(), targets[select])

    def _loss(self, inputs: Tensor, targets: Tensor, stage: str = "train") -> tuple[Tensor, Tensor, Outputs]:
        """The objective's summed loss of the masked ``inputs`` and ``targets``, the count of trained tokens, and the
        outputs it was computed on."""
        loss, outputs = self.objective(self, (inputs, targets), stage)
        return loss.summed, loss.count, outputs

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        # Micro-batches across epochs (Lightning restores the count on resume), unlike batch_idx.
        inputs, targets = self.mask(batch, "train", self.trainer.fit_loop.epoch_loop.total_batch_idx)
        summed, count, _ = self._loss(inputs, targets)
        # train/loss is logged once per optimizer step, over its global batch (TridentTask.on_before_optimizer_step).
        return self.trained_loss(summed, count)

    def _evaluate(self, batch: Tensor, batch_idx: int, stage: str, acc: MulticlassAccuracy) -> None:
        inputs, targets = self.mask(batch, stage, batch_idx)
        summed, count, outputs = self._loss(inputs, targets, stage)
        self.evaluated_loss(stage, summed, count)
        acc(outputs.logits, outputs.targets)
        self.log(f"{stage}/acc", acc, prog_bar=stage == "val")
        if batch_idx == 0 and stage == "val" and self.trainer.is_global_zero:
            self._examples = self.filled_in(batch, inputs, targets, outputs.logits.argmax(dim=-1))

    def validation_step(self, batch: Tensor, batch_idx: int) -> None:
        self._evaluate(batch, batch_idx, "val", self.val_acc)

    def test_step(self, batch: Tensor, batch_idx: int) -> None:
        self._evaluate(batch, batch_idx, "test", self.test_acc)

    def on_test_epoch_end(self) -> None:
        self.log_epoch_loss("test", with_perplexity=True)

    def filled_in(self, ids: Tensor, inputs: Tensor, targets: Tensor, predictions: Tensor) -> list[list[Any]]:
        """Rows (masked input, prediction, original, accuracy) for the first ``num_examples`` blocks:
        the prediction is the original with every selected position replaced by the model's guess."""
        if self.tokenizer is None:
            return []
        select = targets != IGNORE_INDEX
        predicted = ids.clone()
        predicted[select] = predictions
        rows = []
        for k in range(min(self.num_examples, ids.size(0))):
            correct = (predicted[k][select[k]] == ids[k][select[k]]).float().mean().item()
            texts = [self.tokenizer.decode(t[k].tolist(), skip_special_tokens=False) for t in (inputs, predicted, ids)]
            rows.append([self.global_step, *texts, round(correct, 3)])
        return rows

    def on_validation_epoch_end(self) -> None:
        self.log_epoch_loss("val", with_perplexity=True)
        if self.trainer.sanity_checking or not self.trainer.is_global_zero or not self._examples:
            return
        columns = ["step", "masked input", "prediction", "original", "accuracy"]
        log_text_table(self, "masked_examples", columns, self._examples)
        self._examples = []

    @torch.inference_mode()
    def fill_mask(self, texts: list[str], top_k: int = 5) -> list[list[list[tuple[str, float]]]]:
        """For each text, for each ``[MASK]`` in it, the ``top_k`` (token, probability) predictions.
        Texts of different lengths are padded with ``[PAD]`` and hidden from attention."""
        if self.tokenizer is None:
            raise ConfigError("this checkpoint holds no tokenizer: use a checkpoint written by a task=mlm run")
        # Encoded as the training blocks are: no post-processor's [CLS] ... [SEP], none of the file's truncation (which
        # could cut a [MASK] away) or padding (with the file's pad id, which the attention mask would not hide).
        encoder = plain_encoder(self.tokenizer)
        encoded = [encoder.encode(text, add_special_tokens=False).ids for text in texts]
        for text, ids in zip(texts, encoded):
            if self.mask_id not in ids:
                raise ConfigError(f"no [MASK] in {text!r}: write [MASK] where a token is to be predicted")
        longest = max(len(ids) for ids in encoded)
        ids = torch.full((len(texts), longest), self.pad_id, dtype=torch.long, device=self.device)
        for row, tokens in enumerate(encoded):
            ids[row, : len(tokens)] = torch.tensor(tokens)
        padding = ids == self.pad_id  # (B, T)
        select = ids == self.mask_id
        probs = self.net(ids, key_padding_mask=padding if padding.any() else None, select=select).float().softmax(-1)
        top = probs.topk(min(top_k, probs.size(-1)), dim=-1)  # (N, k): masks in row-major order
        answers = [[(self.tokenizer.decode([i], skip_special_tokens=False), p) for i, p in zip(ids_, ps)]
                   for ids_, ps in zip(top.indices.tolist(), top.values.tolist())]
        counts = select.sum(dim=1).tolist()
        return [answers[sum(counts[:row]) : sum(counts[: row + 1])] for row in range(len(texts))]
