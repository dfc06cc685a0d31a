"""A training run's side of the network lifecycle (trident.tasks.networks: build, load weights, apply the
converters, shard, compile): the run builds its task inside ``converting_later()``, then :func:`prepare_networks`
loads the source's weights into the networks as built, reads or fills the companions (:func:`name_initial_copies`:
a copy of the initial weights lives at ``<run>/init/<key>.safetensors``), converts them, checks a resumed
checkpoint against them, puts on a converter's artifact to start from and compiles; Lightning shards them at
``fit`` (``configure_model``), then loads a resumed checkpoint. :func:`write_artifacts` writes what each converter hands on after the run.

The artifact files of each converter are this room's to choose (they are read and written by trident.weights).
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, open_dict

from trident.converters import ArtifactFiles, Converter, LoRA
from trident.errors import ConfigError
from trident.runs.resume import check_resume_continues
from trident.tasks.base import TridentTask
from trident.tasks.networks import compile_network, convert_networks, load_companions
from trident.weights.checkpoints import check_checkpoint_fits
from trident.weights.frozen_base import keep_base_out
from trident.weights.lora_adapter import AdapterFiles
from trident.weights.pretrained import PretrainedWeights
from trident.weights.sources import COPY_DIR
from trident.weights.transfer import TransferRow, transfer_weights

#: Where each converter's artifact is written and read (by its name); a converter absent hands on none (finetune=qlora's
#: NF4 base is its source quantized again).
ARTIFACT_FILES: dict[str, ArtifactFiles] = {LoRA.NAME: AdapterFiles()}


def name_initial_copies(task: type[TridentTask], cfg: DictConfig, run_dir: Path, resumed: bool) -> None:
    """Each companion of ``task`` that copies a trained network's initial weights (:meth:`TridentTask.initial_copies`)
    is read from ``<run>/init/<key>.safetensors``, unless the config names its source: written by the new run
    (trident.tasks.networks.save_initial_companions), read by a resume and by every load of the run's checkpoints.
    Recorded relative to the run (``init/<key>.safetensors``, found beside the run or the checkpoint read:
    trident.tasks.networks.companions_beside), so that a run moved or copied elsewhere reads its own copy.
    A new run that names another file is refused: the copy would overwrite it, and no other network can be read."""
    for key in task.initial_copies(cfg):
        mine, given = run_dir / COPY_DIR / f"{key}.safetensors", cfg.task.get(key)
        if given is not None and not resumed and (run_dir / str(given)).resolve() != mine.resolve():
            raise ConfigError(f"task.{key}={given} is where a run keeps its copy of its initial weights ({mine} here), "
                              f"which a new run writes (over that file) and no other network can replace: drop "
                              f"task.{key}; for another initial network give init_from=<it>")
        if given is None:
            with open_dict(cfg):
                cfg.task[key] = f"{COPY_DIR}/{key}.safetensors"


def prepare_networks(task: TridentTask, cfg: DictConfig, source: PretrainedWeights | None,
                     saved: tuple[Path, dict] | None, resumed: bool, new_head: bool,
                     embeddings_only: bool) -> list[TransferRow] | None:
    """Load, convert, compile the networks of ``task`` (built inside ``converting_later()``); returns the rows of
    the weights the ``source`` gave (None: a resumed run, whose ``saved`` checkpoint holds its own weights)."""
    # Load: a new run starts from its source's weights, into the networks as built (before any converter).
    transferred = (transfer_weights(task.net, source.state_dict, source.source, new_head, source.notes, embeddings_only)
                   if source is not None and not resumed else None)
    # The companions: read from their sources; a new run's copies of the initial weights taken from its networks now.
    load_companions(task, started=not resumed)
    # Convert: the converters the task's hyperparameters record (the checkpoints re-apply them from there).
    convert_networks(task)
    if saved is not None:  # the resumed checkpoint continues this training, on these (converted) networks
        vocabulary = task.tokenizer.get_vocab() if task.tokenizer is not None else None
        check_resume_continues(saved[1], saved[0], cfg.data, vocabulary)
        check_checkpoint_fits(saved[1], task, saved[0])
    for converter in task.converters:
        start = _start_from(converter, cfg)
        if start is not None and not resumed:
            converter.start_from(task.net, start, str(cfg.init_from), ARTIFACT_FILES[converter.NAME])
    if source is not None and any(converter.FREEZES_SOURCE for converter in task.converters):
        # The frozen source leaves the run's checkpoints (trident.weights.frozen_base).
        keep_base_out(task, source.state_dict, str(cfg.init_from), saved[1] if saved else None, resumed)
    # Shard: at fit, on Lightning's device mesh (TridentTask.configure_model). Compile: traced at the first call.
    compile_network(task, cfg.get("compile", False))
    return transferred


def _start_from(converter: Converter, cfg: DictConfig) -> str | None:
    """The artifact of an earlier run the config names for ``converter`` to start from (e.g. ``finetune.adapter``)."""
    if converter.START_FROM is None:
        return None
    value = (cfg.get("finetune") or {}).get(converter.START_FROM)
    return str(value) if value else None


def write_artifacts(task: TridentTask, run_dir: Path, init_from: str, best: str | None) -> None:
    """What each converter of ``task`` hands on beside the checkpoints (e.g. ``<run>/adapter``): of the ``best``
    checkpoint's weights when there is one."""
    for converter in task.converters:
        if converter.NAME in ARTIFACT_FILES:
            converter.write_artifact(task.net, run_dir, init_from, best, ARTIFACT_FILES[converter.NAME])
