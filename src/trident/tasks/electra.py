"""ELECTRA's replaced-token detection (Clark et al. 2020) as a LightningModule: a small generator (a masked LM) fills
the masked positions with samples, and the discriminator (``net``) tells, for every token, whether it was replaced.

Per batch: BERT's masking of the blocks (ELECTRA's rates: 15% of the tokens, 85% of those shown as ``[MASK]``, the
rest unchanged, none random), the generator's cross entropy at the masked positions, a sample of the generator's
softmax (temperature 1, over the vocabulary but ``[MASK]`` and ``[PAD]``, by id) at each of them, drawn without
gradient (the discriminator loss does not train the generator through the sample), and the discriminator's binary
cross entropy on every token of the corrupted blocks, labelled 1 where the sample differs from the original (a sample
equal to it is original, as in the paper). The loss: generator MLM loss + ``discriminator_weight`` (lambda, 50 in
the paper) x discriminator loss, each a mean over the optimizer step's global batch.

The two networks share the token embedding (the generator's output layer tied to it), the learned position table and
the embedding norm (trident.models.electra_generator), which both losses train. ``net`` is the discriminator: what
``init_from`` hands to task=classify and what ``trident-export --format hf`` writes (ElectraForPreTraining); the
generator (``generator``, in the checkpoints under its name) is written beside it (``<out>/generator``,
ElectraForMaskedLM).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import Tensor
from torchmetrics import MeanMetric
from torchmetrics.classification import BinaryAccuracy, BinaryPrecision, BinaryRecall, MulticlassAccuracy

from trident.backbone import GATED_ACTIVATIONS
from trident.data.base import TridentDataModule
from trident.data.masking import Masking, mask_tokens, masking_generator
from trident.data.mlm import MLMDataModule
from trident.data.special_tokens import IGNORE_INDEX
from trident.errors import ConfigError, is_number
from trident.models import MaskedLM, ReplacedTokenDetector
from trident.models.electra_generator import check_generator_size, share_embeddings
from trident.models.properties import MAX_SEQ_LEN, SCALED_EMBEDDING
from trident.parallel.fsdp import shards_weights
from trident.tasks.base import TridentTask
from trident.tasks.mlm import STAGES, MaskedLanguageModelTask
from trident.tasks.network_builders import electra_generator, replaced_token_detector
from trident.tasks.teacher import check_distill_run
from trident.training.flops import FORWARD_AND_BACKWARD, masked_lm_flops, stack_flops
from trident.training.optim import parameter_groups, positional_parameter_names

# The parts of the loss and the metrics logged per stage beside <stage>/loss.
PARTS = ("generator_loss", "generator_acc", "discriminator_loss", "discriminator_acc", "replaced_precision",
         "replaced_recall")


@dataclass(frozen=True)
class Step:
    """One batch through both networks: the summed losses, their counts, and what the metrics read."""

    generator_summed: Tensor  # () cross entropy summed over the masked positions
    masked: Tensor  # (N, V) the generator's logits at the N masked positions
    originals: Tensor  # (N,) their original tokens
    discriminator_summed: Tensor  # () binary cross entropy summed over every token
    detected: Tensor  # (B, T) the discriminator's logits
    corrupted: Tensor  # (B, T) the discriminator's input: the blocks, a sample at every masked position
    replaced: Tensor  # (B, T) bool: the token was replaced (the sample differs from the original)


class ElectraTask(TridentTask):
    NAME = "electra"
    SOURCE_SETTINGS = ("scale_embeddings",)  # what its checkpoint fixes as init_from (task=classify, mlm)
    OUTSIDE_NETWORK = ReplacedTokenDetector  # ElectraForPreTraining
    FROM_NETWORK: ClassVar[dict[str, str]] = {SCALED_EMBEDDING: "task.scale_embeddings", MAX_SEQ_LEN: "data.max_seq_len"}
    VALIDATION_METRICS = ("val/loss", *(f"val/{part}" for part in PARTS))
    DATA_MODULE: ClassVar[type[TridentDataModule]] = MLMDataModule
    STACK = "encoder"
    NETWORKS = ("net", "generator")
    net: ReplacedTokenDetector
    generator: MaskedLM

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
        mask_token_fraction: float = 0.85,
        random_token_fraction: float = 0.0,
        generator_size: float = 0.25,
        discriminator_weight: float = 50.0,
        scale_embeddings: bool = False,
        seed: int = 0,
        tokenizer_json: str | None = None,
        lora: dict[str, Any] | None = None,
        nf4: dict[str, Any] | None = None,
        objective: dict[str, Any] | None = None,  # every task's hyperparameter: none here (validate_config refuses one)
    ) -> None:
        check_weight(discriminator_weight)
        super().__init__(backbone, optimizer, scheduler, tokenizer_json, lora=lora, nf4=nf4, objective=objective)
        self.net = replaced_token_detector(self.backbone_config, vocab_size=vocab_size,
                                           scale_embeddings=scale_embeddings)
        self.generator = electra_generator(self.backbone_config, vocab_size=vocab_size,
                                           scale_embeddings=scale_embeddings, generator_size=generator_size)
        share_embeddings(self.generator, self.net)
        self.masking = Masking(mask_rate, mask_token_fraction, random_token_fraction)
        # pad_id: never sampled (no block holds padding: task=mlm's packed blocks); num_regular_tokens: the masking's
        # random replacements (task.random_token_fraction).
        self.mask_id, self.pad_id, self.num_regular_tokens = mask_id, pad_id, num_regular_tokens
        self.seed, self.discriminator_weight = seed, float(discriminator_weight)
        # Per stage: the generator's accuracy at the masked positions (micro: the share predicted exactly), the
        # discriminator's on every token, and its precision and recall on the replaced ones.
        self.metrics = torch.nn.ModuleDict({stage: torch.nn.ModuleDict({
            "generator_loss": MeanMetric(), "generator_acc": MulticlassAccuracy(vocab_size, average="micro"),
            "discriminator_loss": MeanMetric(), "discriminator_acc": BinaryAccuracy(),
            "replaced_precision": BinaryPrecision(), "replaced_recall": BinaryRecall(),
        }) for stage in ("val", "test")})

    @classmethod
    def validate_config(cls, cfg: DictConfig) -> None:
        """task=mlm's checks (text data, masking rates, a bidirectional encoding), then ELECTRA's: its own loss (no
        objective group, no distillation), the generator's size and the loss weight, an encoder family with an
        ungated activation for the heads, full training of both networks (no finetune=lora), and one set of weights
        for both networks' shared embedding (no sharded strategy)."""
        if cfg.task.get("objective") is not None:
            raise ConfigError(f"objective={cfg.task.objective.get('name')} does not apply to task=electra, which trains "
                              "its own loss (the generator's MLM loss + task.discriminator_weight x the discriminator's): "
                              "drop objective=")
        check_distill_run(cls, cfg)  # named for task=electra before task=mlm's checks would name task=mlm
        MaskedLanguageModelTask.validate_config(cfg)
        check_weight(cfg.task.discriminator_weight)
        check_generator_size(cfg.task.generator_size)
        family = cfg.model.get("family")
        if family not in (None, "electra"):
            raise ConfigError(f"model.family={family} (architecture={family}) is "
                              "not a discriminator's: task=electra trains ELECTRA's encoder, declared as ELECTRA "
                              "(architecture=electra) or as trident's own (model.family=null)")
        if cfg.model.activation in GATED_ACTIVATIONS:
            raise ConfigError(f"model.activation={cfg.model.activation} is gated, which task=electra's heads (the "
                              "discriminator's dense layer, the generator's MLM transform) cannot use: set "
                              "model.activation=gelu (architecture=electra)")
        finetune = (cfg.get("finetune") or {}).get("name", "full")
        if finetune != "full":
            raise ConfigError(f"finetune={finetune} adapts a pre-trained network, the rest frozen; task=electra pre-trains "
                              "its generator (from scratch) and discriminator: use finetune=full, then fine-tune the "
                              f"discriminator with task=classify finetune={finetune} init_from=<the electra run>")
        if shards_weights(cfg.trainer.get("strategy")):
            raise ConfigError("task=electra's generator and discriminator share their embedding, which "
                              "trainer=fsdp would shard once per network: use trainer=ddp (or one device)")

    # An encoder over blocks of token ids, as task=mlm's: called on (B, T) ids (the discriminator's logits (B, T) that
    # each token was replaced), pointed to lm/classify for a causal source, its example input and throughput units.
    forward = MaskedLanguageModelTask.forward
    other_stack = MaskedLanguageModelTask.__dict__["other_stack"]
    example_input = MaskedLanguageModelTask.example_input
    throughput_units = MaskedLanguageModelTask.throughput_units

    def flops_per_batch(self, batch: Tensor) -> int:
        """Model FLOPs of one training step on ``batch``: the generator as a masked LM, the discriminator's stack on
        every token and its head (two dense layers, the second of one output)."""
        size, length = batch.shape
        generator = masked_lm_flops(self.generator.cfg, self.generator.vocab_size, size, length,
                                    size * self.masking.count(length))
        d = self.net.cfg.d_model
        head = FORWARD_AND_BACKWARD * 2 * (d * d + d) * size * length
        return generator + stack_flops(self.net.cfg, size, length, causal=False) + head

    def parameter_groups(self, weight_decay: float) -> list[dict[str, Any]]:
        """Both networks' parameters (the shared embedding once): matrices decay, the rest and position tables not."""
        both = torch.nn.ModuleDict(self.networks())
        return parameter_groups(both, weight_decay, positional_parameter_names(both))

    def step(self, ids: Tensor, stage: str, index: int) -> Step:
        """Batch ``index`` of ``stage`` (training: the batch counter across epochs) through both networks: masks and
        samples drawn from (seed, stage, batch, data-parallel rank), so a resumed run draws the same."""
        shard = self._trainer.distributed_sampler_kwargs if self._trainer is not None else None
        generator = masking_generator(ids.device, self.seed, STAGES[stage], index, shard["rank"] if shard else 0)
        inputs, targets = mask_tokens(ids, self.masking, mask_id=self.mask_id,
                                      num_regular_tokens=self.num_regular_tokens, generator=generator)
        select = targets != IGNORE_INDEX  # (B, T)
        # Whole logits, no task.loss_chunk: the sampler draws every masked position's replacement from its softmax over
        # the whole vocabulary, so the (N, V) logits (N: ~15 % of the tokens) exist in any case, and a loss computed
        # chunk by chunk beside them would run the generator's head a second time.
        masked = self.generator(inputs, select=select).float()  # (N, V)
        originals = ids[select]  # (N,)
        sampled = sample_replacements(masked, (self.mask_id, self.pad_id), generator)  # (N,)
        corrupted = ids.masked_scatter(select, sampled)  # (B, T)
        replaced = corrupted != ids  # (B, T)
        detected = self.net(corrupted).float()  # (B, T)
        return Step(
            generator_summed=F.cross_entropy(masked, originals, reduction="sum"), masked=masked, originals=originals,
            discriminator_summed=F.binary_cross_entropy_with_logits(detected, replaced.float(), reduction="sum"),
            detected=detected, corrupted=corrupted, replaced=replaced,
        )

    def loss(self, step: Step) -> tuple[Tensor, Tensor]:
        """The summed loss and count the one loss reduction (trident.training.token_loss) takes: over the step's
        global batch it averages to generator loss (over masked tokens) + lambda x discriminator loss (over every
        token). The count is the masked tokens, and the discriminator's sum is weighted by masked / tokens: every
        block is full (packed, no padding) and masks the same number of tokens, so that ratio is the same in every
        micro-batch and rank, and the global sum over the global masked count is the discriminator's global mean."""
        masked, tokens = step.originals.numel(), step.replaced.numel()
        summed = step.generator_summed + self.discriminator_weight * (masked / tokens) * step.discriminator_summed
        return summed, torch.tensor(masked, device=summed.device)

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        step = self.step(batch, "train", self.trainer.fit_loop.epoch_loop.total_batch_idx)
        masked, tokens = step.originals.numel(), step.replaced.numel()
        # Logged once per optimizer step, over its global batch, as train/loss is.
        self.step_metric("train/generator_loss", step.generator_summed.detach(), masked)
        self.step_metric("train/generator_acc", (step.masked.argmax(-1) == step.originals).sum(), masked)
        self.step_metric("train/discriminator_loss", step.discriminator_summed.detach(), tokens)
        self.step_metric("train/discriminator_acc", ((step.detected > 0) == step.replaced).sum(), tokens)
        return self.trained_loss(*self.loss(step))

    def _evaluate(self, batch: Tensor, batch_idx: int, stage: str) -> None:
        step = self.step(batch, stage, batch_idx)
        self.evaluated_loss(stage, *self.loss(step))
        metrics = self.metrics[stage]
        masked, tokens = step.originals.numel(), step.replaced.numel()
        metrics["generator_loss"].update(step.generator_summed / masked, masked)
        metrics["generator_acc"].update(step.masked, step.originals)
        metrics["discriminator_loss"].update(step.discriminator_summed / tokens, tokens)
        for name in ("discriminator_acc", "replaced_precision", "replaced_recall"):
            metrics[name].update(step.detected.sigmoid(), step.replaced.long())
        for name in PARTS:
            self.log(f"{stage}/{name}", metrics[name], prog_bar=name == "discriminator_acc" and stage == "val")

    def validation_step(self, batch: Tensor, batch_idx: int) -> None:
        self._evaluate(batch, batch_idx, "val")

    def test_step(self, batch: Tensor, batch_idx: int) -> None:
        self._evaluate(batch, batch_idx, "test")

    def on_validation_epoch_end(self) -> None:
        self.log_epoch_loss("val")

    def on_test_epoch_end(self) -> None:
        self.log_epoch_loss("test")


@torch.no_grad()  # a discrete sample: no gradient reaches the generator through it
def sample_replacements(logits: Tensor, never: tuple[int, ...], generator: torch.Generator) -> Tensor:
    """(N, V) generator logits -> (N,) tokens drawn from their softmax (temperature 1) over the vocabulary but the ids
    ``never`` ([MASK] and [PAD], which are no text's token). By id, not by a range of "regular" ids: a tokenizer that
    came with its weights (BERT's WordPiece: [PAD] 0, [MASK] 103) holds them among its first ids, and a document end
    added after the corpus vocabulary (<|endoftext|>) is a token of the text, which the paper's sampler can draw."""
    # Non-finite logits (a diverging run) still give a sample: the loss, not the sampler, then stops or skips the step
    # (nonfinite_loss), in one line.
    scores = logits.float().nan_to_num()  # (N, V)
    scores[:, list(never)] = -torch.inf
    return torch.multinomial(scores.softmax(dim=-1), 1, generator=generator).squeeze(-1)


def check_weight(weight: object) -> None:
    if not is_number(weight) or weight < 0:  # type: ignore[operator]
        raise ConfigError(f"task.discriminator_weight must be a number >= 0 (lambda of the generator's loss + lambda x "
                          f"the discriminator's), got {weight!r}: the paper's is 50")
