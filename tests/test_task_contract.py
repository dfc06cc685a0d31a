"""The task contract (trident.tasks.base.TridentTask): every task of conf/task derives from it, a
task lacking a hook fails where it is defined or built, the pipeline and the other callers use its
methods instead of getattr/hasattr probes, and the one configure_optimizers gives the parameter
groups written out here by hand (lm: decayed matrices and the rest; classify: per-depth groups)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import hydra.utils
import pytest
import torch
from omegaconf import OmegaConf
from torch import Tensor

import trident
from trident.data.lm import LMDataModule
from trident.errors import ConfigError, DataError
from trident.tasks.base import FILL_MASK, GENERATE, TRANSLATE, TridentTask
from trident.tasks.classify import SequenceClassificationTask
from trident.tasks.clip import ContrastiveImageTextTask
from trident.tasks.electra import ElectraTask
from trident.tasks.lm import LanguageModelTask
from trident.tasks.mlm import MaskedLanguageModelTask
from trident.tasks.registry import TASKS
from trident.tasks.task_in_checkpoint import TASK_KEY
from trident.tasks.translation import TranslationTask
from trident.tasks.vit import ImageClassificationTask

from .conftest import CONF_DIR, ROOT
from .entry_points import run_in_process

SRC = ROOT / "src" / "trident"
# Every module that works with a task the pipeline or a checkpoint gave it.
TASK_CALLERS = ["runs/pipeline.py", "weights/load.py", "weights/checkpoints.py", "weights/init_from.py",
                "weights/capable.py", "commands/evaluate.py", "commands/sample.py", "commands/chat.py",
                "commands/translate.py", "commands/fill_mask.py", "commands/export.py", "training/callbacks.py"]
# Commands that work with whatever task a run trained: they reach it through the contract, never a class name.
CONTRACT_COMMANDS = ["commands/chat.py", "commands/sample.py", "commands/evaluate.py", "commands/export.py",
                     "commands/fill_mask.py", "commands/translate.py"]
# One block, learned positions (a table to keep out of weight decay), biases and LayerNorm gains.
BACKBONE = {"d_model": 8, "n_heads": 2, "n_layers": 1, "d_ff": 16, "max_seq_len": 8, "pos_encoding": "learned"}
OPTIMIZER = {"name": "adamw", "lr": 1.0, "weight_decay": 0.1, "fused": False}
SCHEDULER = {"name": "constant"}


@pytest.mark.parametrize("option", sorted(p.stem for p in (CONF_DIR / "task").glob("*.yaml")))
def test_every_task_option_builds_a_trident_task(option: str) -> None:
    target = OmegaConf.select(OmegaConf.load(CONF_DIR / "task" / f"{option}.yaml"), "task._target_")  # @package _global_
    assert target, f"conf/task/{option}.yaml names no task._target_"
    task_class = hydra.utils.get_class(target)
    assert issubclass(task_class, TridentTask), target
    assert not inspect.isabstract(task_class), f"{target} leaves {sorted(task_class.__abstractmethods__)} abstract"
    assert task_class.configure_optimizers is TridentTask.configure_optimizers, "one configure_optimizers for all tasks"
    # The task's name is its yaml's, and the registry finds the class by it: one name, whoever asks.
    assert task_class.NAME == OmegaConf.load(CONF_DIR / "task" / f"{option}.yaml").task.name
    assert TASKS[task_class.NAME] is task_class


def test_the_registry_holds_every_task_option() -> None:
    assert sorted(TASKS) == sorted(p.stem for p in (CONF_DIR / "task").glob("*.yaml"))


def _probes(path: Path) -> list[str]:
    """``getattr(x, ...)`` / ``hasattr(x, ...)`` calls in ``path`` whose object ``x`` is a task or task class."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
            target = ast.unparse(node.args[0]) if node.args else ""
            if "task" in target.lower() or "module" in target.lower():
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_pipeline_calls_the_contract_instead_of_probing() -> None:
    pipeline = ast.parse((SRC / "runs" / "pipeline.py").read_text())
    calls = [ast.unparse(n) for n in ast.walk(pipeline)
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("getattr", "hasattr")]
    assert calls == []
    assert [probe for caller in TASK_CALLERS for probe in _probes(SRC / caller)] == []


def _task_modules(path: Path) -> set[str]:
    """The modules of trident.tasks that ``path`` imports (function-level imports too)."""
    return {node.module for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ImportFrom)
            and (node.module or "").startswith("trident.tasks")}


def test_the_commands_name_no_task_class() -> None:
    """chat, sample, eval, export, fill-mask and translate ask the task contract (trident.tasks.base: CAPABILITIES, NAME, ...) what a
    run's task can do; none imports a task's own module."""
    # The modules that define a task (trident.tasks' helpers, e.g. frozen_base, are no task's own).
    own = {task.__module__ for task in TASKS.values()}
    named = {command: _task_modules(SRC / command) & own for command in CONTRACT_COMMANDS}
    assert named == {command: set() for command in CONTRACT_COMMANDS}


def test_the_scan_finds_a_task_class_import(tmp_path: Path) -> None:
    naming = tmp_path / "naming.py"
    naming.write_text("from trident.tasks.base import TridentTask\ndef f():\n    from trident.tasks.lm import LanguageModelTask\n")
    assert _task_modules(naming) == {"trident.tasks.base", "trident.tasks.lm"}


def test_each_command_capability_is_declared_by_its_task() -> None:
    able = {capability: [name for name, task in TASKS.items() if capability in task.CAPABILITIES]
            for capability in (GENERATE, FILL_MASK, TRANSLATE)}
    assert able == {GENERATE: ["lm"], FILL_MASK: ["mlm"], TRANSLATE: ["translation"]}


MLM_TARGET, LM_TARGET = "trident.tasks.mlm.MaskedLanguageModelTask", "trident.tasks.lm.LanguageModelTask"


@pytest.mark.parametrize(("command", "name", "args", "written_by", "capability", "able"), [
    ("trident.commands.sample", "trident-sample", [], MLM_TARGET, GENERATE, "lm"),
    ("trident.commands.chat", "trident-chat", ["--message", "Hi"], MLM_TARGET, GENERATE, "lm"),
    ("trident.commands.fill_mask", "trident-fill-mask", ["To be or not to [MASK]"], LM_TARGET, FILL_MASK, "mlm"),
    ("trident.commands.translate", "trident-translate", ["Hello."], MLM_TARGET, TRANSLATE, "translation"),
])
def test_a_command_refuses_a_task_without_the_capability_it_needs_in_one_line(
        command: str, name: str, args: list[str], written_by: str, capability: str, able: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Checked on the class the checkpoint names, before its weights are read (this one holds none)."""
    checkpoint = tmp_path / "run.ckpt"
    torch.save({"state_dict": {}, TASK_KEY: written_by, "hyper_parameters": {}}, checkpoint)
    result = run_in_process(command, [str(checkpoint), *args], tmp_path, monkeypatch)
    assert result.returncode == 2, result.stderr[-2000:]
    task = written_by.split(".")[2]
    assert result.last_line == (f"error: checkpoint {str(checkpoint)!r} was written by task={task}, which cannot "
                                f"{capability}: {name} needs a run of task={able}")


def _class_switches(path: Path) -> list[str]:
    """``isinstance`` / ``issubclass`` calls and ``type(x) is / ==`` comparisons in ``path`` that test a class
    imported from trident.models or trident.tasks, other than the contract base ``TridentTask`` (asking whether
    a class a config or checkpoint names is a task at all is no switch between tasks)."""
    tree = ast.parse(path.read_text())
    network_or_task = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                       and (node.module or "").startswith(("trident.models", "trident.tasks"))
                       for alias in node.names} - {"TridentTask"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("isinstance", "issubclass"):
            tested = node.args[1:]
        elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Call) and ast.unparse(node.left.func) == "type":
            tested = node.comparators
        else:
            continue
        if {n.id for arg in tested for n in ast.walk(arg) if isinstance(n, ast.Name)} & network_or_task:
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_switch_on_network_or_task_classes_outside_their_rooms() -> None:
    """What differs between tasks is asked of the task (TridentTask: NAME, READS, ENCODER_DECODER, stack,
    example_input) or of its network's module, never switched on outside trident.tasks and trident.models."""
    outside = [path for path in sorted(SRC.rglob("*.py")) if path.relative_to(SRC).parts[0] not in ("tasks", "models")]
    assert [switch for path in outside for switch in _class_switches(path)] == []


def test_the_scan_finds_a_switch(tmp_path: Path) -> None:
    switching = tmp_path / "switching.py"
    switching.write_text("from trident.models import CausalLM as LM, MaskedLM\nfrom trident.tasks.base import TridentTask\n"
                         "from trident.tasks.vit import ImageClassificationTask\n"
                         "def f(net, task, cls):\n    if isinstance(net, LM | MaskedLM) or type(task) is ImageClassificationTask:\n"
                         "        return issubclass(cls, (TridentTask, ImageClassificationTask))\n"
                         "    return isinstance(task, TridentTask)\n")
    assert len(_class_switches(switching)) == 3


def test_the_scan_finds_a_probe(tmp_path: Path) -> None:
    probing = tmp_path / "probing.py"
    probing.write_text("def f(task, pl_module):\n    return getattr(task, 'tokenizer', None), hasattr(pl_module, 'net')\n")
    assert len(_probes(probing)) == 2


class _LanguageModelWithoutFlops(TridentTask):
    NAME = "lm_without_flops"
    DATA_MODULE = LMDataModule
    VALIDATION_METRICS = ("val/loss",)

    def throughput_units(self, batch: Tensor) -> dict[str, int]:
        return {"tokens": batch.numel()}


def test_a_task_without_a_hook_is_not_built() -> None:
    with pytest.raises(TypeError, match="abstract class _LanguageModelWithoutFlops with abstract methods example_input, "
                                        "flops_per_batch"):
        _LanguageModelWithoutFlops(BACKBONE, OPTIMIZER, SCHEDULER)


def test_a_task_without_a_data_module_fails_where_it_is_defined() -> None:
    with pytest.raises(TypeError, match="must set DATA_MODULE to the TridentDataModule subclass"):
        type("Orphan", (TridentTask,), {})


def test_a_task_without_a_name_fails_where_it_is_defined() -> None:
    with pytest.raises(TypeError, match="Nameless must set NAME to its task= option"):
        type("Nameless", (TridentTask,), {"DATA_MODULE": LMDataModule})


def test_a_task_without_its_validation_metrics_fails_where_it_is_defined() -> None:
    with pytest.raises(TypeError, match="Unmonitored must set VALIDATION_METRICS to the names of the metrics"):
        type("Unmonitored", (TridentTask,), {"DATA_MODULE": LMDataModule, "NAME": "unmonitored"})


def test_the_default_geometry_is_the_data_context() -> None:
    assert TridentTask.backbone_geometry({"max_seq_len": 77, "block_size": 64}, {}) == {"max_seq_len": 77}


def test_a_target_that_is_no_task_is_one_clear_error() -> None:
    from trident.runs.pipeline import configured_task_class

    cfg = OmegaConf.create({"task": {"_target_": "trident.data.lm.LMDataModule"}})
    with pytest.raises(ConfigError, match=r"task._target_=trident.data.lm.LMDataModule is not a trident task"):
        configured_task_class(cfg)


def test_a_checkpoint_naming_no_task_is_one_clear_error(tmp_path: Path) -> None:
    torch.save({"state_dict": {}, TASK_KEY: "collections.OrderedDict"}, tmp_path / "foreign.ckpt")
    with pytest.raises(DataError, match="names 'collections.OrderedDict', which is not a trident task"):
        trident.load(tmp_path / "foreign.ckpt")


def _groups(task: TridentTask) -> dict[str, tuple[set[str], float, float]]:
    """The optimizer's groups as {group name: (parameter names, lr, weight decay)}."""
    task._trainer = SimpleNamespace(estimated_stepping_batches=10)  # what configure_optimizers reads of a trainer
    names = {id(p): name for name, p in task.net.named_parameters()}
    optimizer = task.configure_optimizers()["optimizer"]
    return {group.get("name", str(k)): ({names[id(p)] for p in group["params"]}, group["lr"], group["weight_decay"])
            for k, group in enumerate(optimizer.param_groups)}


def _block(prefix: str, kind: str) -> set[str]:
    """A block's matrices (``kind="weights"``) or its biases and norm gains (``kind="rest"``)."""
    if kind == "weights":
        return {f"{prefix}.{n}.weight" for n in ("self_attn.qkv_proj", "self_attn.out_proj", "ffn.fc_in", "ffn.fc_out")}
    layers = ("self_attn.qkv_proj", "self_attn.out_proj", "ffn.fc_in", "ffn.fc_out", "self_attn_norm", "ffn_norm")
    return {f"{prefix}.{n}.bias" for n in layers} | {f"{prefix}.{n}.weight" for n in ("self_attn_norm", "ffn_norm")}


def test_lm_groups_decay_matrices_only() -> None:
    task = LanguageModelTask(BACKBONE, 11, OPTIMIZER, SCHEDULER)
    assert _groups(task) == {
        "0": ({"embed.weight"} | _block("decoder.blocks.0", "weights"), 1.0, 0.1),
        "1": ({"decoder.pos_encoding.embedding.weight", "decoder.final_norm.weight", "decoder.final_norm.bias"}
              | _block("decoder.blocks.0", "rest"), 1.0, 0.0),
    }


def _classifier(**options: Any) -> SequenceClassificationTask:
    return SequenceClassificationTask({**BACKBONE, "n_layers": 2}, 11, OPTIMIZER, SCHEDULER, class_names=["a", "b", "c"],
                                      majority_accuracy={"validation": 0.5, "test": 0.5}, **options)


def test_classify_groups_follow_depth_and_head() -> None:
    # lr 1, layer_decay 0.5, top depth 3: embeddings 0.5^3, block 0 0.5^2, block 1 0.5, final norm 1; head 7.
    assert _groups(_classifier(layer_decay=0.5, head_lr=7.0)) == {
        "layer_0": ({"cls_token", "embed.weight"}, 0.125, 0.1),
        "layer_0_no_decay": ({"encoder.pos_encoding.embedding.weight"}, 0.125, 0.0),
        "layer_1": (_block("encoder.blocks.0", "weights"), 0.25, 0.1),
        "layer_1_no_decay": (_block("encoder.blocks.0", "rest"), 0.25, 0.0),
        "layer_2": (_block("encoder.blocks.1", "weights"), 0.5, 0.1),
        "layer_2_no_decay": (_block("encoder.blocks.1", "rest"), 0.5, 0.0),
        "layer_3_no_decay": ({"encoder.final_norm.weight", "encoder.final_norm.bias"}, 1.0, 0.0),
        "head": ({"head.weight"}, 7.0, 0.1),
        "head_no_decay": ({"head.bias"}, 7.0, 0.0),
    }


def test_a_backbone_frozen_for_good_leaves_only_the_head_to_the_optimizer() -> None:
    assert _groups(_classifier(freeze_backbone_steps=-1)) == {
        "head": ({"head.weight"}, 1.0, 0.1), "head_no_decay": ({"head.bias"}, 1.0, 0.0),
    }


def _every_task() -> list[TridentTask]:
    """One small instance of each task, the text tasks on 11 tokens, positions learned (a bounded context)."""
    images = {"num_classes": 3, "image_size": 8, "in_channels": 1, "patch_size": 4, "class_names": ["a", "b", "c"],
              "mean": [0.5], "std": [0.5]}
    grid = ImageClassificationTask.backbone_geometry({"image_size": 8, "patch_size": 4}, {})
    return [LanguageModelTask(BACKBONE, 11, OPTIMIZER, SCHEDULER),
            MaskedLanguageModelTask(BACKBONE, 11, OPTIMIZER, SCHEDULER, mask_id=9, pad_id=10, num_regular_tokens=9),
            TranslationTask(BACKBONE, 11, OPTIMIZER, SCHEDULER),
            _classifier(), _classifier(pool="mean"),
            ImageClassificationTask({**BACKBONE, **grid}, OPTIMIZER, SCHEDULER, **images),
            ContrastiveImageTextTask(BACKBONE, OPTIMIZER, SCHEDULER, vocab_size=11, eos_id=10, image_size=8, in_channels=1,
                                     patch_size=4, mean=[0.5], std=[0.5], embed_dim=4, image={"embedding_norm": True}),
            ElectraTask(BACKBONE, 11, OPTIMIZER, SCHEDULER, mask_id=9, pad_id=10, num_regular_tokens=9, generator_size=0.5)]


@pytest.mark.parametrize("task", _every_task(), ids=lambda task: f"{task.NAME}-{task.hparams.get('pool', '')}")
def test_every_example_input_runs_its_network_at_the_bounds_of_its_axes(task: TridentTask) -> None:
    """The ONNX export traces ``net`` on these inputs and lets each dynamic axis take any size in its Dim's
    range: the network runs on the example, and on every axis at its longest (a bounded position table)."""
    torch.manual_seed(0)
    inputs = task.example_input()
    assert len({i.onnx_name for i in inputs}) == len(inputs)
    for i in inputs:
        assert all(dim.min <= i.example.shape[axis] <= dim.max for axis, dim in i.dynamic.items()), i.onnx_name
    longest = {i.parameter: tuple(min(i.dynamic[a].max, 64) if a in i.dynamic else n for a, n in enumerate(i.example.shape))
               for i in inputs}
    with torch.no_grad():
        for values in ({i.parameter: i.example for i in inputs},
                       {i.parameter: torch.zeros(longest[i.parameter], dtype=i.example.dtype) for i in inputs}):
            assert task.net.eval()(**values).shape[0] == len(next(iter(values.values())))
