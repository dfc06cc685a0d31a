"""Bad input gets one clear line naming the problem and the fix, and exit status 2 (no traceback)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from omegaconf import DictConfig

from trident.errors import ConfigError, DataError
from trident.pipeline import train

from .conftest import ROOT


def run_train(*overrides: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "WANDB_MODE": "disabled"}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *overrides, "paths.output_root=" + str(cwd / "outputs")],
        capture_output=True, text=True, cwd=cwd, env=env, timeout=300,
    )


@pytest.mark.parametrize("args", [["pos_encoding=rotary"], ["-m", "pos_encoding=rope,rotary"]])
def test_unknown_group_option_lists_the_choices(args: list[str], tmp_path: Path) -> None:
    result = run_train(*args, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "error: pos_encoding=rotary does not exist: choose one of alibi, learned, none, relative, rope, sinusoidal"
    )
    assert not (tmp_path / "outputs").exists()


def test_heads_not_dividing_width_is_one_line(tmp_path: Path) -> None:
    result = run_train("model=nano", "model.n_heads=5", cwd=tmp_path)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: model.d_model=64 is not divisible by model.n_heads=5")
    assert "Traceback" not in result.stderr
    assert not list((tmp_path / "outputs").rglob("*.ckpt")) and not (tmp_path / "outputs" / "cache").exists()
    assert not list((tmp_path / "outputs" / "runs").glob("*/*")), "the failed run leaves no empty run directory"


def test_block_longer_than_learned_table(make_config: Callable[..., DictConfig]) -> None:
    cfg = make_config("pos_encoding=learned", "data.block_size=64", "data.max_seq_len=32")
    with pytest.raises(ConfigError, match=r"block_size=64 is longer than data.max_seq_len=32 \(the learned table\)"):
        train(cfg)


def test_missing_corpus_file(make_config: Callable[..., DictConfig], tmp_path: Path) -> None:
    cfg = make_config("data=text_files", f"data.files=[{tmp_path}/missing.txt]")
    with pytest.raises(DataError, match="missing.txt' not found: fix data.files"):
        train(cfg)


def test_empty_corpus_file_from_the_command_line(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    result = run_train("model=nano", "data=text_files", f"data.files=[{empty}]", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "error: the corpus is empty: point data.files at text files with content"
    )
