"""A network read without its task (trident.weights.network.load_network, issue 51: commands that do not train start
without Lightning) is the task's ``net`` as ``trident.load`` gives it: the same module, weights, tokenizer and
settings, converters applied (and merged alike), and ``trident-export --format hf`` writes the same bytes as the
export of the task did."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

import trident
from trident.commands.export import main as export_main
from trident.data.tokenization import train_tokenizer
from trident.models import vit_geometry
from trident.tasks.base import TridentTask
from trident.tasks.classify import SequenceClassificationTask
from trident.tasks.lm import LanguageModelTask
from trident.tasks.mlm import MaskedLanguageModelTask
from trident.tasks.network_builders import BUILDERS
from trident.tasks.networks import merge_converters
from trident.tasks.registry import TASKS
from trident.tasks.translation import TranslationTask
from trident.tasks.vit import ImageClassificationTask
from trident.weights.network import load_network

# A GPT-2 / BERT-shaped backbone (learned positions, tanh GELU): what Hugging Face reads.
BACKBONE = {"d_model": 16, "n_heads": 2, "n_layers": 1, "d_ff": 32, "max_seq_len": 16, "pos_encoding": "learned",
            "activation": "gelu_tanh"}
TRAINING = {"optimizer": {"name": "adamw", "lr": 1.0e-3}, "scheduler": {"name": "constant"}}
LORA = {"rank": 2, "alpha": 4.0, "dropout": 0.0, "targets": ["q", "v"]}
TOKENIZER = train_tokenizer("char", ["First Citizen: speak, speak."], end_of_text=True)
TEXT = {"vocab_size": TOKENIZER.get_vocab_size(), "tokenizer_json": TOKENIZER.to_str()}

# Each task's network, untrained (its weights are what the checkpoint holds), and one under LoRA.
TASK_BUILDS: dict[str, Callable[[], TridentTask]] = {
    "lm": lambda: LanguageModelTask(BACKBONE, **TEXT, **TRAINING),
    "lm-lora": lambda: LanguageModelTask(BACKBONE, **TEXT, **TRAINING, lora=LORA),
    "mlm": lambda: MaskedLanguageModelTask({**BACKBONE, "activation": "gelu", "norm_first": False,
                                            "embedding_norm": True}, **TEXT, **TRAINING, mask_id=1, pad_id=2,
                                           num_regular_tokens=3),
    "classify": lambda: SequenceClassificationTask(BACKBONE, **TEXT, **TRAINING, class_names=["no", "yes"],
                                                   majority_accuracy={"validation": 0.5, "test": 0.5}, lora=LORA),
    "translation": lambda: TranslationTask(BACKBONE, **TEXT, **TRAINING),
    "vit": lambda: ImageClassificationTask({**BACKBONE, **vit_geometry(28, 7, "cls")}, **TRAINING, num_classes=3,
                                           image_size=28, in_channels=1, patch_size=7, class_names=["a", "b", "c"],
                                           mean=[0.5], std=[0.5]),
}


def saved(task: TridentTask, path: Path) -> Path:
    """``task`` as a checkpoint file, the way Lightning's trainer writes one (weights, hyperparameters, the task's own
    entries), without a run."""
    checkpoint: dict[str, Any] = {"state_dict": task.state_dict(), "hyper_parameters": dict(task.hparams),
                                  "pytorch-lightning_version": L.__version__}
    task.on_save_checkpoint(checkpoint)
    torch.save(checkpoint, path)
    return path


def assert_same_state(left: torch.nn.Module, right: torch.nn.Module) -> None:
    ours, theirs = left.state_dict(), right.state_dict()
    assert list(ours) == list(theirs)
    for name, tensor in ours.items():
        assert tensor.dtype == theirs[name].dtype and torch.equal(tensor, theirs[name]), name


def test_every_task_builds_its_network_with_its_registered_builder() -> None:
    for task in TASKS.values():
        assert f"{task.__module__}.{task.__qualname__}" in BUILDERS, task.NAME


@pytest.mark.parametrize("name", list(TASK_BUILDS))
def test_the_network_read_without_its_task_is_the_tasks(name: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    path = saved(TASK_BUILDS[name]().eval(), tmp_path / "task.ckpt")
    torch.manual_seed(1)  # each reader builds its network with other random weights before the checkpoint's
    network, task = load_network(path), trident.load(path)
    assert type(network.net) is type(task.net) and not network.net.training
    assert_same_state(network.net, task.net)
    assert network.settings == dict(task.hparams) and network.tokenizer_settings == task.tokenizer_settings
    assert (network.tokenizer.to_str() if network.tokenizer else None) == (task.tokenizer.to_str() if task.tokenizer else None)
    assert [type(c) for c in network.converters] == [type(c) for c in task.converters]
    network.merge_converters()
    merge_converters(task)
    assert_same_state(network.net, task.net)


@pytest.mark.parametrize("name", ["lm", "lm-lora", "mlm", "vit"])
def test_the_hf_export_writes_what_the_export_of_the_task_wrote(name: str, tmp_path: Path) -> None:
    from trident.weights.adapters.hf_export import write_hf

    pytest.importorskip("transformers")
    path = saved(TASK_BUILDS[name]().eval(), tmp_path / "task.ckpt")
    export_main([str(path), "--format", "hf", "--out", str(tmp_path / "lean")])
    task = trident.load(path)  # what the export did before: the task, its converters merged, its net written
    merge_converters(task)
    with torch.no_grad():
        write_hf(task.net, task.tokenizer, task.hparams.get("class_names"), tmp_path / "task", task.tokenizer_settings)
    written = sorted(p.name for p in (tmp_path / "task").iterdir())
    assert sorted(p.name for p in (tmp_path / "lean").iterdir()) == written and "model.safetensors" in written
    for file in written:
        assert (tmp_path / "lean" / file).read_bytes() == (tmp_path / "task" / file).read_bytes(), file
