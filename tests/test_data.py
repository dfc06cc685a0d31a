"""LM data: Shakespeare conversion, contiguous splits, tokenizers, the datasets path on local files, caching."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from trident.data.corpora import corpus_streams, play_to_text
from trident.data.lm import LMDataModule, PackedBlocks
from trident.data.streams import list_stream, split_streams
from trident.data.tokenization import train_tokenizer
from trident.errors import ConfigError, DataError

from .conftest import ROOT

PLAY = """# A Play

## ACT I

### SCENE I. A room.

_Enter ROMEO and JULIET_

**ROMEO**  
But soft, what light  
Through yonder window breaks?

_Aside_

It is the east.

**JULIET**  
_\\[Aside]_  
Ay me!
"""


def test_play_markdown_becomes_speaker_text() -> None:
    text = play_to_text(PLAY)
    assert text == "ROMEO:\nBut soft, what light\nThrough yonder window breaks?\nIt is the east.\n\nJULIET:\nAy me!\n"


def split_texts(source: str, options: dict, fractions: list[float]) -> dict[str, str]:
    streams = split_streams(corpus_streams(source, options), fractions, test_on_validation=False)
    return {name: "".join(text for text, _ in stream()) for name, stream in streams.items()}


def test_shakespeare_corpus_is_the_real_plays() -> None:
    corpus = split_texts("shakespeare", {}, [0.9, 0.05, 0.05])
    assert len(corpus["train"]) > 3_500_000
    assert "ROMEO:\n" in "".join(corpus.values())
    assert "**" not in corpus["train"] and "_Exit" not in corpus["train"]


def test_contiguous_split_has_no_overlap_and_covers_everything() -> None:
    lines = [f"line {i}" for i in range(1000)]
    streams = split_streams({"train": list_stream(lines)}, [0.8, 0.1, 0.1], test_on_validation=False)
    parts = {name: "".join(text for text, _ in stream()).splitlines() for name, stream in streams.items()}
    assert parts["train"] + parts["validation"] + parts["test"] == lines
    assert set(parts["train"]).isdisjoint(parts["validation"]) and set(parts["validation"]).isdisjoint(parts["test"])
    assert 780 <= len(parts["train"]) <= 820


@pytest.mark.parametrize("fractions", [[0.5, 0.5], [0.9, 0.2, -0.1], [0.5, 0.2, 0.2]])
def test_bad_split_fractions(fractions: list[float]) -> None:
    with pytest.raises(ConfigError, match="data.split"):
        split_streams({"train": list_stream(["a", "b"])}, fractions, test_on_validation=False)


def test_char_tokenizer_round_trips_and_marks_unknown() -> None:
    tok = train_tokenizer("char", ["hello world\n"])
    text = "hello\nworld  hello"
    assert tok.decode(tok.encode(text).ids) == text
    assert len(tok.encode(text).ids) == len(text)
    assert tok.encode("z").ids == [tok.token_to_id("<unk>")]


def test_bpe_tokenizer_has_requested_vocab_and_round_trips() -> None:
    texts = ["the quick brown fox jumps over the lazy dog\n" * 50, "Ünïcödé and émojis 🙂\n"]
    tok = train_tokenizer("bpe", texts, vocab_size=300)
    assert tok.get_vocab_size() == 300
    for text in ["the lazy fox 🙂\n", "never seen: Ωλ"]:
        assert tok.decode(tok.encode(text).ids) == text
    assert len(tok.encode("the quick brown fox").ids) < len("the quick brown fox")


def test_unknown_tokenizer_kind() -> None:
    with pytest.raises(ConfigError, match="char, bpe"):
        train_tokenizer("wordpiece", ["x"])


def test_local_files_go_through_datasets_and_cache(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"Line number {i} of a small local corpus.\n" for i in range(400)))
    module = LMDataModule(
        source="files", files=[str(corpus)], tokenizer="bpe", vocab_size=300,
        block_size=16, batch_size=2, cache_dir=str(tmp_path / "cache"),
    )
    module.prepare_data()
    module.setup()
    counts = module.token_counts()
    assert all(n > 16 for n in counts.values())
    # The prepared arrays and the tokenizer are cached: a second module reads them without rebuilding.
    built = sorted(p.name for p in module.cache_path.iterdir())
    assert {"tokenizer.json", "train.bin", "validation.bin", "test.bin", "meta.json"} <= set(built)
    mtime = (module.cache_path / "train.bin").stat().st_mtime_ns
    again = LMDataModule(
        source="files", files=[str(corpus)], tokenizer="bpe", vocab_size=300,
        block_size=16, batch_size=2, cache_dir=str(tmp_path / "cache"),
    )
    again.prepare_data()
    again.setup()
    assert (again.cache_path / "train.bin").stat().st_mtime_ns == mtime
    assert again.token_counts() == counts
    x, y = next(iter(again.train_dataloader()))
    assert x.shape == (2, 16) and (x[:, 1:] == y[:, :-1]).all()


def test_the_cache_keeps_only_what_training_reads(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"Line number {i} of a small local corpus.\n" for i in range(400)))
    module = LMDataModule(source="files", files=[str(corpus)], block_size=16, cache_dir=str(tmp_path / "cache"))
    module.prepare_data()
    assert sorted(p.name for p in module.cache_path.iterdir()) == [
        "meta.json", "test.bin", "tokenizer.json", "train.bin", "validation.bin",
    ]


def test_train_tokens_keeps_the_start_of_the_train_split_only(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"Line number {i} of a small local corpus.\n" for i in range(400)))
    options = {"source": "files", "files": [str(corpus)], "block_size": 16, "batch_size": 2, "cache_dir": str(tmp_path)}
    whole, cut = LMDataModule(**options), LMDataModule(**options, train_tokens=100)
    for module in (whole, cut):
        module.prepare_data()
        module.setup()
    assert cut.cache_path == whole.cache_path, "one cache serves every train_tokens"
    assert len(whole.splits["train"]) > 1000
    np.testing.assert_array_equal(cut.splits["train"], whole.splits["train"][:100])
    for name in ("validation", "test"):
        np.testing.assert_array_equal(cut.splits[name], whole.splits[name])
    assert len(cut.blocks("train")) < len(whole.blocks("train"))
    for bad in (16, 5e4, True):  # one block only; a float; a bool (not the count 1)
        with pytest.raises(ConfigError, match=rf"data.train_tokens={bad} must be an integer above one block \(data.block_size=16\)"):
            LMDataModule(**options, train_tokens=bad)


def prepared_text(files: list[str], cache_dir: Path) -> str:
    """The training split as the data module serves it (decoded from the cached token ids)."""
    module = LMDataModule(source="files", files=files, block_size=8, batch_size=2, cache_dir=str(cache_dir))
    module.prepare_data()
    module.setup()
    assert module.tokenizer is not None
    return module.tokenizer.decode(module.splits["train"].tolist())


def test_the_cache_follows_the_file_content_not_its_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same relative name, edited in place or found in another directory, is new data."""
    cache = tmp_path / "cache"
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir(), second.mkdir()
    (first / "corpus.txt").write_text("abc abc abc abc\n" * 50)
    (second / "corpus.txt").write_text("xyz xyz xyz xyz\n" * 50)
    monkeypatch.chdir(first)
    assert prepared_text(["corpus.txt"], cache).startswith("abc abc")
    (first / "corpus.txt").write_text("abd abd abd abd\n" * 50)  # edited in place (same size)
    assert prepared_text(["corpus.txt"], cache).startswith("abd abd")
    monkeypatch.chdir(second)
    assert prepared_text(["corpus.txt"], cache).startswith("xyz xyz")
    # Unchanged content is one cache, whatever the path that names it.
    assert prepared_text([str(second / "corpus.txt")], cache).startswith("xyz xyz")
    assert len(list((cache / "lm").glob("*/meta.json"))) == 3


def test_packed_blocks_are_contiguous_and_shifted() -> None:
    ids = np.arange(100, dtype=np.uint16)
    blocks = PackedBlocks(ids, 10)
    assert len(blocks) == 9
    x, y = blocks[3]
    assert x.tolist() == list(range(30, 40)) and y.tolist() == list(range(31, 41))


def test_missing_corpus_file(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="not found"):
        corpus_streams("files", {"files": [str(tmp_path / "nope.txt")]})


def test_empty_corpus_file(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(DataError, match="empty"):
        LMDataModule(source="files", files=[str(empty)], cache_dir=str(tmp_path)).prepare_data()


def test_corpus_too_small_for_a_block(tmp_path: Path) -> None:
    small = tmp_path / "small.txt"
    small.write_text("".join(f"line {i}\n" for i in range(40)))
    module = LMDataModule(source="files", files=[str(small)], block_size=64, cache_dir=str(tmp_path))
    module.prepare_data()
    with pytest.raises(DataError, match="block_size"):
        module.setup()


def test_bible_corpus_is_the_kjv() -> None:
    corpus = split_texts("bible", {"translation": "k"}, [0.9, 0.05, 0.05])
    assert corpus["train"].startswith("In the beginning God created the heaven and the earth.")
    with pytest.raises(DataError, match="translation"):
        corpus_streams("bible", {"translation": "?"})


def test_hub_source_runs_load_dataset_and_keeps_its_splits(tmp_path: Path) -> None:
    """data.source=hub calls datasets.load_dataset(hub_path): here a local folder with the
    hub layout (train/validation/test files), since nothing can be downloaded in CI."""
    folder = tmp_path / "my_dataset"
    folder.mkdir()
    for split, n in [("train", 50), ("validation", 5), ("test", 7)]:
        rows = [json.dumps({"story": f"{split} story {i}.", "id": i}) for i in range(n)]
        (folder / f"{split}.jsonl").write_text("\n".join(rows) + "\n")
    streams = corpus_streams("hub", {"path": str(folder), "name": None, "text_column": "story"})
    documents = {name: [text for text, ends in stream() if ends] for name, stream in streams.items()}
    assert {name: len(texts) for name, texts in documents.items()} == {"train": 50, "validation": 5, "test": 7}
    assert documents["test"][0] == "test story 0."
    with pytest.raises(DataError, match="text_column"):
        corpus_streams("hub", {"path": str(folder), "text_column": "body"})


def test_hub_dataset_unreachable_is_a_clear_error() -> None:
    with pytest.raises(DataError, match="could not load dataset 'no-such-user/no-such-dataset'"):
        corpus_streams("hub", {"path": "no-such-user/no-such-dataset"})


def test_the_data_cache_is_the_sessions_own(tmp_path_factory: pytest.TempPathFactory) -> None:
    """conftest points TRIDENT_CACHE_DIR at a fresh directory of this pytest session."""
    assert Path(os.environ["TRIDENT_CACHE_DIR"]).is_relative_to(tmp_path_factory.getbasetemp())


@pytest.mark.slow
def test_the_tests_never_use_the_users_data_cache(tmp_path: Path) -> None:
    """With a user's TRIDENT_CACHE_DIR set (CI has none), a pytest session still gets its own cache."""
    users_cache = tmp_path / "users_cache"
    users_cache.mkdir()
    probe = f"{Path(__file__).relative_to(ROOT)}::test_the_data_cache_is_the_sessions_own"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", f"--basetemp={tmp_path / 'inner'}",
         probe],  # -n 0: one test needs no xdist workers
        cwd=ROOT, env={**os.environ, "TRIDENT_CACHE_DIR": str(users_cache)}, capture_output=True, text=True, check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout
    assert not any(users_cache.iterdir()), "nothing written into the user's cache"
