"""The GPU-scale workloads of the ``mfu`` and ``speed`` rows: trident's own tasks, built as ``python train.py`` builds
them from the same overrides (Hydra compose, :func:`trident.runs.pipeline.check_config`, the task's constructor),
fed synthetic batches shaped as their data modules collate them.

* ``lm``: ``task=lm model=base``, 1,024 tokens, GPT-2's vocabulary padded to 50,304 (nanoGPT's MFU shape).
* ``translation``: ``task=translation model=transformer_base data=wmt14_en_de``: the paper's model and its data's
  vocabulary (37,000) and token budget (``data.max_tokens``, 25,000 padded tokens): one length bucket of
  :data:`BUCKET` tokens, each sentence's length drawn in its top eighth (a token-budget batch holds neighbours of a
  length-sorted corpus), so that the batch's shape stays fixed and compilation holds.
* ``vit``: ``task=vit model=base data=imagenet``: ViT-B/16 at 224 px, 1,000 classes.

Units (tokens, target tokens, images) and model FLOPs are the task's own ``throughput_units`` and ``flops_per_batch``:
what the ``Throughput`` callback logs in training. ``--quick`` builds ``model=nano`` at tiny shapes.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor

from trident.converters import converter_settings
from trident.runs.compose import compose_train_config
from trident.runs.pipeline import check_config, constructor_args, instantiate
from trident.tasks.base import TridentTask
from trident.training.optim import fused_allowed

Batch = Any  # what the task's data module collates: a tuple of tensors, or a dict of them

# The special ids trident's tokenizers give <pad>, <s> and </s> (trident.data.special_tokens: listed first).
PAD, BOS, EOS = 0, 1, 2
BUCKET = 64  # padded sentence length of the translation batch: WMT14 en-de averages ~30 BPE tokens a sentence


class Workload(ABC):
    """One task at ``model=base``: its train.py overrides, what its data module would hand the task, its batches."""

    KEY: ClassVar[str]  # lm | translation | vit: the prefix of the row names
    UNIT: ClassVar[str]  # the key of the task's throughput_units counted as the rate
    OVERRIDES: ClassVar[tuple[str, ...]]
    QUICK: ClassVar[tuple[str, ...]]  # --quick: model=nano at tiny shapes
    TARGET: ClassVar[float]  # the bf16 MFU the issue asks for (#57)

    def __init__(self, quick: bool) -> None:
        self.quick = quick

    def compose(self, variant: Sequence[str] = ()) -> DictConfig:
        """The config ``python train.py <overrides> <variant>`` composes."""
        return compose_train_config([*self.OVERRIDES, *(self.QUICK if self.quick else ()), *variant])

    @functools.cached_property
    def base(self) -> DictConfig:
        """The config without a variant (composed once: a composition takes a second or two)."""
        return self.compose()

    def build(self, cfg: DictConfig) -> TridentTask:
        """The task train.py builds from ``cfg`` (trident.runs.pipeline.build_data_and_task), with the data's inputs
        given by :meth:`task_inputs` instead of a prepared corpus."""
        backbone = check_config(cfg)
        plain = OmegaConf.to_container(cfg, resolve=True)
        assert isinstance(plain, dict)
        return instantiate(constructor_args(cfg, "task"), backbone=vars(backbone),
                           optimizer=fused_allowed(plain["optimizer"], str(cfg.trainer.precision),
                                                   cfg.trainer.get("gradient_clip_val")),
                           scheduler=plain["scheduler"], **converter_settings(cfg, backbone), **self.task_inputs(cfg),
                           _convert_="all", _recursive_=False)

    @abstractmethod
    def task_inputs(self, cfg: DictConfig) -> dict[str, Any]:
        """What the data module's ``task_inputs`` would give: vocabulary, classes, special ids."""

    @abstractmethod
    def batch(self, cfg: DictConfig, size: int, device: torch.device) -> Batch:
        """A training batch of ``size`` sequences (images), as the data module collates it."""

    @abstractmethod
    def max_batch(self, cfg: DictConfig) -> int:
        """The batch the measurement starts from (halved until a step fits)."""

    @abstractmethod
    def describe(self, cfg: DictConfig) -> str:
        """The row's workload: model, shapes."""

    def sizes(self, cfg: DictConfig) -> str:
        return f"d={cfg.model.d_model}, {cfg.model.n_layers} layers"

    def loss(self, cfg: DictConfig) -> str:
        """The loss's chunking where the task has it (task.loss_chunk: tokens scored at a time; 0: whole logits)."""
        return f", task.loss_chunk={cfg.task.loss_chunk}" if "loss_chunk" in cfg.task else ""


class LanguageModel(Workload):
    KEY, UNIT, TARGET = "lm", "tokens", 0.45
    OVERRIDES = ("task=lm", "model=base", "data.block_size=1024")
    QUICK = ("model=nano", "data.block_size=16")

    def vocab(self) -> int:
        return 64 if self.quick else 50304  # GPT-2's 50,257 padded to a multiple of 64

    def task_inputs(self, cfg: DictConfig) -> dict[str, Any]:
        return {"vocab_size": self.vocab()}

    def batch(self, cfg: DictConfig, size: int, device: torch.device) -> tuple[Tensor, Tensor]:
        ids = torch.randint(0, self.vocab(), (size, int(cfg.data.block_size) + 1), device=device)
        return ids[:, :-1], ids[:, 1:]  # inputs, targets (B, T)

    def max_batch(self, cfg: DictConfig) -> int:
        return 2 if self.quick else 64

    def describe(self, cfg: DictConfig) -> str:
        return (f"LM model={cfg.model.name} ({self.sizes(cfg)}), {cfg.data.block_size} tokens, vocab {self.vocab()}"
                + self.loss(cfg))


class Translation(Workload):
    KEY, UNIT, TARGET = "translation", "target_tokens", 0.30
    OVERRIDES = ("task=translation", "model=transformer_base", "data=wmt14_en_de")
    QUICK = ("model=nano", "data.vocab_size=64", "data.max_tokens=64")

    def bucket(self) -> int:
        return 8 if self.quick else BUCKET

    def task_inputs(self, cfg: DictConfig) -> dict[str, Any]:
        return {"vocab_size": int(cfg.data.vocab_size), "pad_id": PAD, "bos_id": BOS, "eos_id": EOS,
                "tgt_lang": str(cfg.data.tgt_lang)}

    def batch(self, cfg: DictConfig, size: int, device: torch.device) -> dict[str, Tensor]:
        """Sources ``tokens </s>`` and targets ``<s> tokens </s>`` (split into the decoder's input and output), their
        lengths in the bucket's top eighth, padded to the bucket (collate_pairs' layout)."""
        bucket, vocab = self.bucket(), int(cfg.data.vocab_size)
        generator = torch.Generator().manual_seed(0)
        src = torch.randint(EOS + 1, vocab, (size, bucket), generator=generator)
        tgt = torch.randint(EOS + 1, vocab, (size, bucket + 1), generator=generator)
        tgt[:, 0] = BOS
        for rows in (src, tgt):
            span = rows.size(1)
            ends = torch.randint(span - span // 8, span + 1, (size, 1), generator=generator)  # (B, 1) lengths
            positions = torch.arange(span)[None, :]
            rows[positions == ends - 1] = EOS
            rows[positions >= ends] = PAD
        return {"src": src.to(device), "tgt_in": tgt[:, :-1].to(device), "tgt_out": tgt[:, 1:].to(device)}

    def max_batch(self, cfg: DictConfig) -> int:
        return int(cfg.data.max_tokens) // self.bucket()  # fairseq's budget: sentences x padded length

    def describe(self, cfg: DictConfig) -> str:
        layers = cfg.model.n_layers
        return (f"translation model={cfg.model.name} (d={cfg.model.d_model}, {layers}+{layers} layers), pairs of "
                f"{self.bucket() - self.bucket() // 8}-{self.bucket()} tokens (data.max_tokens={cfg.data.max_tokens}), "
                f"vocab {cfg.data.vocab_size}{self.loss(cfg)}")


class ImageClassifier(Workload):
    KEY, UNIT, TARGET = "vit", "images", 0.40
    OVERRIDES = ("task=vit", "model=base", "data=imagenet")
    QUICK = ("model=nano", "data.image_size=16", "data.patch_size=4")

    def classes(self) -> int:
        return 10 if self.quick else 1000

    def task_inputs(self, cfg: DictConfig) -> dict[str, Any]:
        data = cfg.data
        return {"num_classes": self.classes(), "image_size": int(data.image_size), "in_channels": int(data.in_channels),
                "patch_size": int(data.patch_size), "class_names": [str(i) for i in range(self.classes())],
                "mean": list(data.mean), "std": list(data.std)}

    def batch(self, cfg: DictConfig, size: int, device: torch.device) -> tuple[Tensor, Tensor]:
        side = int(cfg.data.image_size)
        images = torch.randn(size, int(cfg.data.in_channels), side, side, device=device)  # (B, C, H, W)
        return images, torch.randint(0, self.classes(), (size,), device=device)

    def max_batch(self, cfg: DictConfig) -> int:
        return 2 if self.quick else 512

    def describe(self, cfg: DictConfig) -> str:
        return (f"ViT-B/{cfg.data.patch_size} model={cfg.model.name} ({self.sizes(cfg)}), {cfg.data.image_size} px, "
                f"{self.classes()} classes")


WORKLOADS: tuple[type[Workload], ...] = (LanguageModel, Translation, ImageClassifier)
