"""The distill_pays presets (issue 54: does a teacher pay?): the two arms train the same student on the same data,
steps and order, and differ in the distill group alone."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from trident.runs.pipeline import check_config

from .conftest import compose_config
from .test_ablation_presets import sweeper_params
from .test_pretrain_pays import RUN_SETTINGS

PRESETS = ["distill_pays_text", "distill_pays_vision"]


@pytest.mark.parametrize("preset", PRESETS)
def test_the_arms_differ_in_the_teacher_only(preset: str, tmp_path: Path) -> None:
    assert sweeper_params(preset) == {"distill": ["none", "kd"], "seed": ["1", "2", "3"]}
    Tokenizer(WordLevel({"a": 0}, unk_token="a")).save(str(tmp_path / "tokenizer.json"))  # what text reads from the run
    arms = {}
    for arm in ("none", "kd"):
        cfg = compose_config([f"experiment={preset}", f"teacher_run={tmp_path}", f"distill={arm}"])
        check_config(cfg)
        arms[arm] = OmegaConf.to_container(cfg, resolve=True)
    assert (arms["none"]["distill"]["teacher"], arms["kd"]["distill"]["teacher"]) == (None, str(tmp_path))
    assert arms["kd"]["task"].pop("distill") == arms["kd"]["distill"]
    assert arms["none"]["task"].pop("distill") == arms["none"]["distill"]
    for key in RUN_SETTINGS:
        assert arms["none"].get(key) == arms["kd"].get(key), key
    assert arms["none"]["init_from"] is None  # both arms start from random weights: only the teacher's scores differ
