"""Causal language modelling as a LightningModule: next-token loss, perplexity, sampled text."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor, nn

from trident.backbone import SegmentMemory
from trident.converters import chosen_converters, converters_of
from trident.data.base import TridentDataModule
from trident.data.lm import LMDataModule
from trident.data.tokenization import plain_encoder
from trident.errors import ConfigError
from trident.models import CausalLM, generate
from trident.models.properties import MAX_SEQ_LEN, SCALED_EMBEDDING, TIED_HEAD
from trident.models.sampling import check_filters
from trident.objectives import Outputs, build_objective
from trident.objectives.preference import REFERENCE, check_preference_run
from trident.parallel.fsdp import whole_weights
from trident.parallel.tensor_parallel import is_tensor_parallel
from trident.tasks.base import GENERATE, NetInput, TridentTask, token_input
from trident.tasks.network_builders import causal_lm
from trident.tasks.networks import can_switch_off
from trident.tasks.teacher import add_teacher, taught, teacher_flops
from trident.tracking.text_logging import log_text_table
from trident.training.chunked_loss import DEFAULT_LOSS_CHUNK, check_loss_chunk
from trident.training.flops import causal_lm_flops

if TYPE_CHECKING:
    from omegaconf import DictConfig


class LanguageModelTask(TridentTask):
    NAME = "lm"
    SOURCE_SETTINGS = ("tie_embeddings", "scale_embeddings", "embedding_rows")  # what its checkpoint fixes as init_from
    OUTSIDE_NETWORK = CausalLM  # GPT-2, Llama and its cousins, Gemma
    FROM_NETWORK: ClassVar[dict[str, str]] = {TIED_HEAD: "task.tie_embeddings", SCALED_EMBEDDING: "task.scale_embeddings",
                                              MAX_SEQ_LEN: "data.max_seq_len"}
    VALIDATION_METRICS = ("val/loss", "val/ppl")
    DATA_MODULE: ClassVar[type[TridentDataModule]] = LMDataModule
    STACK = "decoder"
    RECURRENT = True
    TRAINS_WITH = ("next_token", "dpo", "orpo", "kto")
    CAPABILITIES = frozenset({GENERATE})
    net: CausalLM

    def __init__(
        self,
        backbone: dict[str, Any],
        vocab_size: int,
        optimizer: dict[str, Any],
        scheduler: dict[str, Any],
        tie_embeddings: bool = True,
        scale_embeddings: bool = False,
        embedding_rows: int | None = None,
        sample_prompts: list[str] | None = None,
        sampling: dict[str, Any] | None = None,
        tokenizer_json: str | None = None,
        lora: dict[str, Any] | None = None,
        nf4: dict[str, Any] | None = None,
        objective: dict[str, Any] | None = None,
        reference: str | None = None,
        distill: dict[str, Any] | None = None,
        loss_chunk: int | None = DEFAULT_LOSS_CHUNK,
    ) -> None:
        super().__init__(backbone, optimizer, scheduler, tokenizer_json, lora=lora, nf4=nf4, objective=objective)
        self.net = causal_lm(self.backbone_config, vocab_size=vocab_size, embedding_rows=embedding_rows,
                             tie_embeddings=tie_embeddings, scale_embeddings=scale_embeddings)
        self.objective = self.chosen_objective()
        self.loss_chunk = check_loss_chunk(loss_chunk)  # tokens per chunk of the loss (trident.training.chunked_loss)
        # reference: where a frozen copy of the initial policy is read (DPO in full fine-tuning; a run names
        # <run>/init/reference.safetensors, trident.runs.lifecycle): a companion, sharded like net, never saved.
        if reference is not None and self.objective.copies_initial(can_switch_off(converters_of(self.hparams))):
            reference_net = causal_lm(self.backbone_config, vocab_size=vocab_size, embedding_rows=embedding_rows,
                                      tie_embeddings=tie_embeddings, scale_embeddings=scale_embeddings)
            self.add_companion(REFERENCE, reference_net, reference, initial_of="net")
        add_teacher(self, distill, vocab_size=self.net.vocab_size)  # distill=kd: a teacher of the same vocabulary
        self.sample_prompts = list(sample_prompts or [])
        self.sampling = dict(sampling or {})
        check_filters(self.sampling.get("top_k"), self.sampling.get("top_p"),  # fail before training, not after
                      self.sampling.get("temperature", 1.0))
        # model.memory_length: each stage's memory (train, val, test), what its previous batch's rows left; a new one,
        # empty, at each epoch's start. Never saved: a resumed run starts with an empty memory.
        self.memories: dict[str, SegmentMemory] = {}

    def forward(self, ids: Tensor) -> Tensor:
        return self.net(ids)

    @classmethod
    def validate_config(cls, cfg: DictConfig) -> None:
        super().validate_config(cfg)
        check_loss_chunk(cfg.task.get("loss_chunk"))
        check_preference_run(cfg)  # a preference objective with data=preference (and DPO with init_from)
        check_memory_run(cfg)

    @classmethod
    def validation_metrics(cls, cfg: DictConfig) -> tuple[str, ...]:
        """The loss and perplexity, and the parts of the objective's loss (DPO's rewards), logged per split."""
        objective = build_objective(cfg.task.get("objective"), cls.NAME, cls.TRAINS_WITH)
        return (*cls.VALIDATION_METRICS, *(f"val/{name}" for name in objective.PARTS))

    @classmethod
    def initial_copies(cls, cfg: DictConfig) -> tuple[str, ...]:
        objective = build_objective(cfg.task.get("objective"), cls.NAME, cls.TRAINS_WITH)
        return (REFERENCE,) if objective.copies_initial(can_switch_off(chosen_converters(cfg))) else ()

    def on_fit_start(self) -> None:
        self.objective.start(self)  # at the initial weights: e.g. DPO's reference policy

    @classmethod
    def other_stack(cls, task: DictConfig, source_stack: str) -> tuple[str, str]:
        return f"task={cls.NAME}", f"fine-tune it with task=mlm or task=classify task.stack={source_stack}"

    def example_input(self) -> list[NetInput]:
        return token_input(self.net)

    def throughput_units(self, batch: tuple[Tensor, ...]) -> dict[str, int]:
        return {"tokens": batch[0].numel(), "samples": batch[0].size(0)}

    def flops_per_batch(self, batch: tuple[Tensor, ...]) -> int:
        """Model FLOPs of one training step on ``batch`` (forward and backward, for MFU), and the forward of its
        teacher (distill=kd), which reads a memory of its own only beside a student's."""
        size, length = batch[0].shape
        memory = bool(self.backbone_config.memory_length)
        return causal_lm_flops(self.net.cfg, self.net.vocab_size, size, length) + teacher_flops(
            self, lambda teacher: causal_lm_flops(teacher.cfg, teacher.vocab_size, size, length, training=False,
                                                  memory=memory))

    def outputs(self, batch: tuple[Tensor, ...], stage: str) -> Outputs:
        """``batch``: inputs and targets (B, T), and for rows packed with several documents (``data=chat``) their
        document ids (B, T), which keep each document's attention to itself -> the logits (B, T, V), or with
        ``task.loss_chunk`` the head and its hidden states (B, T, D) (trident.objectives.base), and the targets
        (IGNORE_INDEX at prompt tokens of chat data and padding). The objectives that read whole logits (DPO, KTO,
        ORPO's sequence log-probabilities, distillation's student against its teacher) get them from the head."""
        inputs, targets, *documents = batch  # (B, T), (B, T), [(B, T)]
        def scores(net: nn.Module, chunk: int = 0) -> Any:  # (B, T, V) logits, or the head with chunk > 0
            settings: dict[str, Any] = {"chunk": chunk} if chunk else {}  # a teacher is asked for its logits only
            if documents:
                return net(inputs, documents=documents[0], **settings)
            # model.memory_length: the batch's rows continue the previous batch's of the stage (data.contiguous, which
            # the student's memory turns on): the student and a teacher with a memory each carry their own.
            if self.backbone_config.memory_length and net.cfg.memory_length:
                settings["memory"] = self.stage_memory(stage if net is self.net else f"{stage}/teacher", net)
            return net(inputs, **settings)

        # distill=kd: the teacher's too (a teacher's logits are read whole).
        return taught(self, Outputs(scores(self.net, self.loss_chunk), targets), stage, scores)

    def stage_memory(self, stage: str, net: CausalLM | None = None) -> SegmentMemory:
        """The memory (model.memory_length) that ``stage``'s batches carry from one to the next (of ``net``, default
        the student; ``stage``: its key, e.g. ``train/teacher``)."""
        if stage not in self.memories:
            self.memories[stage] = (net or self.net).new_memory()
        return self.memories[stage]

    def on_train_epoch_start(self) -> None:
        # Each epoch reads its streams from their start again: the memory of their end is no context for it. The
        # training memory lives on across a validation, which has its own (each validation starts one, empty).
        for key in ("train", "train/teacher"):
            self.memories.pop(key, None)

    def on_validation_epoch_start(self) -> None:
        self.memories.pop("val", None)

    def on_test_epoch_start(self) -> None:
        self.memories.pop("test", None)

    def _loss(self, batch: tuple[Tensor, ...], stage: str = "train") -> tuple[Tensor, Tensor]:
        """The objective's summed loss of ``batch`` and the count of its trained targets; its parts (e.g. DPO's
        rewards) are logged as ``<stage>/<part>``, their epoch mean weighted by their counts."""
        loss, _ = self.objective(self, batch, stage)
        for name, (mean, weight) in loss.parts.items():
            self.log(f"{stage}/{name}", mean, batch_size=int(weight), sync_dist=True)
        return loss.summed, loss.count

    def training_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> Tensor:
        # train/loss is logged once per optimizer step, over its global batch (TridentTask.on_before_optimizer_step).
        return self.trained(self.objective(self, batch, "train")[0])

    def validation_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> None:
        self.evaluated_loss("val", *self._loss(batch, "val"))

    def test_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> None:
        self.evaluated_loss("test", *self._loss(batch, "test"))

    def on_test_epoch_end(self) -> None:
        # What the quality costs (KV-cache bytes, decoding speed, trainable parameters) is measured by
        # trident.training.callbacks.ModelCosts (conf/task/lm.yaml's callbacks.model_costs).
        self.log_epoch_loss("test", with_perplexity=True)

    def on_validation_epoch_end(self) -> None:
        self.log_epoch_loss("val", with_perplexity=True)
        if self.trainer.sanity_checking:
            return
        # Every rank enters: under FSDP, gathering the weights for rank 0's samples takes them all. Under tensor
        # parallelism every forward is collective: every rank samples (the same tokens: same logits, same seed).
        with whole_weights(self.net):
            samples = self.sample_texts() if self.trainer.is_global_zero or is_tensor_parallel(self.net) else []
        if samples and self.trainer.is_global_zero:
            log_text_table(self, "samples", ["step", "prompt", "sample"], [[self.global_step, p, s] for p, s in samples])

    def sample_texts(self) -> list[tuple[str, str]]:
        """Continue each configured prompt with the sampling settings; returns (prompt, text) pairs."""
        if self.tokenizer is None or not self.sample_prompts:
            return []
        settings = dict(self.sampling)
        generator = torch.Generator(device=self.device).manual_seed(int(settings.pop("seed", 0)))
        results = []
        was_training = self.training
        self.eval()
        encoder = plain_encoder(self.tokenizer)  # prompts encoded as the training text is (no <s> ... </s>, no padding)
        for prompt in self.sample_prompts:
            ids = torch.tensor([encoder.encode(prompt, add_special_tokens=False).ids], device=self.device)
            out = generate(self.net, ids, generator=generator, **settings)
            results.append((prompt, self.tokenizer.decode(out[0].tolist())))
        self.train(was_training)
        return results


def check_memory_run(cfg: DictConfig) -> None:
    """``model.memory_length`` reads plain text (data=shakespeare, text_files, ...: not packed conversations or
    preference pairs, so the next-token objective) as contiguous segments of ``data.block_size`` tokens, which its
    segments at inference (``data.max_seq_len``) must equal: one line for what does not fit."""
    import hydra.utils

    if not cfg.model.get("memory_length"):
        return
    if hydra.utils.get_class(cfg.data._target_) is not LMDataModule:
        raise ConfigError(f"model.memory_length reads plain text as contiguous segments; data={cfg.data.name} packs other "
                          "examples: use a text corpus (data=shakespeare, text_files, ...), or model.memory_length=0")
    if not cfg.data.get("contiguous"):
        raise ConfigError("model.memory_length needs data.contiguous=true (each batch row continuing the previous "
                          "batch's): remove the data.contiguous=false override")
    if cfg.data.block_size != cfg.data.max_seq_len:
        raise ConfigError(f"model.memory_length: a segment is data.block_size={cfg.data.block_size} tokens in training "
                          f"and data.max_seq_len={cfg.data.max_seq_len} at inference: set data.block_size="
                          f"{cfg.data.max_seq_len} (an init_from source fixes data.max_seq_len), or data.max_seq_len="
                          f"{cfg.data.block_size}")
