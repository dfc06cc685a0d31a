"""Start-up of a plain ``task=lm`` run (issue 26: the first training step under 5 s after the command
on a cache hit), protected without timing: the modules that such a run imports before its first
step import none of the packages that only other runs need, each of which costs up to seconds."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import trident
from trident.runs.compose import compose_train_config

# Packages only some runs need: images and ViT (timm, torchvision), table files and the hub (`datasets`
# with pandas and pyarrow), logger=wandb, translation (sacrebleu), export (onnx, transformers),
# reports and figures (matplotlib, scipy), and the extras.
ONLY_SOME_RUNS = frozenset({
    "timm", "torchvision", "datasets", "pandas", "pyarrow", "wandb", "sacrebleu", "transformers", "onnx",
    "onnxruntime", "onnxscript", "matplotlib", "scipy", "sklearn", "mlxtend", "tensorboard", "optuna",
})
SOURCE_ROOT = Path(trident.__file__).parent.parent


def start_up_modules() -> list[str]:
    """What ``python train.py logger=csv`` imports itself: its entry, the job runner, and every trident
    ``_target_`` of the composed config (task, data, callbacks)."""
    cfg = OmegaConf.to_container(compose_train_config(["logger=csv"]), resolve=False)
    targets = []

    def collect(node: object) -> None:
        if isinstance(node, dict):
            target = node.get("_target_")
            if isinstance(target, str) and target.startswith("trident."):
                targets.append(target.rsplit(".", 1)[0])
            for value in node.values():
                collect(value)
        elif isinstance(node, list):
            for value in node:
                collect(value)

    collect(cfg)
    assert "trident.tasks.lm" in targets and "trident.data.lm" in targets  # the walk finds the run's modules
    return ["trident.commands.train", "trident.runs.jobs", *sorted(set(targets))]


def _source(module: str) -> Path | None:
    path = SOURCE_ROOT.joinpath(*module.split("."))
    for candidate in (path / "__init__.py", path.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def _import_time_statements(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Import statements that run when the module is imported: not in functions, not under TYPE_CHECKING."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (s for child in node.orelse for s in _import_time_statements(ast.Module([child], [])))
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        else:
            yield from _import_time_statements(node)


def eager_imports(roots: list[str]) -> dict[str, set[str]]:
    """Trident module -> the top-level packages it imports when imported, over every trident module
    that ``roots`` import at import time (their packages' ``__init__`` included)."""
    found: dict[str, set[str]] = {}
    pending = list(roots)
    while pending:
        module = pending.pop()
        source = _source(module)
        if module in found or source is None:
            continue
        found[module] = set()
        parts = module.split(".")
        pending += [".".join(parts[:i]) for i in range(1, len(parts))]
        for statement in _import_time_statements(ast.parse(source.read_text())):
            if isinstance(statement, ast.Import):
                names = [alias.name for alias in statement.names]
            else:
                base = statement.module or ""
                names = [base] + [f"{base}.{alias.name}" for alias in statement.names]
            for name in names:
                if name.startswith("trident"):
                    pending.append(name)
                else:
                    found[module].add(name.split(".")[0])
    return found


def test_start_up_modules_import_no_package_that_only_other_runs_need() -> None:
    imports = eager_imports(start_up_modules())
    assert "trident.backbone.block" in imports and "trident.runs.pipeline" in imports  # the walk follows trident
    offending = {module: sorted(packages & ONLY_SOME_RUNS) for module, packages in imports.items()
                 if packages & ONLY_SOME_RUNS}
    assert offending == {}, "import these where they are used (a function), not at the top of the module"


def _loaded_after(prelude: str, modules: list[str]) -> set[str]:
    """Top-level packages that importing ``modules`` adds, in a fresh interpreter, after ``prelude``."""
    code = (f"import sys\n{prelude}\nbefore = set(sys.modules)\n"
            f"import {', '.join(modules)}\n"
            "print(' '.join(sorted({m.split('.')[0] for m in set(sys.modules) - before})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(SOURCE_ROOT), os.environ.get("PYTHONPATH", "")])})
    return set(done.stdout.split())


@pytest.mark.slow
def test_a_language_model_run_loads_no_package_that_only_other_runs_need() -> None:
    # Lightning imports torchmetrics, which imports torchvision, scipy, matplotlib (and transformers
    # where installed) itself; what trident's own modules add on top must hold none of the list.
    added = _loaded_after("import lightning, torchmetrics", start_up_modules())
    assert "trident" in added  # the modules were imported in the child
    assert added & ONLY_SOME_RUNS == set()


def test_the_backbone_loads_neither_lightning_nor_an_optional_package() -> None:
    added = _loaded_after("", ["trident.backbone", "trident.models.causal_lm"])
    assert "torch" in added
    assert added & (ONLY_SOME_RUNS | {"lightning", "torchmetrics"}) == set()
