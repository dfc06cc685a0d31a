"""The dependencies in pyproject.toml are true: every third-party package that trident imports is
declared, and ``requires-python`` holds: every dependency, extras included, resolves for the
declared floor, and not for the Python version below it (so the floor is not higher than it must
be; that check needs the package registry, as the install does)."""

from __future__ import annotations

import ast
import importlib.metadata
import json
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


def resolve(reqs: list[str], report: Path, *options: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed"]
    # --target: pip before 24 refuses --python-version without it, even for a dry run (nothing is written).
    target = ["--target", str(report.with_suffix(".target"))] if options else []
    command += ["--report", str(report), *target, *options, *reqs]
    return subprocess.run(command, capture_output=True, text=True, check=False, timeout=600)


@pytest.mark.slow
def test_dependencies_resolve_for_the_declared_python_floor(tmp_path: Path) -> None:
    reqs = requirements()
    here = resolve(reqs, tmp_path / "here.json")
    if here.returncode != 0:
        pytest.skip(f"the dependencies do not resolve here (is the package registry reachable?): {here.stderr[-300:]}")
    # pip resolves for another Python version from wheels only: build the sdist-only ones (e.g.
    # hydra-core's antlr4-python3-runtime, pure Python) into wheels first.
    sdists = [
        f"{item['metadata']['name']}=={item['metadata']['version']}"
        for item in json.loads((tmp_path / "here.json").read_text())["install"]
        if not item["download_info"]["url"].endswith(".whl")
    ]
    wheels = tmp_path / "wheels"
    if sdists:
        build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), *sdists]
        subprocess.run(build, check=True, timeout=600)
    major, minor = declared_floor()
    for version, resolves in ((f"{major}.{minor}", True), (f"{major}.{minor - 1}", False)):
        options = ("--python-version", version, "--only-binary=:all:", "--find-links", str(wheels))
        result = resolve(reqs, tmp_path / f"{version}.json", *options)
        assert (result.returncode == 0) == resolves, f"Python {version}: {result.stderr[-2000:]}"
