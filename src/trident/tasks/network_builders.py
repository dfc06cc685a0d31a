"""How each task builds its network (``net``) from its hyperparameters, in a module that imports no Lightning: the
task's constructor builds its ``net`` with its builder here, and trident.weights.network rebuilds the same network
from a checkpoint alone (its hyperparameters) for the commands that need the network and not the task
(``trident-export --format hf``, ``trident-sample``, ``trident-chat``), which then start without Lightning.

A builder takes the backbone's :class:`TransformerConfig` and, by keyword, the task's hyperparameters it reads
(its parameters' names are the task constructor's; no defaults here: the constructor's are the only ones, and a
checkpoint that lacks one of them is rebuilt as its task). A task without a builder here is always read as its task.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from trident.backbone import TransformerConfig
from trident.models import CausalLM, EncoderDecoder, MaskedLM, SequenceClassifier, VisionTransformer

NetworkBuilder = Callable[..., nn.Module]


def causal_lm(backbone: TransformerConfig, *, vocab_size: int, tie_embeddings: bool,
              scale_embeddings: bool) -> CausalLM:
    return CausalLM(backbone, vocab_size, tie_embeddings=tie_embeddings, scale_embeddings=scale_embeddings)


def masked_lm(backbone: TransformerConfig, *, vocab_size: int, scale_embeddings: bool) -> MaskedLM:
    return MaskedLM(backbone, vocab_size, scale_embeddings=scale_embeddings)


def encoder_decoder(backbone: TransformerConfig, *, vocab_size: int, pad_id: int, tie_embeddings: str | bool,
                    scale_embeddings: bool) -> EncoderDecoder:
    return EncoderDecoder(backbone, vocab_size, pad_id=pad_id, tie_embeddings=tie_embeddings,
                          scale_embeddings=scale_embeddings)


def vision_transformer(backbone: TransformerConfig, *, patch_size: int, in_channels: int, num_classes: int,
                       pool: str) -> VisionTransformer:
    return VisionTransformer(backbone, patch_size=patch_size, in_channels=in_channels, num_classes=num_classes,
                             pool=pool)


def sequence_classifier(backbone: TransformerConfig, *, vocab_size: int, class_names: list[str], stack: str,
                        pool: str, scale_embeddings: bool, class_token_in_text: bool) -> SequenceClassifier:
    return SequenceClassifier(backbone, vocab_size, len(class_names), stack=stack, pool=pool,
                              scale_embeddings=scale_embeddings, class_token_in_text=class_token_in_text)


#: Each task's builder, by the task class its checkpoints name (trident.tasks.task_in_checkpoint.TASK_KEY): what
#: a checkpoint says of itself before anything is imported (tests/test_command_startup.py holds each task to it).
BUILDERS: dict[str, NetworkBuilder] = {
    "trident.tasks.lm.LanguageModelTask": causal_lm,
    "trident.tasks.mlm.MaskedLanguageModelTask": masked_lm,
    "trident.tasks.translation.TranslationTask": encoder_decoder,
    "trident.tasks.vit.ImageClassificationTask": vision_transformer,
    "trident.tasks.classify.SequenceClassificationTask": sequence_classifier,
}


def build_from_settings(task: str | None, settings: Mapping[str, Any]) -> nn.Module | None:
    """The network of the task class ``task`` (as a checkpoint names it) with the hyperparameters ``settings``;
    None when that task has no builder or ``settings`` lack one of its settings (a checkpoint of an earlier version:
    its task's constructor supplies the default)."""
    build = BUILDERS.get(task or "")
    backbone = settings.get("backbone")
    if build is None or not isinstance(backbone, Mapping):
        return None
    names = list(inspect.signature(build).parameters)[1:]
    if any(name not in settings for name in names):
        return None
    return build(TransformerConfig(**backbone), **{name: settings[name] for name in names})
