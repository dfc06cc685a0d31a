"""Commands that do not train start fast (issue 51): each console command's ``--help`` answers without torch or
Lightning, ``trident-export``, ``trident-chat`` and ``trident-sample`` without anything they do not use, and a value
the code shares (the ignored target, a special token, the run's config file) is defined once."""

from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
import sys
import tokenize
import tomllib
from pathlib import Path

import pytest

from trident.commands.evaluate import evaluate

from .conftest import ROOT, compose_config
from .test_load_network import TASK_BUILDS, saved

# What no command imports to answer --help: the import floor of a command that loads a model.
NOT_FOR_HELP = ("torch", "lightning")
# What loading and running a model for export, chat or sampling does not use either: configs (Hydra), loggers,
# data sets, metrics (the Lightning task's own imports aside, tests below).
NOT_FOR_A_MODEL = ("hydra", "wandb", "mlflow", "datasets", "torchmetrics", "omegaconf", "transformers", "matplotlib")
LEAN = ("trident-export", "trident-chat", "trident-sample")

# Run each command's --help in one fresh process, in turn, recording what each one added to sys.modules.
HELP_ALL = """
import contextlib, importlib, io, json, sys
found = {}
for name, target in json.loads(sys.argv[1]).items():
    module, function = target.split(":")
    sys.argv = [name, "--help"]
    out, code = io.StringIO(), 0
    with contextlib.redirect_stdout(out):
        try:
            getattr(importlib.import_module(module), function)()
        except SystemExit as stop:
            code = stop.code or 0
    found[name] = {"code": code, "help": out.getvalue(), "modules": sorted({m.split(".")[0] for m in sys.modules})}
print(json.dumps(found))
"""


def console_commands() -> dict[str, str]:
    """pyproject.toml's [project.scripts]: name -> "module:function"; the lean commands first (modules accumulate in
    the one process), the Hydra command (trident-train) last."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    return dict(sorted(scripts.items(), key=lambda item: (item[0] not in LEAN, item[0] == "trident-train")))


@pytest.mark.slow
def test_every_command_answers_help_without_torch_or_lightning() -> None:
    commands = console_commands()
    assert {"trident-export", "trident-chat", "trident-sample", "trident-eval", "trident-train"} <= set(commands)
    result = subprocess.run([sys.executable, "-c", HELP_ALL, json.dumps(commands)], capture_output=True, text=True,
                            cwd=ROOT, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.splitlines()[-1])
    for name, seen in found.items():  # modules accumulate: the first command that imports one is named
        assert seen["code"] == 0 and seen["help"].strip(), f"{name} --help: exit {seen['code']}, {seen['help']!r}"
        assert not set(NOT_FOR_HELP) & set(seen["modules"]), f"{name} --help imported {set(NOT_FOR_HELP) & set(seen['modules'])}"
        if name in LEAN:
            assert not set(NOT_FOR_A_MODEL) & set(seen["modules"]), name
    assert "checkpoint" in found["trident-eval"]["help"] and "== Config ==" in found["trident-train"]["help"]


def python_strings(path: Path) -> list[str]:
    """The values of ``path``'s string literals (docstrings and comments hold words, not these values)."""
    strings = []
    for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if token.type == tokenize.STRING and not token.string.startswith(('"""', "'''")):
            strings.append(token.string.strip("\"'"))
    return strings


def test_shared_values_are_defined_once() -> None:
    """The ignored target (-100), the special tokens and the run's config file name are each written in one module."""
    src = ROOT / "src" / "trident"
    homes = {"[MASK]": "data/special_tokens.py", "[PAD]": "data/special_tokens.py", "[UNK]": "data/special_tokens.py",
             "[CLS]": "data/special_tokens.py", "[SEP]": "data/special_tokens.py", "<pad>": "data/special_tokens.py",
             "<s>": "data/special_tokens.py", "</s>": "data/special_tokens.py",
             "config_resolved.yaml": "weights/run_config.py"}
    written: dict[str, set[str]] = {value: set() for value in homes}
    ignore_index = set()
    for path in src.rglob("*.py"):
        relative = str(path.relative_to(src))
        for value in python_strings(path):
            if value in written:
                written[value].add(relative)
        if re.search(r"^\s*\w+\s*(:[^=]+)?=\s*-100\b", path.read_text(), re.MULTILINE):  # a name given F.cross_entropy's default
            ignore_index.add(relative)
    assert {value: sorted(paths) for value, paths in written.items()} == {v: [home] for v, home in homes.items()}
    assert ignore_index == {"data/special_tokens.py"}


# Export, sample and chat of one run in one fresh process, each followed by the top-level modules loaded so far.
USE_ALL = """
import contextlib, io, json, sys
from trident.commands import chat, export, sample
run, out = sys.argv[1], sys.argv[2]
found = {}
for name, command, argv in (("trident-export", export.main, [run, "--format", "safetensors", "--out", out]),
                            ("trident-sample", sample.main, [run, "--max-new-tokens", "2"]),
                            ("trident-chat", chat.main, [run, "--message", "Hi", "--max-new-tokens", "2"])):
    with contextlib.redirect_stdout(io.StringIO()):
        command(argv)
    found[name] = sorted({m.split(".")[0] for m in sys.modules})
print(json.dumps(found))
"""


@pytest.mark.slow
def test_export_sample_and_chat_of_a_run_import_no_configs_loggers_or_data_sets(
        lm_reference_run: tuple[Path, dict[str, float]], tmp_path: Path) -> None:
    run, _ = lm_reference_run
    result = subprocess.run([sys.executable, "-c", USE_ALL, str(run), str(tmp_path / "exported")], capture_output=True,
                            text=True, cwd=tmp_path, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.splitlines()[-1])
    assert (tmp_path / "exported" / "model.safetensors").is_file()
    # Lightning itself imports torchmetrics, and through it transformers and matplotlib: the floor of a task.
    unused = {"hydra", "wandb", "mlflow", "datasets"}
    assert not unused & set(found["trident-export"]) and "omegaconf" not in found["trident-sample"]
    assert not unused & set(found["trident-chat"])  # chat reads the run's config (omegaconf): its template


# trident-export --format hf of each checkpoint in turn in one fresh process (arguments: checkpoint, out, checkpoint,
# out, ...), then after each the modules loaded so far: modules accumulate, so the first export that imports one is
# the one whose list first holds it.
EXPORT_HF = """
import contextlib, io, json, sys
from trident.commands import export
for checkpoint, out in zip(sys.argv[1::2], sys.argv[2::2]):
    with contextlib.redirect_stdout(io.StringIO()):
        export.main([checkpoint, "--format", "hf", "--out", out])
    print(json.dumps(sorted(sys.modules)))
"""
HF_EXPORTED = ["lm-lora", "mlm", "vit"]


@pytest.mark.slow
def test_the_hf_export_reads_the_network_without_lightning_and_writes_without_transformers(tmp_path: Path) -> None:
    """The network is read without its task (trident.weights.network): no Lightning, and so none of what it imports
    (torchmetrics, and through it matplotlib); the directory is written without transformers (its import with the
    model classes took longer than torch's: trident.weights.adapters.hf_writing). A LoRA run's adapters are merged.
    One process exports the three tasks' checkpoints (a fresh one each would only add torch's imports)."""
    arguments = [str(path) for name in HF_EXPORTED
                 for path in (saved(TASK_BUILDS[name](), tmp_path / f"{name}.ckpt"), tmp_path / f"{name}-hf")]
    result = subprocess.run([sys.executable, "-c", EXPORT_HF, *arguments], capture_output=True, text=True, cwd=tmp_path,
                            timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = result.stdout.splitlines()[-len(HF_EXPORTED):]
    assert len(loaded) == len(HF_EXPORTED), result.stdout[-3000:]
    for name, listed in zip(HF_EXPORTED, loaded, strict=True):
        modules = json.loads(listed)
        hf = tmp_path / f"{name}-hf"
        assert (hf / "model.safetensors").is_file() and (hf / "config.json").is_file(), name
        modeling = [module for module in modules if re.fullmatch(r"transformers\.models\.\w+\.modeling_\w+", module)]
        assert not modeling, (name, modeling[:5])
        imported = {module.split(".")[0] for module in modules}
        assert not {"transformers", "huggingface_hub", "lightning", "torchmetrics", "hydra", "omegaconf", "wandb",
                    "mlflow", "datasets", "matplotlib"} & imported, name


def test_the_lm_measures_its_costs_whatever_the_callbacks_and_no_other_task_does() -> None:
    for callbacks in ("default", "none", "early_stopping"):
        cfg = compose_config([f"callbacks={callbacks}"])
        assert cfg.callbacks.model_costs._target_ == "trident.training.callbacks.ModelCosts", callbacks
    for task in ("mlm", "translation", "vit", "classify"):
        assert "model_costs" not in compose_config([f"task={task}"]).callbacks, task


@pytest.mark.slow
def test_train_and_eval_log_the_lm_costs(lm_reference_run: tuple[Path, dict[str, float]], tmp_path: Path) -> None:
    """train.py's test of a task=lm run logs what its quality costs (callbacks.model_costs); eval.py, which
    drops the training callbacks, keeps that measure, also for a run saved before the callback existed (its config
    names none: the task measured its costs itself then)."""
    from omegaconf import OmegaConf

    run, metrics = lm_reference_run
    costs = {"test/kv_cache_bytes_per_token", "test/greedy_tokens_per_s", "test/trainable_params"}
    assert costs <= set(metrics)
    copy = tmp_path / "run"  # eval.py writes into the run directory: the shared run stays as it is
    shutil.copytree(run, copy)
    saved = OmegaConf.load(copy / "config_resolved.yaml")
    saved.callbacks.pop("model_costs")
    OmegaConf.save(saved, copy / "config_resolved.yaml")
    scored = evaluate([f"ckpt_path={copy}", "trainer.limit_test_batches=1"])
    assert costs <= set(scored) and scored["test/kv_cache_bytes_per_token"] == metrics["test/kv_cache_bytes_per_token"]


def test_the_lm_costs_on_a_task_that_does_not_decode_are_one_line() -> None:
    from trident.errors import ConfigError
    from trident.tasks.mlm import MaskedLanguageModelTask
    from trident.training.callbacks import ModelCosts

    backbone = {"d_model": 8, "n_heads": 2, "n_layers": 1, "d_ff": 16, "max_seq_len": 8, "pos_encoding": "learned"}
    task = MaskedLanguageModelTask(backbone, vocab_size=11, optimizer={}, scheduler={}, mask_id=9, pad_id=10,
                                   num_regular_tokens=9)
    with pytest.raises(ConfigError, match="remove callbacks.model_costs"):
        ModelCosts().setup(None, task, "test")  # type: ignore[arg-type]  # the callback asks the task alone


HYDRA_HELP = """
import sys
from hydra_plugins.trident_sweeper import register_sweeper
from trident.commands import train
register_sweeper()
sys.argv = ["trident-train", *sys.argv[1:], "--help"]
train.train_job()
"""


def help_sections(text: str) -> tuple[dict[str, str], str]:
    """A train help text's groups (name -> options) and its config section."""
    groups_part, config_part = text.split("== Config ==")
    groups = dict(line.split(": ", 1) for line in groups_part.splitlines() if ": " in line and "(" not in line)
    return groups, config_part.split("\n\n", 1)[1].split("\n\n\n")[0].strip()


@pytest.mark.slow
def test_train_help_lists_what_hydras_own_help_lists_in_a_fraction_of_its_time() -> None:
    """trident-train --help answers itself (Hydra's takes seconds to list the groups): the same groups and
    options, but the private parts (``_*.yaml``), and the same config composed with the command line's overrides."""
    overrides = ["task=vit", "model=nano"]
    hydra = subprocess.run([sys.executable, "-c", HYDRA_HELP, *overrides], capture_output=True, text=True, cwd=ROOT,
                           timeout=120, check=True).stdout
    ours = subprocess.run([sys.executable, "-m", "trident.commands.train", *overrides, "--help"], capture_output=True,
                          text=True, cwd=ROOT, timeout=120, check=True).stdout
    (hydra_groups, hydra_config), (groups, config) = help_sections(hydra), help_sections(ours)
    public = {name: ", ".join(o for o in options.split(", ") if not o.startswith("_"))
              for name, options in hydra_groups.items()}
    assert groups == public and "patch_size" in config
    assert config == hydra_config


def test_train_help_refuses_a_bad_override_in_one_line() -> None:
    from trident.errors import ConfigError
    from trident.runs.train_help import train_help

    with pytest.raises(ConfigError, match="model.no_such_key"):
        train_help(["model.no_such_key=1", "--help"])
    assert "task: classify, clip, electra, lm, mlm, translation, vit" in train_help(["-h"])
