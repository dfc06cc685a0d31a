"""How each task builds its network (``net``) from its hyperparameters, in a module that imports no Lightning: the
task's constructor builds its ``net`` with its builder here, and trident.weights.network rebuilds the same network
from a checkpoint alone (its hyperparameters) for the commands that need the network and not the task
(``trident-export --format hf``, ``trident-sample``, ``trident-chat``), which then start without Lightning.

A builder takes the backbone's :class:`TransformerConfig` and, by keyword, the task's hyperparameters it reads
(its parameters' names are the task constructor's; a default here only for a setting younger than some checkpoints,
the constructor's, so that they still build alone; a checkpoint that lacks another is rebuilt as its task). A task without a builder here is always read as its task.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from trident.backbone import TransformerConfig
from trident.errors import ConfigError, did_you_mean
from trident.models import (
    CausalLM,
    EncoderDecoder,
    MaskedLM,
    ReplacedTokenDetector,
    SequenceClassifier,
    VisionTransformer,
    vit_geometry,
)
from trident.models.clip import CLIP
from trident.models.electra_generator import generator_config

NetworkBuilder = Callable[..., nn.Module]


def table_rows(vocab_size: int, rows: int | None) -> int:
    """The rows of a network's token table: the tokenizer's ``vocab_size`` tokens, or ``rows`` (``task.embedding_rows``)
    where a source's table is padded past its tokenizer (Qwen2: 151936 rows, 151665 tokens; T5: 32128, 32100). The
    extra rows are kept as the source has them, so that its weights load and the export writes them back."""
    if rows is None:
        return vocab_size
    if rows < vocab_size:
        raise ConfigError(f"task.embedding_rows={rows} is below the tokenizer's {vocab_size} tokens: drop "
                          "task.embedding_rows (an init_from source with a padded token table sets it)")
    return rows


def causal_lm(backbone: TransformerConfig, *, vocab_size: int, tie_embeddings: bool, scale_embeddings: bool,
              embedding_rows: int | None = None) -> CausalLM:
    return CausalLM(backbone, table_rows(vocab_size, embedding_rows), tie_embeddings=tie_embeddings,
                    scale_embeddings=scale_embeddings)


def masked_lm(backbone: TransformerConfig, *, vocab_size: int, scale_embeddings: bool) -> MaskedLM:
    return MaskedLM(backbone, vocab_size, scale_embeddings=scale_embeddings)


def replaced_token_detector(backbone: TransformerConfig, *, vocab_size: int,
                            scale_embeddings: bool) -> ReplacedTokenDetector:
    return ReplacedTokenDetector(backbone, vocab_size, scale_embeddings=scale_embeddings)


def electra_generator(backbone: TransformerConfig, *, vocab_size: int, scale_embeddings: bool,
                      generator_size: float) -> MaskedLM:
    """task=electra's generator (its ``generator``), a masked LM ``generator_size`` as wide as ``backbone``."""
    return MaskedLM(generator_config(backbone, generator_size), vocab_size, scale_embeddings=scale_embeddings)


def encoder_decoder(backbone: TransformerConfig, *, vocab_size: int, pad_id: int, tie_embeddings: str | bool,
                    scale_embeddings: bool, logits_bias: bool = False, decoder_start_id: int | None = None,
                    rescale_head: bool = False, embedding_rows: int | None = None) -> EncoderDecoder:
    return EncoderDecoder(backbone, table_rows(vocab_size, embedding_rows), pad_id=pad_id, tie_embeddings=tie_embeddings,
                          scale_embeddings=scale_embeddings, logits_bias=logits_bias, decoder_start_id=decoder_start_id,
                          rescale_head=rescale_head)


def vision_transformer(backbone: TransformerConfig, *, patch_size: int, in_channels: int, num_classes: int,
                       pool: str) -> VisionTransformer:
    return VisionTransformer(backbone, patch_size=patch_size, in_channels=in_channels, num_classes=num_classes,
                             pool=pool)


def sequence_classifier(backbone: TransformerConfig, *, vocab_size: int, class_names: list[str], stack: str,
                        pool: str, scale_embeddings: bool, class_token_in_text: bool, pooler: bool | str) -> SequenceClassifier:
    return SequenceClassifier(backbone, vocab_size, len(class_names), stack=stack, pool=pool,
                              scale_embeddings=scale_embeddings, class_token_in_text=class_token_in_text, pooler=pooler)


#: What task=clip's ``task.text`` / ``task.image`` may set over the ``model`` and ``pos_encoding`` groups for one tower:
#: every model setting but the geometry, which follows from the data (the context length, the image's patch grid), and
#: DeiT's distillation token (task=vit's alone).
TOWER_SETTINGS = tuple(f.name for f in dataclasses.fields(TransformerConfig)
                       if f.name not in ("max_seq_len", "grid", "num_prefix_tokens", "distillation_token"))


def tower_config(backbone: Mapping[str, Any], overrides: Mapping[str, Any] | None, tower: str,
                 geometry: Mapping[str, Any]) -> TransformerConfig:
    """The stack of one of CLIP's towers (``tower``: text or image): ``backbone`` (the model and pos_encoding groups)
    with the tower's ``overrides`` (``task.<tower>.*``) and ``geometry``; a key that is no model setting is one line."""
    check_tower_keys(overrides, tower)
    return TransformerConfig(**{**unresolved(backbone), **(overrides or {}), **geometry})


def check_tower_keys(overrides: Mapping[str, Any] | None, tower: str) -> None:
    """Each key of ``task.<tower>`` is a model setting of a tower, else one line naming those there are."""
    for key in overrides or {}:
        if key not in TOWER_SETTINGS:
            raise ConfigError(f"task.{tower}.{key} is not a model setting of the {tower} tower"
                              f"{did_you_mean(key, TOWER_SETTINGS, f'task.{tower}.')}: remove it; "
                              f"task.{tower} takes {', '.join(TOWER_SETTINGS)}")


def unresolved(backbone: Mapping[str, Any]) -> dict[str, Any]:
    """``backbone`` (a resolved TransformerConfig's fields) with each setting that only stood for its default (the
    query heads' count of ``n_kv_heads``, ``d_model / n_heads`` of ``head_dim``, ``bias`` of the bias keys) back to
    None: a tower that changes ``n_heads``, ``d_model`` or ``bias`` then resolves them from its own values."""
    settings = dict(backbone)
    defaults = {"n_kv_heads": settings.get("n_heads"), "qkv_bias": settings.get("bias"),
                "attn_out_bias": settings.get("bias"), "mlp_bias": settings.get("bias")}
    if settings.get("d_model") is not None and settings.get("n_heads"):
        defaults["head_dim"] = settings["d_model"] // settings["n_heads"]
    return {key: None if key in defaults and value == defaults[key] else value for key, value in settings.items()}


def clip(backbone: TransformerConfig, *, vocab_size: int, eos_id: int | None, embed_dim: int,
         text: dict[str, Any] | None, image: dict[str, Any] | None, image_size: int, patch_size: int,
         in_channels: int) -> CLIP:
    """CLIP's towers: the text's context is the backbone's (``data.max_seq_len``), the image's grid its patches'."""
    shared = vars(backbone)
    return CLIP(tower_config(shared, text, "text", {}),
                tower_config(shared, image, "image", vit_geometry(image_size, patch_size, "cls")),
                vocab_size=vocab_size, embed_dim=embed_dim, eos_id=eos_id, patch_size=patch_size,
                in_channels=in_channels)


#: Each task's builder, by the task class its checkpoints name (trident.tasks.task_in_checkpoint.TASK_KEY): what
#: a checkpoint says of itself before anything is imported (tests/test_command_startup.py holds each task to it).
BUILDERS: dict[str, NetworkBuilder] = {
    "trident.tasks.lm.LanguageModelTask": causal_lm,
    "trident.tasks.mlm.MaskedLanguageModelTask": masked_lm,
    "trident.tasks.translation.TranslationTask": encoder_decoder,
    "trident.tasks.vit.ImageClassificationTask": vision_transformer,
    "trident.tasks.classify.SequenceClassificationTask": sequence_classifier,
    "trident.tasks.clip.ContrastiveImageTextTask": clip,
    "trident.tasks.electra.ElectraTask": replaced_token_detector,
}


#: The other networks a task trains beside ``net`` (its NETWORKS) that the exports of a network write beside it, by
#: name and builder, by the task class its checkpoints name: task=electra's generator.
OTHER_BUILDERS: dict[str, dict[str, NetworkBuilder]] = {
    "trident.tasks.electra.ElectraTask": {"generator": electra_generator},
}


def build_others_from_settings(task: str | None, settings: Mapping[str, Any]) -> dict[str, nn.Module]:
    """The other networks (:data:`OTHER_BUILDERS`) of the task class ``task`` with the hyperparameters ``settings``."""
    built = {name: _build(build, settings) for name, build in OTHER_BUILDERS.get(task or "", {}).items()}
    return {name: network for name, network in built.items() if network is not None}


def _build(build: NetworkBuilder, settings: Mapping[str, Any]) -> nn.Module | None:
    parameters = list(inspect.signature(build).parameters.values())[1:]
    # A setting younger than the checkpoint (embedding_rows) has its builder default, the constructor's.
    if any(p.name not in settings and p.default is inspect.Parameter.empty for p in parameters):
        return None
    return build(TransformerConfig(**settings["backbone"]), **{p.name: settings[p.name] for p in parameters if p.name in settings})


def build_from_settings(task: str | None, settings: Mapping[str, Any]) -> nn.Module | None:
    """The network of the task class ``task`` (as a checkpoint names it) with the hyperparameters ``settings``;
    None when that task has no builder or ``settings`` lack one of its settings (a checkpoint of an earlier version:
    its task's constructor supplies the default)."""
    build = BUILDERS.get(task or "")
    if build is None or not isinstance(settings.get("backbone"), Mapping):
        return None
    return _build(build, settings)
