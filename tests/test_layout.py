"""The direction of imports inside ``src/trident``, read from the import statements (nothing is imported):

errors <- backbone <- models <- data, training <- tasks <- weights <- runs <- commands (train, evaluate, sample, ...)
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# Each part of the package and its rank: a module imports only from lower ranks or from its own part.
RANKS = {
    "trident": 0,
    "trident.errors": 0,
    "trident.checks": 0,
    "trident.extras": 1,  # on errors; what data and runs check before they need an extra
    "trident.backbone": 1,
    "trident.models": 2,
    "trident.data": 3,
    "trident.training": 3,
    "trident.tasks": 4,
    "trident.weights": 5,  # weights in and out: trident checkpoints, init_from, outside formats (adapters)
    "trident.runs": 6,
}
# The package's public face re-exports, on first use, what the layers above offer (``trident.load``).
PUBLIC_API = {"trident": {"trident.weights.load"}}
# Every other top-level module or package is a command (python -m trident.<command>, console scripts).
COMMAND_RANK = 7
# Commands that build on another command's library: the adaptive-seed loop stops where the report's
# statistics (trident.report.sequential) decide.
COMMAND_LIBRARIES = {"trident.adaptive": {"trident.report"}}


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# src/hydra_plugins (a Hydra sweeper, which imports trident.errors only) is not part of the package.
MODULES = {module_name(path): path for path in sorted((SRC / "trident").rglob("*.py"))}


def part_of(module: str) -> str:
    """The part of the package ``module`` belongs to: a key of RANKS, else its command."""
    known = [part for part in RANKS if module == part or module.startswith(part + ".")]
    longest = max(known, key=len)
    return longest if longest != "trident" or module == "trident" else ".".join(module.split(".")[:2])


def rank(module: str) -> int:
    return RANKS.get(part_of(module), COMMAND_RANK)


def imported_modules(path: Path) -> set[str]:
    """The trident modules that ``path`` imports (TYPE_CHECKING and function-level imports too);
    ``from package import module`` counts as importing that module."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names if f"{node.module}.{alias.name}" in MODULES}
    return {name for name in found if name in MODULES}


def test_the_package_is_read_from_the_source_tree() -> None:
    assert {"trident.errors", "trident.backbone.stack", "trident.runs.pipeline", "trident.train"} <= MODULES.keys()


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down_the_layers(module: str) -> None:
    upward = [
        name for name in imported_modules(MODULES[module]) - PUBLIC_API.get(module, set())
        if (rank(name) > rank(module) or (rank(name) == rank(module) and part_of(name) != part_of(module)))
        and part_of(name) not in COMMAND_LIBRARIES.get(part_of(module), set())
    ]
    assert not upward, f"{module} (layer {part_of(module)}) imports {upward}: move the shared code down a layer"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if part_of(m) != "trident.backbone"))
def test_the_backbone_is_used_through_its_public_api(module: str) -> None:
    inner = [name for name in imported_modules(MODULES[module]) if name.startswith("trident.backbone.")]
    assert not inner, f"{module} imports {inner}: import from trident.backbone (its __init__) instead"


def test_no_import_cycles() -> None:
    graph = {module: imported_modules(path) - {module} for module, path in MODULES.items()}
    graphlib.TopologicalSorter(graph).prepare()  # raises CycleError naming the cycle


def test_the_rules_catch_an_upward_import() -> None:
    assert rank("trident.runs.pipeline") > rank("trident.tasks.lm") > rank("trident.backbone.stack")
    assert part_of("trident.sample") == "trident.sample" and rank("trident.sample") == COMMAND_RANK
    assert part_of("trident.data.lm") != part_of("trident.training.optim")
