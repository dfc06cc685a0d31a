"""The direction of imports inside ``src/trident``, read from the import statements (nothing is imported):

errors <- backbone <- models <- data, parallel, tracking <- training <- objectives, converters <- tasks <- weights, launch <- runs <- commands/ (train, evaluate,
sample, ...), report/ (with the seeds-until-decided loop), bench/ <- the package's public face (``trident.load``)
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# Each part of the package and its rank: a module imports only from lower ranks or from its own part.
# The package's root holds these and nothing else.
RANKS = {
    "trident.errors": 0,
    "trident.extras": 1,  # on errors; what data and runs check before they need an extra
    "trident.backbone": 1,
    "trident.models": 2,
    "trident.data": 3,
    "trident.parallel": 3,  # FSDP2 and tensor parallelism, sharded checkpoints
    "trident.tracking": 3,  # loggers, the step axis of records, W&B files
    "trident.training": 4,  # optimizers, losses, callbacks, precision, FLOPs, run checks
    "trident.objectives": 5,  # the losses a task's outputs train on (next token, masked tokens, ...)
    "trident.converters": 5,  # what changes a network between loading its weights and sharding it (LoRA)
    "trident.tasks": 6,
    "trident.weights": 7,  # weights in and out: trident checkpoints, init_from, outside formats (adapters)
    "trident.launch": 7,  # DDP workers, stop signals, SLURM requeue
    "trident.runs": 8,
    "trident.commands": 9,  # python -m trident.commands.<command>, the console scripts
    "trident.report": 9,  # python -m trident.report, and its seeds-until-decided loop (report.adaptive)
    "trident.bench": 9,  # python -m trident.bench
    # The package's public face re-exports, on first use, what the layers offer (``trident.load``):
    # nothing inside imports it (an arrow back up).
    "trident": 10,
}
# Rooms whose every module is a command of its own: a command imports no other command.
COMMAND_ROOMS = {"trident.commands"}
COMMAND_RANK = RANKS["trident.commands"]


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# src/hydra_plugins (a Hydra sweeper, which imports trident.errors only) is not part of the package.
MODULES = {module_name(path): path for path in sorted((SRC / "trident").rglob("*.py"))}


def room_of(module: str) -> str:
    """The key of RANKS that holds ``module``."""
    longest = max((part for part in RANKS if module == part or module.startswith(part + ".")), key=len)
    assert longest != "trident" or module == "trident", f"{module} stands at the package's root: give it a room"
    return longest


def part_of(module: str) -> str:
    """The part of the package ``module`` belongs to: its room, or in a command room the command itself."""
    room = room_of(module)
    return module if room in COMMAND_ROOMS else room


def rank(module: str) -> int:
    return RANKS[room_of(module)]


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
    assert {"trident.errors", "trident.backbone.stack", "trident.runs.pipeline", "trident.commands.train"} <= MODULES.keys()


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down_the_layers(module: str) -> None:
    upward = [
        name for name in imported_modules(MODULES[module])
        if rank(name) > rank(module) or (rank(name) == rank(module) and part_of(name) != part_of(module))
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
    assert rank("trident") > rank("trident.runs.code_version") > rank("trident.launch.requeue") > rank("trident.tasks.lm")
    assert rank("trident.runs.pipeline") > rank("trident.tasks.lm") > rank("trident.backbone.stack")
    assert rank("trident.tasks.lm") > rank("trident.objectives.tokens") > rank("trident.data.masking")
    assert part_of("trident.commands.sample") == "trident.commands.sample" and rank("trident.commands.sample") == COMMAND_RANK
    assert part_of("trident.data.lm") != part_of("trident.training.optim")
    assert part_of("trident.commands.sample") != part_of("trident.commands.export")  # commands import no command
    with pytest.raises(AssertionError, match="root"):
        part_of("trident.sample")


def test_the_root_holds_the_layers_and_nothing_else() -> None:
    root = {module for module in MODULES if module.count(".") == 1}
    assert root <= RANKS.keys(), f"{sorted(root - RANKS.keys())} stand at the package's root: give them a room"
