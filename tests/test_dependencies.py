"""The dependencies in pyproject.toml are true: every third-party package that trident imports is
declared, and ``requires-python`` holds: every dependency, extras included, resolves for the
declared floor, and not for the Python version below it (so the floor is not higher than it must
be; that check needs the package registry, as the install does)."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from .conftest import ROOT


def requirements() -> list[str]:
    """The project's dependencies and every extra's, without its own extras (``trident[...]``)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = [r for extra in project["optional-dependencies"].values() for r in extra if not r.startswith("trident")]
    return [*project["dependencies"], *extras]


def distribution(requirement: str) -> str:
    """``"hydra-core>=1.3"`` -> ``"hydra-core"``, in the normalized form of PEP 503."""
    name = re.match(r"[A-Za-z0-9._-]+", requirement)
    assert name, requirement
    return re.sub(r"[-_.]+", "-", name.group(0)).lower()


def imported_packages() -> set[str]:
    """The top-level modules that trident's code imports (at the top or inside functions), less
    the standard library and trident itself."""
    sources = [*(ROOT / "src").rglob("*.py"), ROOT / "train.py", ROOT / "eval.py"]
    modules: set[str] = set()
    for source in sources:
        for node in ast.walk(ast.parse(source.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                modules |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules.add(node.module.split(".")[0])
    return modules - set(sys.stdlib_module_names) - {"trident"}


def test_every_imported_package_is_declared() -> None:
    declared = {distribution(r) for r in requirements()}
    providers = importlib.metadata.packages_distributions()  # module -> the installed distributions that hold it
    undeclared = {
        module: providers.get(module, [])
        for module in sorted(imported_packages())
        if not {distribution(d) for d in providers.get(module, [])} & declared
    }
    assert not undeclared, f"imported but not in pyproject.toml's dependencies: {undeclared}"


def declared_floor() -> tuple[int, int]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found = re.fullmatch(r">=\s*3\.(\d+)", project["requires-python"])
    assert found, f"requires-python should be a floor (>=3.X), got {project['requires-python']!r}"
    return 3, int(found.group(1))


def resolve(reqs: list[str], python: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """Resolve ``reqs`` for Python ``python`` (X.Y) from the package registry, as an install there would,
    with uv's resolver (seconds, where pip's dry runs took ~90 s; uv builds an sdist's metadata itself)."""
    requirements_in = tmp_path / f"requirements-{python}.in"
    requirements_in.write_text("\n".join(reqs) + "\n")
    command = [sys.executable, "-m", "uv", "pip", "compile", "--quiet", "--python-version", python, str(requirements_in)]
    return subprocess.run(command, capture_output=True, text=True, check=False, timeout=600)


@pytest.mark.slow
def test_dependencies_resolve_for_the_declared_python_floor(tmp_path: Path) -> None:
    reqs = requirements()
    major, minor = declared_floor()
    floor = resolve(reqs, f"{major}.{minor}", tmp_path)
    if floor.returncode != 0 and "unsatisfiable" not in floor.stderr:
        pytest.skip(f"the dependencies do not resolve here (is the package registry reachable?): {floor.stderr[-300:]}")
    assert floor.returncode == 0, f"Python {major}.{minor}: {floor.stderr[-2000:]}"
    below = resolve(reqs, f"{major}.{minor - 1}", tmp_path)
    assert below.returncode != 0, f"everything resolves for Python {major}.{minor - 1} too: lower requires-python"
    assert "unsatisfiable" in below.stderr, below.stderr[-2000:]  # a resolution failure, not a network one
