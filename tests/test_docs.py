"""The docs: the README is one screenful with the two set-up commands and a map of the docs pages, and
``mkdocs build --strict`` builds every page of docs/ into a site, failing on a dead link or a page
missing from the nav (mkdocs.yml)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from .conftest import ROOT

DOCS = ROOT / "docs"
README = ROOT / "README.md"
# A newcomer's two commands on a fresh machine: the default job, and the test suite.
SET_UP_COMMANDS = [
    "python3 -m venv .venv && . .venv/bin/activate && pip install -e . && python train.py",
    'python3 -m venv .venv && . .venv/bin/activate && pip install uv && uv pip install -e ".[dev]" && pytest',
]
README_MAX_LINES = 250
MARKDOWN_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
needs_mkdocs = pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
    reason="mkdocs or mkdocs-material is not installed: pip install -e '.[dev]'",
)


def nav_pages(nav: list[str | dict[str, object]]) -> list[str]:
    """The page paths of a mkdocs nav (a list of pages and ``{title: page or nav}`` entries)."""
    pages: list[str] = []
    for entry in nav:
        for value in entry.values() if isinstance(entry, dict) else [entry]:
            pages += nav_pages(value) if isinstance(value, list) else [str(value)]
    return pages


def mkdocs_config() -> dict[str, object]:
    return yaml.safe_load((ROOT / "mkdocs.yml").read_text())


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's notice about its successor, not ours
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], capture_output=True, text=True, env=env, timeout=120, check=False)


def test_the_readme_is_one_screenful_with_the_two_set_up_commands() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    commands = re.findall(r"^```bash\n(.*?)\n```$", text, re.MULTILINE | re.DOTALL)
    assert commands == SET_UP_COMMANDS


def test_every_docs_page_is_in_the_nav_and_the_readme_and_index_link_each_top_level_page() -> None:
    pages = nav_pages(mkdocs_config()["nav"])
    assert sorted(pages) == sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    top_level = [page for page in pages if "/" not in page and page != "index.md"]
    readme_links = MARKDOWN_LINK.findall(README.read_text())
    assert all((ROOT / link).exists() for link in readme_links), readme_links
    assert sorted({link for link in readme_links if link.startswith("docs/")}) == sorted(f"docs/{p}" for p in top_level)
    assert sorted(set(MARKDOWN_LINK.findall((DOCS / "index.md").read_text()))) == sorted(top_level)


@needs_mkdocs
def test_the_docs_site_builds_strict(tmp_path: Path) -> None:
    result = mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0, result.stderr[-3000:]
    built = {str(p.relative_to(tmp_path / "site").parent) for p in (tmp_path / "site").rglob("index.html")}
    # Each page becomes <page>/index.html (the home page: index.html).
    pages = nav_pages(mkdocs_config()["nav"])
    assert {"." if page == "index.md" else page.removesuffix(".md") for page in pages} <= built


@needs_mkdocs
@pytest.mark.parametrize(("page", "orphan", "warning"), [
    ("See [the data page](data.md).\n", False,
     "Doc file 'index.md' contains a link 'data.md', but the target is not found among documentation files."),
    ("# Home\n", True,
     ('The following pages exist in the docs directory, but are not included in the "nav" configuration:\n'
      "  - orphan.md")),
], ids=["dead-link", "page-not-in-nav"])
def test_the_build_fails_on_a_dead_link_or_a_page_missing_from_the_nav(tmp_path: Path, page: str, orphan: bool,
                                                                       warning: str) -> None:
    """trident's mkdocs.yml settings, on a scratch docs folder of one page (index.md) and one orphan."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text(page)
    if orphan:
        (tmp_path / "docs" / "orphan.md").write_text("# Orphan\n")
    config = mkdocs_config() | {"docs_dir": str(tmp_path / "docs"), "nav": [{"Home": "index.md"}]}
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    result = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert result.returncode != 0
    assert f"WARNING -  {warning}" in result.stderr, result.stderr


@pytest.mark.parametrize("guide", ["Add a task", "Add an objective", "Add a Hugging Face architecture (an adapter)",
                                   "Add a positional encoding", "Add a module to the parallel plan"])
def test_each_add_guide_names_the_one_file_to_open_and_every_file_it_names_exists(guide: str) -> None:
    """docs/architecture.md's "add ..." guides: each opens with the one file to open first, and every source,
    conf or test path a step names is there (a renamed module leaves no guide pointing at nothing)."""
    page = (DOCS / "architecture.md").read_text()
    section = page.split(f"\n## {guide}\n", 1)[1].split("\n## ", 1)[0]
    first = re.match(r"\s*The file to open: `([^`]+)`", section)
    assert first is not None, f"{guide}: no 'The file to open: `<path>`' first"
    assert (ROOT / first.group(1)).is_file(), first.group(1)
    named = re.findall(r"`((?:src|conf|tests)/[^`<>*]+\.(?:py|yaml))`", section)
    assert named and not [path for path in named if not (ROOT / path).is_file()]
