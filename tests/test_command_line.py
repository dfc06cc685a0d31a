"""train.py's one step before Hydra (trident.runs.command_line): the command line is checked against
the config, composed once, before torch, Lightning and W&B are imported."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from trident.errors import ConfigError
from trident.runs import command_line

from .conftest import CONF_DIR, ROOT

HEAVY = ("torch", "lightning", "wandb")


def imported_modules(*args: str, cwd: Path) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """``python -X importtime train.py <args>`` and the top-level packages it imported."""
    done = subprocess.run([sys.executable, "-X", "importtime", str(ROOT / "train.py"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120, check=False)
    lines = [line for line in done.stderr.splitlines() if line.startswith("import time:")]
    return done, {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in lines}


@pytest.mark.parametrize(
    ("args", "message"),
    [(["model.d_modle=3"], ("error: model.d_modle is not a config key (did you mean model.d_model?): fix its spelling, "
                           "or add a new key with +model.d_modle=<value>")),
     (["modle=nano"], ("error: modle is not a config key (did you mean model?): fix its spelling, or add a new key "
                      "with +modle=<value>")),
     (["model=nanoo"], ("error: model=nanoo does not exist: choose one of base, large, nano, small, tiny, "
                       "transformer_base, transformer_big"))],
)
def test_a_typo_fails_before_torch_lightning_and_wandb_load(args: list[str], message: str, tmp_path: Path) -> None:
    done, modules = imported_modules(*args, cwd=tmp_path)
    assert done.returncode == 2
    assert [line for line in done.stderr.splitlines() if not line.startswith("import time:")] == [message]
    assert not modules & set(HEAVY), f"imported before the check: {modules & set(HEAVY)}"
    assert not list(tmp_path.iterdir()), "no run directory"


def test_help_needs_no_torch(tmp_path: Path) -> None:
    done, modules = imported_modules("--help", cwd=tmp_path)
    assert done.returncode == 0 and "== Configuration groups ==" in done.stdout
    assert not modules & set(HEAVY)


def test_the_config_is_composed_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls: list[list[str]] = []
    compose = command_line.compose_train_config

    def counted(overrides: list[str], **kwargs: Path) -> object:
        calls.append(list(overrides))
        return compose(overrides, **kwargs)

    monkeypatch.setattr(command_line, "compose_train_config", counted)
    argv = ["model=nano", "seed=1,2", "resume=auto", f"paths.output_root={tmp_path}"]
    assert command_line.prepare_command_line(argv, CONF_DIR) == [a for a in argv if a != "resume=auto"]
    # One compose, with a sweep's first value; resume=auto reads run_name and output_root from it.
    assert calls == [["model=nano", "seed=1", "resume=auto", f"paths.output_root={tmp_path}"]]


def test_shared_parts_of_a_group_are_not_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert "_architecture" not in command_line.group_options("model", CONF_DIR / "model")
    with pytest.raises(SystemExit) as exit_info:
        command_line.prepare_command_line(["model=_architecture"], CONF_DIR)
    assert exit_info.value.code == 2 and "model=_architecture does not exist" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "named"), [
    (["task=lm"], None), (["task='lm'"], None), (["-m", "task=lm,vit"], None), (["-m", "task=choice(lm,mlm)"], None),
    (["-m", "pos_encoding=choice(rope)"], None), (["-m", "task=glob(*)"], None),
    (["-m", "task=lm,vitt"], "task=vitt"), (["-m", "task=choice(lm,mlmm)"], "task=mlmm"),
    (["-m", "pos_encoding=choice(rop)"], "pos_encoding=rop"),
])
def test_every_value_of_a_group_sweep_is_checked_in_hydras_sweep_syntax(argv: list[str], named: str | None) -> None:
    """``choice(...)`` is how trident.report.adaptive runs one setting of a sweep over a group (task=, pos_encoding=)."""
    if named is None:
        command_line.check_group_choices(argv, CONF_DIR)
        return
    with pytest.raises(ConfigError, match=f"^{re.escape(named)} does not exist: choose one of "):
        command_line.check_group_choices(argv, CONF_DIR)
