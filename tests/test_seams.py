"""The network lifecycle's seams (issue 51 item 1): tasks put no adapter on, the pipeline has no LoRA branch,
every task records every converter, and docs/architecture.md's "Add a converter" followed literally: a toy
quantizer (weights rounded to a grid) written as the guide says is checked on the config, applied after the
source's weights are loaded, re-applied by a checkpoint from its hyperparameters and merged away."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

import trident.converters
from trident.backbone import TransformerConfig
from trident.converters import CONVERTERS, Converter, converter_settings, unsplittable
from trident.errors import ConfigError
from trident.parallel.tensor_parallel import check_tensor_parallel_config
from trident.runs.lifecycle import prepare_networks
from trident.tasks.lm import LanguageModelTask
from trident.tasks.networks import converting_later, merge_converters
from trident.tasks.registry import TASKS

from .test_task_contract import BACKBONE, OPTIMIZER, SCHEDULER

SRC = Path(__file__).resolve().parents[1] / "src" / "trident"


def test_no_task_puts_adapters_on() -> None:
    for path in sorted((SRC / "tasks").glob("*.py")):
        tree = ast.parse(path.read_text())
        names = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
        names |= {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
        names |= {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
        assert not {"add_adapters", "add_lora", "freeze_base"} & names, f"{path.name} puts adapters on itself"


def test_the_pipeline_has_no_lora_branch() -> None:
    text = (SRC / "runs" / "pipeline.py").read_text().lower()
    assert "lora" not in text and "adapter" not in text, "the pipeline calls the lifecycle, which iterates converters"


def test_objectives_name_no_converter() -> None:
    """An objective asks the task for its networks as loaded (``switched_off``: each converter switches itself off),
    never a converter by name: no identifier or import of ``src/trident/objectives`` names LoRA or its adapters."""
    for path in sorted((SRC / "objectives").glob("*.py")):
        tree = ast.parse(path.read_text())
        names = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
        names |= {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
        names |= {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.ClassDef)}
        names |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom | ast.Import)
                  for alias in node.names}
        names |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        named = sorted(n for n in names if "lora" in n.lower() or "adapter" in n.lower() or "converter" in n.lower())
        assert not named, f"{path.name} names {named}"


def test_every_task_records_every_converter_in_its_hyperparameters() -> None:
    """A checkpoint re-applies its converters from its hyperparameters: each is a keyword of every task."""
    for task_class in TASKS.values():
        assert set(CONVERTERS) <= set(inspect.signature(task_class.__init__).parameters), task_class.NAME


# "Add a converter" (docs/architecture.md), step by step.
class RoundWeights(Converter):
    """Step 1: a Converter subclass. A toy quantized base: every matrix of the blocks rounded to a grid of ``step``,
    frozen; the rest trains."""

    NAME: ClassVar[str] = "round"

    @classmethod
    def check(cls, cfg: Any, settings: dict[str, Any], backbone: TransformerConfig) -> dict[str, Any]:
        step = settings.get("step")
        if not isinstance(step, float) or step <= 0:
            raise ConfigError(f"finetune.step must be a positive number, got {step!r}: set e.g. finetune.step=0.5")
        return {"step": step}

    def apply(self, net: nn.Module) -> None:
        with torch.no_grad():
            for name, param in net.named_parameters():
                if self._rounded(name):
                    param.copy_(torch.round(param / self.settings["step"]) * self.settings["step"])

    def trains(self, name: str) -> bool:
        return not self._rounded(name)

    def merge(self, net: nn.Module) -> None:
        """The rounded weights are plain weights already."""

    @staticmethod
    def _rounded(name: str) -> bool:
        return ".blocks." in name and name.endswith(".weight") and "norm" not in name


class RoundedLM(LanguageModelTask):
    """Step 3: the converter's settings keyword on the task's constructor (the hyperparameter it is recorded in)."""

    def __init__(self, backbone: dict[str, Any], vocab_size: int, optimizer: dict[str, Any],
                 scheduler: dict[str, Any], round: dict[str, Any] | None = None) -> None:
        super().__init__(backbone, vocab_size, optimizer, scheduler)


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> None:
    """Step 2: the entry in CONVERTERS (and so a finetune= option)."""
    monkeypatch.setitem(CONVERTERS, RoundWeights.NAME, RoundWeights)
    monkeypatch.setitem(trident.converters.FINETUNE_MODES, RoundWeights.NAME, (RoundWeights,))


def _cfg(finetune: dict[str, Any]) -> Any:
    return OmegaConf.create({"finetune": finetune, "init_from": "source", "compile": False, "data": {}})


def test_a_new_converter_is_checked_on_the_config(registered: None) -> None:
    backbone = TransformerConfig(**BACKBONE)
    assert converter_settings(_cfg({"name": "round", "step": 0.5}), backbone) == {"lora": None, "nf4": None,
                                                                                    "round": {"step": 0.5}}
    with pytest.raises(ConfigError, match="finetune.step must be a positive number"):
        converter_settings(_cfg({"name": "round", "step": -1.0}), backbone)


def test_a_new_converter_applies_after_the_source_is_loaded_and_a_checkpoint_reapplies_it(
        registered: None, tmp_path: Path) -> None:
    torch.manual_seed(0)
    source = {k: v.clone() for k, v in LanguageModelTask(BACKBONE, 11, OPTIMIZER, SCHEDULER).net.state_dict().items()}
    with converting_later():  # as the pipeline builds a run's task
        task = RoundedLM(BACKBONE, 11, OPTIMIZER, SCHEDULER, round={"step": 0.5})
    weights = SimpleNamespace(state_dict=source, source="source", notes={})
    prepare_networks(task, _cfg({"name": "round", "step": 0.5}), weights, None, False, False, False)  # type: ignore[arg-type]
    name = "decoder.blocks.0.ffn.fc_in.weight"
    param = dict(task.net.named_parameters())[name]
    # The source's weights rounded: loaded first, then converted (the other order would leave them unrounded).
    torch.testing.assert_close(param.detach(), torch.round(source[name] / 0.5) * 0.5, rtol=0, atol=0)
    assert not torch.equal(param.detach(), source[name])
    assert not param.requires_grad and dict(task.net.named_parameters())["decoder.final_norm.weight"].requires_grad
    # A checkpoint re-applies it from its hyperparameters, then its own weights load.
    assert task.hparams["round"] == {"step": 0.5}
    takes = inspect.signature(RoundedLM.__init__).parameters  # what load_from_checkpoint passes of the hparams
    rebuilt = RoundedLM(**{key: value for key, value in task.hparams.items() if key in takes})
    assert [type(c) for c in rebuilt.converters] == [RoundWeights]
    assert not dict(rebuilt.net.named_parameters())[name].requires_grad
    rebuilt.load_state_dict(task.state_dict())
    merge_converters(rebuilt)  # an export folds it away (here: nothing to fold)
    torch.testing.assert_close(rebuilt.net.state_dict()[name], param.detach())


def test_a_converter_says_whether_tensor_parallelism_can_split_it(registered: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """No converter is refused by its name: its TENSOR_PARALLEL says whether the plan splits what it converted."""
    trainer = {"devices": 2, "num_nodes": 1, "strategy": {"tensor_parallel_size": 2}}
    backbone = TransformerConfig(**BACKBONE)
    assert unsplittable(_cfg({"name": "full"})) is None and unsplittable(_cfg({"name": "lora"})) == "lora"
    with pytest.raises(ConfigError, match="tensor_parallel_size=2 cannot split finetune=round's"):
        check_tensor_parallel_config(trainer, backbone, unsplittable(_cfg({"name": "round", "step": 0.5})))
    monkeypatch.setattr(RoundWeights, "TENSOR_PARALLEL", True)
    assert unsplittable(_cfg({"name": "round", "step": 0.5})) is None
    check_tensor_parallel_config(trainer, backbone, unsplittable(_cfg({"name": "round", "step": 0.5})))


def test_a_task_class_keeps_its_constructors_signature() -> None:
    """The lifecycle's metaclass builds tasks through ``__call__(*args, **kwargs)``: the class still states its
    constructor's arguments (without ``self``), which the run checks ``task.*`` keys against."""
    for task_class in TASKS.values():
        constructor = list(inspect.signature(task_class.__init__).parameters)
        assert list(inspect.signature(task_class).parameters) == constructor[1:], task_class.NAME


def test_a_network_is_switched_off_only_when_every_converter_can_be() -> None:
    """DPO's reference is the network with its converters switched off: one converter that cannot be (RoundWeights)
    beside LoRA means a frozen copy instead."""
    from trident.tasks.networks import can_switch_off

    lora = CONVERTERS["lora"]
    assert lora.SWITCHES_OFF and not RoundWeights.SWITCHES_OFF
    assert can_switch_off([lora]) and not can_switch_off([]) and not can_switch_off([RoundWeights])
    assert not can_switch_off([lora, RoundWeights]) and not can_switch_off([RoundWeights, lora])
