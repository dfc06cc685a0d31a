"""Machine translation as a LightningModule: label-smoothed training, greedy / beam decoding,
sacreBLEU and chrF on detokenised text, a table of example translations at each validation."""

from __future__ import annotations

import math
import unicodedata
from typing import Any, ClassVar

import sacrebleu
import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import Tensor
from torch.export import Dim
from torchmetrics import MeanMetric

from trident.data.base import TridentDataModule
from trident.data.batching import TranslationBatch
from trident.data.masking import IGNORE_INDEX
from trident.data.special_tokens import SEQ_START_TOKEN
from trident.data.translation import TranslationDataModule, detokenize, language_of
from trident.errors import ConfigError, is_int
from trident.models.decoding import SCORINGS, Decoding, Hypothesis, beam_search, greedy_decode
from trident.models.properties import (
    DECODER_START,
    LOGITS_BIAS,
    MAX_SEQ_LEN,
    RESCALED_HEAD,
    SCALED_EMBEDDING,
    SHARED_EMBEDDINGS,
    SOURCE_BOS,
    START_BEFORE_BOS,
)
from trident.models.seq2seq import EncoderDecoder
from trident.objectives import TRAIN, Outputs
from trident.parallel.fsdp import whole_weights
from trident.tasks.base import TRANSLATE, NetInput, TridentTask, token_ids
from trident.tasks.network_builders import encoder_decoder
from trident.tasks.teacher import add_teacher, taught, teacher_flops
from trident.tracking.text_logging import log_text_table
from trident.training.chunked_loss import DEFAULT_LOSS_CHUNK, check_loss_chunk
from trident.training.flops import encoder_decoder_flops

# sacreBLEU's choice by target language (its BLEU(trg_lang=...): zh, ja-mecab, ko-mecab; 13a otherwise), less the
# tokenizers that need MeCab and a dictionary: Japanese is scored on characters and Korean (written with spaces) with
# 13a unless task.bleu_tokenize names ja-mecab / ko-mecab where `sacrebleu[ja]` / `sacrebleu[ko]` is installed.
# ISO 639-2/3 codes too (FLORES / NLLB name files and columns zho_Hans, jpn_Jpan), which sacreBLEU itself does not map.
BLEU_TOKENIZE_BY_LANGUAGE = {"zh": "zh", "zho": "zh", "chi": "zh", "cmn": "zh", "yue": "zh", "ja": "char", "jpn": "char"}


def choose_bleu_tokenize(choice: str, tgt_lang: str | None) -> str:
    """``task.bleu_tokenize`` -> a sacreBLEU tokenizer: ``auto`` picks it from the target language."""
    if choice == "auto":
        return BLEU_TOKENIZE_BY_LANGUAGE.get(language_of(tgt_lang), "13a") if tgt_lang else "13a"
    if choice not in sacrebleu.BLEU.TOKENIZERS:
        raise ConfigError(f"task.bleu_tokenize={choice} is not a sacreBLEU tokenizer: choose auto or one of "
                          f"{', '.join(sacrebleu.BLEU.TOKENIZERS)}")
    try:
        sacrebleu.BLEU(tokenize=choice)
    except RuntimeError as err:  # ja-mecab / ko-mecab without their packages
        raise ConfigError(f"task.bleu_tokenize={choice} needs packages that are not installed "
                          f"({str(err).strip().splitlines()[-1].strip()}), or choose auto") from err
    return choice


def corpus_scores(hypotheses: list[str], references: list[str], tokenize: str = "13a") -> dict[str, float]:
    """sacreBLEU (``tokenize``, exp smoothing) and chrF on detokenised text, both sides in Unicode NFC: the
    trained tokenizer writes its output in NFC, so an NFD reference would not match an exact translation."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses for {len(references)} references: they must pair one to one")
    hypotheses = [unicodedata.normalize("NFC", h) for h in hypotheses]
    references = [unicodedata.normalize("NFC", r) for r in references]
    return {
        "bleu": sacrebleu.corpus_bleu(hypotheses, [references], tokenize=tokenize).score,
        "chrf": sacrebleu.corpus_chrf(hypotheses, [references]).score,
    }


class TranslationTask(TridentTask):
    NAME = "translation"
    # What its checkpoint fixes as init_from; what a Hugging Face BART or T5 states (trident.weights.adapters.hf_bart,
    # hf_t5).
    SOURCE_SETTINGS = ("tie_embeddings", "scale_embeddings", "logits_bias", "decoder_start_id", "rescale_head",
                       "embedding_rows")
    SOURCE_DATA_SETTINGS = ("decoder_start",)  # the decoder's first token the network was trained from (T5's <pad>)
    OUTSIDE_NETWORK = EncoderDecoder
    FROM_NETWORK: ClassVar[dict[str, str]] = {
        SHARED_EMBEDDINGS: "task.tie_embeddings", SCALED_EMBEDDING: "task.scale_embeddings", MAX_SEQ_LEN: "data.max_seq_len",
        LOGITS_BIAS: "task.logits_bias", START_BEFORE_BOS: "task.decoder_start_id", SOURCE_BOS: "data.source_bos",
        RESCALED_HEAD: "task.rescale_head", DECODER_START: "data.decoder_start",
    }
    VALIDATION_METRICS = ("val/loss", "val/ppl", "val/bleu", "val/chrf")
    DATA_MODULE: ClassVar[type[TridentDataModule]] = TranslationDataModule
    ENCODER_DECODER = True
    TRAINS_WITH = ("target_sequence",)
    CAPABILITIES = frozenset({TRANSLATE})
    net: EncoderDecoder

    def __init__(
        self,
        backbone: dict[str, Any],
        vocab_size: int,
        optimizer: dict[str, Any],
        scheduler: dict[str, Any],
        pad_id: int = 0,
        bos_id: int = 1,
        eos_id: int = 2,
        tie_embeddings: str | bool = "all",
        scale_embeddings: bool = True,
        rescale_head: bool = False,
        embedding_rows: int | None = None,
        label_smoothing: float = 0.1,
        beam_size: int = 4,
        val_beam_size: int = 1,
        length_penalty: float = 0.6,
        max_len_a: float = 1.2,
        max_len_b: int = 10,
        test_greedy: bool = True,
        num_examples: int = 8,
        tokenizer_json: str | None = None,
        lora: dict[str, Any] | None = None,
        nf4: dict[str, Any] | None = None,
        tgt_lang: str | None = None,
        bleu_tokenize: str = "auto",
        objective: dict[str, Any] | None = None,
        distill: dict[str, Any] | None = None,
        logits_bias: bool = False,
        decoder_start_id: int | None = None,
        scoring: str = "auto",
        source_bos: bool = False,
        source_prefix: str = "",
        decoder_start: str = SEQ_START_TOKEN,
        loss_chunk: int | None = DEFAULT_LOSS_CHUNK,
    ) -> None:
        super().__init__(backbone, optimizer, scheduler, tokenizer_json, lora=lora, nf4=nf4, objective=objective)
        if scoring not in ("auto", *SCORINGS):
            raise ConfigError(f"task.scoring={scoring} is not a beam scoring: choose auto or one of {', '.join(SCORINGS)}")
        if decoder_start_id is not None and not (is_int(decoder_start_id) and 0 <= decoder_start_id < vocab_size):
            raise ConfigError(f"task.decoder_start_id={decoder_start_id} is not a token id of the vocabulary (0 to "
                              f"{vocab_size - 1}): set one (BART's </s>), or null to start the decoder from <s>")
        # auto: as the convention the decoder was trained in decodes: a Hugging Face source's (BART's start before <s>,
        # T5's <pad> in place of it) as generate; trident's own (the decoder from <s>) with GNMT's penalty.
        if scoring == "auto":
            scoring = "gnmt" if decoder_start_id is None and decoder_start == SEQ_START_TOKEN else "transformers"
        self.net = encoder_decoder(self.backbone_config, vocab_size=vocab_size, embedding_rows=embedding_rows,
                                   pad_id=pad_id,
                                   tie_embeddings=tie_embeddings, scale_embeddings=scale_embeddings,
                                   logits_bias=logits_bias, decoder_start_id=decoder_start_id,
                                   rescale_head=rescale_head)
        # Read by training and decoding here; the network keeps it too, for its export (decoder_start_token_id).
        self.scoring, self.decoder_start_id = scoring, decoder_start_id
        self.pad_id, self.bos_id, self.eos_id = pad_id, bos_id, eos_id
        self.source_bos = source_bos  # the data's (data.source_bos): free text to translate starts with <s> too
        self.objective = self.chosen_objective(label_smoothing=label_smoothing)
        self.loss_chunk = check_loss_chunk(loss_chunk)  # tokens per chunk of the loss (trident.training.chunked_loss)
        add_teacher(self, distill, vocab_size=self.net.vocab_size)  # distill=kd: a teacher of the same vocabulary
        # Decoding settings as attributes, so the translate command can override them per call.
        self.beam_size, self.val_beam_size, self.length_penalty = beam_size, val_beam_size, length_penalty
        self.max_len_a, self.max_len_b = max_len_a, max_len_b
        # Never generated, as PAD and BOS: a source's token rows past the tokenizer (task.embedding_rows), no token's.
        self.padded_rows = tuple(range(vocab_size, self.net.vocab_size))
        self.source_prefix = source_prefix  # the data's (data.source_prefix): free text to translate gets it too
        self.decoder_start = decoder_start  # the token of bos_id (data.decoder_start), which a later init_from keeps
        self.test_greedy, self.num_examples = test_greedy, num_examples
        self.bleu_tokenize = choose_bleu_tokenize(bleu_tokenize, tgt_lang)  # the data module passes its tgt_lang
        self.val_nll = MeanMetric()  # token-weighted, for perplexity = exp(mean NLL)
        self.test_nll = MeanMetric()
        # (source, reference, hypothesis) per evaluated sentence, per decoder, for corpus BLEU.
        self._outputs: dict[str, list[tuple[str, str, str]]] = {}

    @classmethod
    def validate_config(cls, cfg: DictConfig) -> None:
        """Also: with a decoder start (BART's), the decoder's input is one token longer than the data's target, which
        the position table must hold."""
        super().validate_config(cfg)
        check_loss_chunk(cfg.task.get("loss_chunk"))
        start, longest, table = cfg.task.get("decoder_start_id"), cfg.data.get("max_len"), cfg.data.get("max_seq_len")
        if start is not None and longest is not None and table is not None and longest >= table:
            # A source's table is fixed (BART's max_position_embeddings); trident's own follows data.max_len by default.
            fix = f"data.max_len={table - 1} or less" if cfg.get("init_from") else f"data.max_seq_len={longest + 1} or more"
            raise ConfigError(f"data.max_len={longest} leaves no room for the decoder's start token (task.decoder_start_id="
                              f"{start}) in the {table} positions of data.max_seq_len: set {fix}")

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        return self.net(src, tgt_in)

    def example_input(self) -> list[NetInput]:
        """Source ids (padded with ``pad_id``) and the decoder's input ids, each of its own length -> the
        decoder's logits (teacher forcing)."""
        longest = self.net.max_positions
        src, src_dynamic = token_ids(self.net.vocab_size, longest)
        src[0, src.shape[1] // 2:] = self.pad_id
        tgt_in = torch.randint(0, self.net.vocab_size, (2, min(6, longest)))  # (B, T)
        tgt_dynamic = {0: src_dynamic[0], 1: Dim("target_length", min=1, max=longest)}
        return [NetInput("src", "source_ids", src, src_dynamic), NetInput("tgt_in", "target_ids", tgt_in, tgt_dynamic)]

    def throughput_units(self, batch: TranslationBatch) -> dict[str, int]:
        """Real (non-padding) source and target tokens, and sentence pairs."""
        src_tokens, tgt_tokens, pairs = self._real(batch)
        return {"tokens": src_tokens + tgt_tokens, "target_tokens": tgt_tokens, "samples": pairs}

    def _real(self, batch: TranslationBatch) -> tuple[int, int, int]:
        """Source tokens, target tokens and pairs of ``batch``'s rows with a target: a length bucket's filler rows
        (trident.data.batching.collate_pairs) repeat a source and have none."""
        targets = batch["tgt_out"].ne(self.pad_id)  # (B, T)
        rows = targets.any(dim=1)  # (B,)
        return int(batch["src"][rows].ne(self.pad_id).sum()), int(targets.sum()), int(rows.sum())

    def flops_per_batch(self, batch: TranslationBatch) -> int:
        """Model FLOPs of one training step on ``batch``, padding included (forward and backward, for MFU)."""
        (size, src_len), tgt_len = batch["src"].shape, self.decoder_io(batch)[0].size(1)  # with a decoder start
        # distill=kd: the teacher's forward on the same batch too.
        return encoder_decoder_flops(self.net.cfg, self.net.vocab_size, size, src_len, tgt_len) + teacher_flops(
            self, lambda teacher: encoder_decoder_flops(teacher.cfg, teacher.vocab_size, size, src_len, tgt_len,
                                                        training=False))

    def outputs(self, batch: TranslationBatch, stage: str) -> Outputs:
        """The decoder's logits (B, T, V) under teacher forcing, or with ``task.loss_chunk`` its head and hidden
        states (B, T, D) (trident.objectives.base), and the target tokens (B, T), IGNORE_INDEX at the target's
        padding."""
        tgt_in, tgt_out = self.decoder_io(batch)
        scores = self.net(batch["src"], tgt_in, chunk=self.loss_chunk)  # (B, T, V) or the head
        targets = tgt_out.masked_fill(tgt_out == self.pad_id, IGNORE_INDEX)
        # distill=kd: the teacher scores the same target prefixes, teacher-forced as the student.
        return taught(self, Outputs(scores, targets), stage, lambda teacher: teacher(batch["src"], tgt_in))

    def decoder_io(self, batch: TranslationBatch) -> tuple[Tensor, Tensor]:
        """The decoder's input and targets (B, T): the data's ``<s> tokens`` -> ``tokens </s>``; with a decoder start
        (BART's convention, ``task.decoder_start_id``) ``start <s> tokens`` -> ``<s> tokens </s>``, as transformers'
        ``shift_tokens_right`` makes of BART's labels."""
        tgt_in, tgt_out = batch["tgt_in"], batch["tgt_out"]
        start = self.decoder_start_id
        if start is None:
            return tgt_in, tgt_out
        # A length bucket's filler rows (trident.data.batching.collate_pairs) have no target: their <s> stays padding.
        first = torch.full_like(tgt_out[:, :1], self.bos_id).masked_fill(tgt_out.eq(self.pad_id).all(1, keepdim=True),
                                                                           self.pad_id)  # (B, 1)
        return torch.cat((torch.full_like(tgt_in[:, :1], start), tgt_in), dim=1), torch.cat((first, tgt_out), dim=1)

    def training_step(self, batch: TranslationBatch, batch_idx: int) -> Tensor:
        loss, _ = self.objective(self, batch, TRAIN)
        padded = batch["src"].numel() + batch["tgt_in"].numel()
        # tgt_in's real positions are tgt_out's (shifted by one): its start token may be the padding id (T5's <pad>).
        real = sum(self._real(batch)[:2])
        # Each metric of the optimizer step's global batch, logged once per step (TridentTask.on_before_optimizer_step):
        # the NLL over its target tokens (the objective's part nll_loss, logged as the loss is); padding over its
        # positions. What token-budget batching is for: compute spent on padding (fairseq keeps it small).
        self.step_metric("train/padding_fraction", padded - real, padded)
        self.step_metric("train/tokens_per_batch", loss.count, 1)  # the mean micro-batch of a rank
        return self.trained(loss)

    def _evaluate(self, batch: TranslationBatch, stage: str, nll_metric: MeanMetric) -> None:
        loss, _ = self.objective(self, batch, stage)
        self.evaluated_loss(stage, loss.summed, loss.count)
        nll, count = loss.parts["nll_loss"]
        nll_metric.update(nll, weight=count)
        for suffix, beam in self._decoders(stage).items():
            with whole_weights(self.net):  # under FSDP, each rank's decoding loop stops when its own batch is done
                hypotheses = self.decode_ids(batch["src"], beam_size=beam)
            texts = [self._detokenize(h.tokens) for h in hypotheses]
            # strict: a hypothesis paired with another sentence's reference would score every later one wrong.
            self._outputs.setdefault(suffix, []).extend(zip(batch["src_text"], batch["tgt_text"], texts, strict=True))

    def _decoders(self, stage: str) -> dict[str, int]:
        """Metric-name suffix -> beam size: validation decodes once, test also greedily."""
        decoders = {"": self.val_beam_size if stage == "val" else self.beam_size}
        if stage == "test" and self.test_greedy and self.beam_size > 1:
            decoders["_greedy"] = 1
        return decoders

    def validation_step(self, batch: TranslationBatch, batch_idx: int) -> None:
        self._evaluate(batch, "val", self.val_nll)

    def test_step(self, batch: TranslationBatch, batch_idx: int) -> None:
        self._evaluate(batch, "test", self.test_nll)

    def on_validation_epoch_start(self) -> None:
        self._outputs = {}

    def on_test_epoch_start(self) -> None:
        self._outputs = {}

    def on_validation_epoch_end(self) -> None:
        self.log_epoch_loss("val")
        rows = self._score("val", self.val_nll)
        if rows and not self.trainer.sanity_checking and self.trainer.is_global_zero:
            examples = [[self.global_step, *row] for row in rows[: self.num_examples]]
            log_text_table(self, "translations", ["step", "source", "reference", "hypothesis"], examples)

    def on_test_epoch_end(self) -> None:
        self.log_epoch_loss("test")
        self._score("test", self.test_nll)

    def _score(self, stage: str, nll_metric: MeanMetric) -> list[tuple[str, str, str]]:
        """Corpus BLEU / chrF over all ranks' sentences; perplexity from the token-weighted NLL."""
        # Values are the same on every rank (synced metric, gathered corpus): sync_dist averages
        # equal numbers, and keeps them available to ModelCheckpoint on every rank.
        self.log(f"{stage}/ppl", math.exp(min(float(nll_metric.compute()), 50.0)), sync_dist=True)
        nll_metric.reset()
        first: list[tuple[str, str, str]] = []
        # The same sequence of collective calls on every rank, whatever each rank decoded.
        for suffix in self._decoders(stage):
            rows = _gather(self._outputs.get(suffix, []))
            if not rows:
                continue
            scores = corpus_scores([r[2] for r in rows], [r[1] for r in rows], self.bleu_tokenize)
            for name, value in scores.items():
                self.log(f"{stage}/{name}{suffix}", value, prog_bar=name == "bleu" and not suffix, sync_dist=True)
            first = first or rows
        self._outputs = {}
        return first

    def decode_ids(self, src: Tensor, *, beam_size: int, use_cache: bool = True) -> list[Hypothesis]:
        """Translate (B, S) source ids (each ending in EOS, right-padded) with greedy or beam search: one
        hypothesis per row, in order."""
        start = self.decoder_start_id
        # BART's convention: the decoder starts from its start token and must generate <s> first (forced_bos_token_id).
        decoding = Decoding(self.bos_id if start is None else start, self.eos_id, self.max_len_a, self.max_len_b,
                            (self.pad_id, self.bos_id, *self.padded_rows), use_cache, first_id=None if start is None else self.bos_id,
                            scoring=self.scoring)
        if beam_size <= 1:
            hypotheses = greedy_decode(self.net, src, decoding)
        else:
            hypotheses = beam_search(self.net, src, decoding, beam_size=beam_size, alpha=self.length_penalty)
        if len(hypotheses) != src.size(0):
            raise RuntimeError(f"decoding returned {len(hypotheses)} hypotheses for {src.size(0)} sentences")
        return hypotheses

    def translate(self, texts: list[str], *, beam_size: int | None = None, use_cache: bool = True) -> list[str]:
        """Free text in, detokenised translations out (the ``trident.commands.translate`` command)."""
        if self.tokenizer is None:
            raise RuntimeError("this task has no tokenizer: load it from a trident translation checkpoint")
        if not texts:
            return []
        # As the data wrote the sources it trained on: the tokenizer's <s> (bos_id is the decoder's start: T5's <pad>).
        start = [self.tokenizer.token_to_id(SEQ_START_TOKEN)] if self.source_bos else []
        keep = self.net.max_positions - 1 - len(start)  # room for EOS (and BOS)
        sources = [self.source_prefix + t.strip() for t in texts]
        encoded = self.tokenizer.encode_batch(sources, add_special_tokens=False)
        rows = [start + e.ids[:keep] + [self.eos_id] for e in encoded]
        src = torch.full((len(rows), max(len(r) for r in rows)), self.pad_id, dtype=torch.long, device=self.device)
        for i, row in enumerate(rows):
            src[i, : len(row)] = torch.tensor(row, device=self.device)
        was_training = self.training
        self.eval()
        hypotheses = self.decode_ids(src, beam_size=self.beam_size if beam_size is None else beam_size,
                                     use_cache=use_cache)
        self.train(was_training)
        return [self._detokenize(h.tokens) for h in hypotheses]

    def _detokenize(self, ids: list[int]) -> str:
        return detokenize(self.tokenizer, ids) if self.tokenizer is not None else " ".join(map(str, ids))


def _gather(rows: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """Every rank's (source, reference, hypothesis) rows, on every rank (strings, so not all_gather)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return rows
    gathered: list[list[tuple[str, str, str]] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows)
    return [row for part in gathered for row in (part or [])]
