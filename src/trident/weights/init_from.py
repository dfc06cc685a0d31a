"""``init_from=<source>``: a run that starts from another model's weights (a trident checkpoint or
run directory of any task, or a Hugging Face / timm file read by :mod:`trident.weights.adapters`).

Only the weights (and the tokenizer) come from the source, never its optimizer, schedule, step or
data position: the run is new. The architecture comes from the source too: the source's values
replace the ``model`` and ``pos_encoding`` settings, and a value the user set on the command line
that says otherwise is one error line (a timm file does not record its head count, which
``model.n_heads=`` may state). Which of its task and data settings a source fixes, each task and
data module says (``settings_from_source``; ``stage_source`` writes what only the source holds, its
tokenizer and chat template): this module names no task and no task or data setting.
"""

from __future__ import annotations

import dataclasses
import json
import pydoc
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from trident.backbone import TransformerConfig
from trident.data.base import TridentDataModule
from trident.data.chat_template import ChatTemplate
from trident.errors import ConfigError
from trident.tasks.base import STACK_KINDS, TridentTask
from trident.weights.pretrained import PretrainedWeights
from trident.weights.sources import (
    COPY_DIR,
    read_init_source,
    read_source_copy,
)

# Model settings younger than some sources (issue 40): a source that does not state one (an earlier trident run,
# GPT-2, BERT, ViT) has its default, which init_from then fixes like any setting the source states.
ATTENTION_SHAPE_SETTINGS = ("n_kv_heads", "head_dim", "qk_norm", "qkv_bias", "attn_out_bias", "mlp_bias")
# The same for DeiT's distillation token (issue 54): a source that does not state it (a Hugging Face ViT) has none.
YOUNGER_SETTINGS = (*ATTENTION_SHAPE_SETTINGS, "distillation_token")
_ABSENT = object()
# Config groups whose choice by name is a choice of architecture.
ARCHITECTURE_GROUPS = ("model", "pos_encoding")


def check_source_task(task: type[TridentTask], source: PretrainedWeights) -> None:
    """One line when ``task`` cannot start from ``source``'s network: an encoder-decoder starts only from an
    encoder-decoder and gives its weights to no other task (matching parameter names would load a fraction
    of the model and call it a fine-tuning), and a network reads what the source's reads."""
    from trident.tasks.registry import TASKS  # here: every task's imports load only for a run that has a source

    trained_for = TASKS[source.task]
    if task.ENCODER_DECODER and not trained_for.ENCODER_DECODER:
        raise ConfigError(f"init_from={source.source} holds a task={source.task} model; task={task.NAME} starts only from "
                          f"a trident {task.NAME} checkpoint or run directory (an lm or mlm network has no encoder-decoder "
                          "cross-attention): pass one of those, or train from scratch")
    if trained_for.ENCODER_DECODER and not task.ENCODER_DECODER:
        raise ConfigError(f"init_from={source.source} holds a task={source.task} model, which task={task.NAME} cannot "
                          "start from (at most its encoder blocks match this network, without their token embedding): "
                          f"run it with task={source.task}")
    if task.READS != trained_for.READS:
        raise ConfigError(f"init_from={source.source} holds a task={source.task} model, which reads {trained_for.READS}; "
                          f"task={task.NAME} reads {task.READS}, so only its blocks would fit, without their embedding: "
                          f"run it with task={source.task}, or pass the weights of {sources_reading(task.READS)}, or train "
                          "from scratch")


def sources_reading(reads: str) -> str:
    """The sources a task that reads ``reads`` (text, images, or both) can start from: trident runs, the Hugging Face
    families of the adapter registry whose network's task reads it (by config.json's model_type) and the file formats."""
    from trident.tasks.registry import TASKS  # here: the registry loads every adapter
    from trident.weights.adapters.outside_network import holder
    from trident.weights.adapters.registry import ADAPTERS, FILE_ADAPTERS

    families = [adapter.MODEL_TYPE for adapter in ADAPTERS if holder(adapter.NETWORK).READS == reads]
    files = [adapter.DESCRIPTION for adapter in FILE_ADAPTERS if holder(adapter.NETWORK).READS == reads]
    # The runs of the tasks that read the same and give their weights to another task (not an encoder-decoder's).
    runs = [name for name, task in TASKS.items() if task.READS == reads and not task.ENCODER_DECODER]
    named = " or ".join(filter(None, (", ".join(runs[:-1]), runs[-1])))
    kind = "an image" if reads == "images" else "an image-text" if "images" in reads else "a text"
    return (f"{kind} model (a trident {named} run, a Hugging Face directory of "
            f"model_type {', '.join(families)}{''.join(f', {described}' for described in files)})")


def check_source_stack(task: type[TridentTask], options: DictConfig, source: PretrainedWeights, embeddings_only: bool) -> None:
    """One line when ``source``'s stack is not the one ``task`` runs with its ``options`` (a decoder into an
    encoder or the reverse): that source shares only its token embedding (and an LM's output layer) with the
    network, its blocks would be dropped and the stack trained from scratch, which only ``init_only=embeddings``
    (``embeddings_only``) asks for. After :func:`apply_settings`, which gives a classify run a classify source's
    ``task.stack``."""
    stack = task.stack(options)
    source_stacks = {name.split(".")[0] for name in source.state_dict} & set(STACK_KINDS)
    if embeddings_only or stack is None or len(source_stacks) != 1 or stack in source_stacks:
        return
    source_stack = source_stacks.pop()
    tensors = sum(name.startswith(f"{source_stack}.") for name in source.state_dict)
    here, fix = task.other_stack(options, source_stack)
    raise ConfigError(
        f"init_from={source.source} holds a task={source.task} model, {STACK_KINDS[source_stack]}: its {tensors} "
        f"{source_stack} tensors have no place in {here}, {STACK_KINDS[stack]} that would train from scratch with only "
        f"the embedding loaded: {fix}, or add init_only=embeddings to load the embedding alone"
    )


def explicit_overrides() -> list[str]:
    """The keys the user set on the command line (``model``, ``model.d_model``, ``pos_encoding``...),
    as Hydra recorded them; group defaults and experiment presets are not among them."""
    from hydra.core.hydra_config import HydraConfig  # here: trident-chat reads a run's record without Hydra

    if not HydraConfig.initialized():
        return []
    return [o.partition("=")[0].lstrip("+~") for o in HydraConfig.get().overrides.task]


def settings_fixed_by(cfg: DictConfig, source: PretrainedWeights, explicit: list[str]) -> dict[str, Any]:
    """What ``source`` fixes in the config, key -> value (``model.d_model`` -> 768): its architecture, and what the
    configured task and its data take of it (``TridentTask.settings_from_source``: the source's task and data settings,
    its tokenizer, its chat template); a value the user set that contradicts it is one error line naming both."""
    import hydra.utils  # here: the commands that read a run (trident-chat) import this module without Hydra

    defaults = {k: TransformerConfig.__dataclass_fields__[k].default for k in YOUNGER_SETTINGS}
    wanted: dict[str, Any] = {f"model.{k}": v for k, v in (defaults | source.model).items()}
    if not hydra.utils.get_class(cfg.task._target_).RECURRENT:  # a memory adds no weights: another task reads without one
        wanted.pop("model.memory_length", None)
    wanted["pos_encoding.name"] = source.pos_encoding
    wanted["pos_encoding.options"] = source.pos_encoding_options
    taken = hydra.utils.get_class(cfg.task._target_).settings_from_source(source, cfg, explicit)
    # A trident run saves these resolved (n_kv_heads=4), a config leaves them null: equal when null stands for the value.
    shape = TransformerConfig(**{k: v for k, v in source.model.items() if k in ("d_model", "n_heads", "head_dim", "bias")})
    followed = {f"model.{k}": getattr(shape, k) for k in ATTENTION_SHAPE_SETTINGS}
    # The task's and data's settings that the source states are checked against the user's like its architecture; the
    # files they name for what the source alone holds (its tokenizer, its chat template: staged, named by content) are not.
    stated = source.task_options.keys() | source.data_options.keys()
    for key, value in (wanted | {k: v for k, v in taken.items() if k.partition(".")[2] in stated}).items():
        group = key.partition(".")[0]
        current = OmegaConf.to_container(OmegaConf.create({"v": OmegaConf.select(cfg, key)}), resolve=True)["v"]  # type: ignore[index]
        # A model size or position encoding chosen by name (model=small) sets the keys its file has;
        # a task or data option chosen by name (data=imagefolder) chooses the task or data, not the weights' shape.
        in_group = OmegaConf.select(cfg, key, default=_ABSENT) is not _ABSENT
        set_by_user = key in explicit or (group in ARCHITECTURE_GROUPS and group in explicit and in_group)
        stated = followed.get(key) if value is None else value  # a null the source has: the value it stands for
        if set_by_user and not _same(followed.get(key) if current is None else current, stated):
            shown = key.removesuffix(".name")
            raise ConfigError(
                f"{shown}={current} contradicts init_from={source.source}, which has {shown}={stated}: drop that "
                "override (the architecture comes from the weights)"
            )
    return wanted | taken


def apply_settings(cfg: DictConfig, fixed: dict[str, Any]) -> None:
    """The one place the weights room writes ``cfg`` before the config is checked: the settings of
    :func:`settings_fixed_by`."""
    with open_dict(cfg):
        for key, value in fixed.items():
            OmegaConf.update(cfg, key, value, merge=False)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return float(a) == float(b)
    return bool(a == b)


def stage_run_source(run_dir: Path, data: DictConfig) -> None:
    """What the ``data`` settings of a run from an ``init_from`` source name and only the source holds (its tokenizer,
    its chat template), staged again by the run's data module (``stage_source``) from the run's record
    (``<run>/init/``) where the data cache lost it: eval.py of such a run needs neither the source nor the cache."""
    if (recorded := _run_record(run_dir, data)) is not None:
        data_class, source = recorded
        data_class.stage_source(source, data)


def run_source_template(run_dir: Path, data: DictConfig) -> ChatTemplate | None:
    """The chat template of a run's ``init_from`` source, read from the run's record (``<run>/init/``), when its
    ``data`` settings render with it (the data module's ``source_template``); None otherwise. trident-chat reads it
    here: it writes nothing into the data cache."""
    recorded = _run_record(run_dir, data)
    return None if recorded is None else recorded[0].source_template(recorded[1], data)


def _run_record(run_dir: Path, data: DictConfig) -> tuple[type[TridentDataModule], PretrainedWeights] | None:
    """The data module class of a run's ``data`` settings and the run's record of its source (without its weights);
    None for a run from no source."""
    folder = run_dir / COPY_DIR
    target = data.get("_target_")
    if not (folder / "source.json").is_file() or not target:
        return None
    data_class = pydoc.locate(str(target))  # pydoc's lookup, not Hydra's: trident-chat imports Hydra nowhere else
    if not (isinstance(data_class, type) and issubclass(data_class, TridentDataModule)):
        return None
    return data_class, read_source_copy(folder, weights=False)


def copy_source(source: PretrainedWeights, run_dir: Path) -> None:
    """``<run>/init/``: the source's weights, tokenizer and settings, so that the run (eval.py, resume,
    trident.load) never needs the source again. The config is left as :func:`apply_settings` wrote it:
    ``data.tokenizer`` names the staged file, which a resume stages again from this copy."""
    folder = run_dir / COPY_DIR
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(source.state_dict, folder / "weights.pt")
    described = {f.name: getattr(source, f.name) for f in dataclasses.fields(source)
                 if f.name not in ("state_dict", "tokenizer")}
    (folder / "source.json").write_text(json.dumps(described, indent=1, default=str))
    if source.tokenizer is not None:
        source.tokenizer.save(str(folder / "tokenizer.json"))


def source_for_run(task: type[TridentTask], cfg: DictConfig, run_dir: Path, resume_from: str | None,
                   embeddings_only: bool) -> PretrainedWeights | None:
    """The ``init_from`` source of a run of ``task``, with what it fixes (its architecture, its tokenizer) written into
    ``cfg`` in one step (:func:`apply_settings`) before the config is checked; a resumed run reads
    the copy in its own directory (the original may have moved). ``embeddings_only``
    (``init_only=embeddings``) lets a source of another stack in."""
    import hydra.utils  # here: the commands that read a run (trident-chat) import this module without Hydra

    if not cfg.get("init_from"):
        return None
    if cfg.get("ckpt_path"):
        raise ConfigError(f"init_from={cfg.init_from} starts a new run from weights, ckpt_path={cfg.ckpt_path} resumes one "
                          "(optimizer, step, data position): drop one of them")
    copy = run_dir / COPY_DIR
    explicit = explicit_overrides()
    n_heads = int(cfg.model.n_heads) if "model.n_heads" in explicit else None
    resumed = bool(resume_from) and (copy / "source.json").is_file()
    source = read_source_copy(copy) if resumed else read_init_source(str(cfg.init_from), n_heads)
    check_source_task(task, source)
    apply_settings(cfg, settings_fixed_by(cfg, source, explicit))
    check_source_stack(task, cfg.task, source, embeddings_only)
    hydra.utils.get_class(cfg.data._target_).stage_source(source, cfg.data)
    return source
