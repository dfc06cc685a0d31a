"""The pretrain_pays presets (issue 25: does pre-training pay?): the two starts differ in their first
weights only, docs/sweeps.md states their jobs, and ``scripts/pretrain_pays.sh`` pre-trains, sweeps and
reports end to end at tiny sizes."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from trident.errors import ConfigError
from trident.runs.pipeline import check_config, train

from .conftest import ROOT, SWEEPS_PAGE, compose_config
from .test_ablation_presets import sweeper_params

PRESETS = ["pretrain_pays_text", "pretrain_pays_vision"]
SCRIPT = ROOT / "scripts" / "pretrain_pays.sh"
# Settings that shape or feed a run (augmentation lives in data and task): equal for both starts of a preset.
RUN_SETTINGS = ("model", "pos_encoding", "data", "task", "trainer", "optimizer", "scheduler", "seed")


def composed_arms(preset: str, run: Path, run_key: str, arm_key: str, arms: tuple[str, str]) -> dict[str, Any]:
    """Each arm of a two-arm preset composed and checked against ``run`` (the source run the preset reads, here a
    directory holding only the tokenizer a text preset reads from it), resolved to plain values."""
    Tokenizer(WordLevel({"a": 0}, unk_token="a")).save(str(run / "tokenizer.json"))
    configs = {}
    for arm in arms:
        cfg = compose_config([f"experiment={preset}", f"{run_key}={run}", f"{arm_key}={arm}"])
        check_config(cfg)
        configs[arm] = OmegaConf.to_container(cfg, resolve=True)
    return configs


@pytest.mark.parametrize("preset", PRESETS)
def test_the_starts_differ_in_init_from_only(preset: str, tmp_path: Path) -> None:
    assert sweeper_params(preset) == {"start": ["scratch", "pretrained"], "seed": ["1", "2", "3"]}
    configs = composed_arms(preset, tmp_path, "pretrained_run", "start", ("scratch", "pretrained"))
    assert (configs["scratch"]["init_from"], configs["pretrained"]["init_from"]) == (None, str(tmp_path))
    for key in RUN_SETTINGS:
        assert configs["scratch"].get(key) == configs["pretrained"].get(key), key


def test_the_vision_starts_normalise_the_digits_as_the_pretraining_did(tmp_path: Path) -> None:
    """Both starts use the pre-trained run's statistics (vit_mnist's data), which init_from gives the pretrained one."""
    pretraining = compose_config(["experiment=vit_mnist"])
    cfg = compose_config(["experiment=pretrain_pays_vision", f"pretrained_run={tmp_path}"])
    assert (list(cfg.data.mean), list(cfg.data.std)) == (list(pretraining.data.mean), list(pretraining.data.std))
    assert cfg.data.name == "digits" and pretraining.data.name != "digits"


def test_a_missing_pretrained_run_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        train(compose_config(["experiment=pretrain_pays_vision", "start=pretrained", "logger=none"], output_dir=tmp_path))
    assert str(caught.value) == "pretrained_run not set: add pretrained_run=<value> to the command line"
    assert not any(tmp_path.iterdir())


def test_the_sweeps_page_states_each_presets_jobs() -> None:
    page = SWEEPS_PAGE.read_text()
    for preset in PRESETS:
        row = re.search(rf"^\| `python train\.py -m experiment={preset} [^`]*` \| (.+?) \| (\d+) \| \d+ min \d+ s \(pre-training \d+ min \d+ s\) \|$",
                        page, re.MULTILINE)
        assert row, f"docs/sweeps.md: a row for {preset}"
        assert int(row.group(2)) == math.prod(len(v) for v in sweeper_params(preset).values())


def _script(tmp_path: Path, *arguments: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PRETRAIN_PAYS_DIR": str(tmp_path / "out"), "PRETRAIN_PAYS_REPORTS": str(tmp_path / "reports")}
    return subprocess.run(["bash", str(SCRIPT), *arguments], capture_output=True, text=True, env=env, timeout=1200,
                          check=False)


def test_the_script_refuses_an_unknown_kind_and_an_unfinished_pretraining(tmp_path: Path) -> None:
    result = _script(tmp_path, "audio")
    assert result.returncode == 2 and result.stderr.splitlines() == [
        "error: unknown kind 'audio': run scripts/pretrain_pays.sh text or scripts/pretrain_pays.sh vision"]
    (tmp_path / "out" / "vit_mnist").mkdir(parents=True)  # no status.json: the pre-training stopped
    result = _script(tmp_path, "vision")
    unfinished = tmp_path / "out" / "vit_mnist"
    assert result.returncode == 2 and result.stderr.splitlines() == [
        f"error: {unfinished} holds an unfinished pre-training: resume it (python train.py resume={unfinished}) or delete it"]


TINY = ["model.n_layers=1", "data.batch_size=8", "trainer.max_steps=2", "trainer.limit_train_batches=2",
        "trainer.check_val_every_n_epoch=1", "trainer.limit_val_batches=1", "trainer.limit_test_batches=1",
        "trainer.num_sanity_val_steps=0", "logger=none", "print_config=false", "callbacks.progress_bar=null",
        "callbacks.model_summary=null"]


@pytest.mark.slow
def test_the_vision_pair_end_to_end_at_tiny_sizes(tmp_path: Path) -> None:
    result = _script(tmp_path, "vision", *TINY)
    assert result.returncode == 0, result.stderr[-2000:]
    out = tmp_path / "out"
    assert [line.split()[0] for line in (out / "times.txt").read_text().splitlines()] == ["vit_mnist", "pretrain_pays_vision"]
    jobs = sorted((out / "pretrain_pays_vision").glob("[0-9]_*"))
    configs = [OmegaConf.load(job / "config_resolved.yaml") for job in jobs]
    assert sorted((c.start, c.seed) for c in configs) == sorted((s, n) for s in ("scratch", "pretrained") for n in (1, 2, 3))
    for job, config in zip(jobs, configs):
        assert config.data.name == "digits" and config.data.train_size == 200
        assert (job / "init").is_dir() == (config.start == "pretrained")
        twin = next(c for c in configs if c.seed == config.seed and c.start != config.start)
        assert check_config(config) == check_config(twin), f"{job.name}: another backbone than its twin's"
        for key in RUN_SETTINGS[1:]:  # the model group: the backbone above (init_from writes out its defaults)
            assert config[key] == twin[key], f"{job.name}: {key} differs between the starts"
        if config.start == "pretrained":
            assert config.init_from == str(out / "vit_mnist") and config.init_new_head
            assert "init_new_head=true" in (job / "init" / "weights.csv").read_text()
    report = (tmp_path / "reports" / "pretrain_pays_vision" / "report.md").read_text()
    assert re.search(r"^\| `start=scratch` \| 3 \|", report, re.MULTILINE)
    assert re.search(r"^\| `start=pretrained` \| 3 \|", report, re.MULTILINE)
    assert "## test/acc: each setting against the best\n\nEach setting against the best setting by mean" in report

    again = _script(tmp_path, "vision", *TINY)
    assert again.returncode == 2 and again.stderr.splitlines() == [
        f"error: {out}/pretrain_pays_vision holds an earlier sweep: move or delete it, or set PRETRAIN_PAYS_DIR"]
    pretrained = (out / "vit_mnist" / "status.json").read_text()
    os.rename(out / "pretrain_pays_vision", tmp_path / "first_sweep")
    # Once the sweep has moved, the next call reuses the pre-training and sweeps again: a sweep that
    # stops at its config (a misspelt key) shows the pre-training was not run again.
    again = _script(tmp_path, "vision", *TINY, "seed=1", "modle=nano")
    assert again.returncode == 2 and again.stderr.splitlines() == [
        f"pre-trained run {out}/vit_mnist completed before: reused",
        "error: modle is not a config key (did you mean model?): fix its spelling, or add a new key with +modle=<value>"]
    assert (out / "vit_mnist" / "status.json").read_text() == pretrained
    assert json.loads((out / "vit_mnist" / "status.json").read_text())["status"] == "completed"
