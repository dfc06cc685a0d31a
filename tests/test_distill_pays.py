"""The distill_pays presets (issue 54: does a teacher pay?): the two arms train the same student on the same data,
steps and order, and differ in the distill group alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from .test_ablation_presets import sweeper_params
from .test_pretrain_pays import RUN_SETTINGS, composed_arms

PRESETS = ["distill_pays_text", "distill_pays_vision"]


@pytest.mark.parametrize("preset", PRESETS)
def test_the_arms_differ_in_the_teacher_only(preset: str, tmp_path: Path) -> None:
    assert sweeper_params(preset) == {"distill": ["none", "kd"], "seed": ["1", "2", "3"]}
    arms = composed_arms(preset, tmp_path, "teacher_run", "distill", ("none", "kd"))
    assert (arms["none"]["distill"]["teacher"], arms["kd"]["distill"]["teacher"]) == (None, str(tmp_path))
    assert arms["kd"]["task"].pop("distill") == arms["kd"]["distill"]
    assert arms["none"]["task"].pop("distill") == arms["none"]["distill"]
    for key in RUN_SETTINGS:
        assert arms["none"].get(key) == arms["kd"].get(key), key
    assert arms["none"]["init_from"] is None  # both arms start from random weights: only the teacher's scores differ
