"""Your own data files: every format, explicit splits, document separators, one-line errors,
atomic preparation and the shared memory map (LM), two-file parallel text, small image folders."""

from __future__ import annotations

import gzip
import json
import logging
import subprocess
import sys
from pathlib import Path

import datasets
import numpy as np
import pytest
from PIL import Image

from trident.data import lm as lm_module
from trident.data.image_sources import load_image_source
from trident.data.lm import LMDataModule
from trident.data.token_files import Encoder
from trident.data.tokenization import END_OF_TEXT, train_tokenizer
from trident.data.translation import load_pairs
from trident.errors import ConfigError, DataError

DOCS = [f"Story {i} begins. Then it ends with the number {i * 7}." for i in range(60)]
SPLIT = [0.8, 0.1, 0.1]


def write_format(folder: Path, fmt: str, docs: list[str]) -> Path:
    """``docs`` written in format ``fmt``, one document per row (for txt: per file, in a folder);
    ``jsonl.gz`` and the like: the same, gzip-compressed."""
    if fmt.endswith(".gz"):
        written = write_format(folder, fmt.removesuffix(".gz"), docs)
        for plain in sorted(written.iterdir()) if written.is_dir() else [written]:
            plain.with_name(plain.name + ".gz").write_bytes(gzip.compress(plain.read_bytes()))
            plain.unlink()
        return written if written.is_dir() else written.with_name(written.name + ".gz")
    folder.mkdir(parents=True, exist_ok=True)
    if fmt == "txt":
        for i, doc in enumerate(docs):
            (folder / f"doc{i:03d}.txt").write_text(doc)
        return folder
    if fmt in ("jsonl", "json"):
        path = folder / f"docs.{fmt}"
        path.write_text("".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(docs)))
        return path
    table = datasets.Dataset.from_dict({"id": list(range(len(docs))), "text": docs})
    if fmt == "csv":
        table.to_csv(folder / "docs.csv", index=False)
        return folder / "docs.csv"
    if fmt == "tsv":
        table.to_csv(folder / "docs.tsv", index=False, sep="\t")
        return folder / "docs.tsv"
    if fmt == "parquet":
        table.to_parquet(folder / "docs.parquet")
        return folder / "docs.parquet"
    assert fmt == "save_to_disk"
    table.save_to_disk(str(folder / "saved"))
    return folder / "saved"


def prepared(tmp_path: Path, files: object, **options: object) -> LMDataModule:
    module = LMDataModule(source="files", files=files, tokenizer="char", block_size=8, batch_size=2,
                          split=SPLIT, cache_dir=str(tmp_path / "cache"), **options)  # type: ignore[arg-type]
    module.prepare_data()
    module.setup()
    return module


def decoded(module: LMDataModule, split: str) -> str:
    assert module.tokenizer is not None
    return module.tokenizer.decode(module.splits[split].tolist(), skip_special_tokens=False)


@pytest.mark.parametrize("fmt", ["txt", "jsonl", "json", "csv", "tsv", "parquet", "save_to_disk", "txt.gz", "jsonl.gz", "csv.gz"])
def test_each_format_gives_its_documents_separated_and_nothing_else(tmp_path: Path, fmt: str) -> None:
    train = write_format(tmp_path / "train", fmt, DOCS[:50])
    validation = write_format(tmp_path / "validation", fmt, DOCS[50:55])
    test = write_format(tmp_path / "test", fmt, DOCS[55:])
    module = prepared(tmp_path, {"train": str(train), "validation": str(validation), "test": str(test)})
    # Each document once, in order, each followed by the end-of-document token: no JSON, CSV or
    # column syntax, no ids, no glued documents.
    assert decoded(module, "train") == "".join(d + END_OF_TEXT for d in DOCS[:50])
    assert decoded(module, "validation") == "".join(d + END_OF_TEXT for d in DOCS[50:55])
    assert decoded(module, "test") == "".join(d + END_OF_TEXT for d in DOCS[55:])
    assert module.tokenizer is not None
    vocabulary = set(module.tokenizer.get_vocab())
    assert not vocabulary & {"{", "}", '"', ":", ",", "\t"}
    assert set("".join(DOCS[:50])) | {"<unk>", END_OF_TEXT} == vocabulary


def test_a_saved_dataset_dict_brings_its_splits(tmp_path: Path) -> None:
    splits = {"train": DOCS[:40], "validation": DOCS[40:50], "test": DOCS[50:]}
    saved = splits | {"unsupervised": DOCS[:3]}  # as IMDB's: a split of another name is left out
    datasets.DatasetDict({k: datasets.Dataset.from_dict({"body": v}) for k, v in saved.items()}).save_to_disk(str(tmp_path / "dd"))
    module = prepared(tmp_path, str(tmp_path / "dd"), text_column="body")
    for name, docs in splits.items():
        assert decoded(module, name) == "".join(d + END_OF_TEXT for d in docs)


def test_one_file_is_cut_contiguously_and_the_log_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    corpus = tmp_path / "corpus.txt"
    lines = [f"line {i:04d}\n" for i in range(1000)]  # 10 characters each
    corpus.write_text("".join(lines))
    with caplog.at_level("INFO"):
        module = prepared(tmp_path, str(corpus))
    assert "validation and test cut from the end of the train data" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO"):
        prepared(tmp_path, str(corpus))  # a cache hit says it too
    assert "data: train given (8,000 tokens); validation cut from the end of train (1,000 tokens); test cut" in caplog.text
    # 10,000 characters: train up to the line break at or after 8,000, validation to 9,000.
    assert decoded(module, "train") == "".join(lines[:800])
    assert decoded(module, "validation") == "".join(lines[800:900])
    assert decoded(module, "test") == "".join(lines[900:]) + END_OF_TEXT


def test_a_missing_test_split_is_cut_from_train_never_copied_from_validation(tmp_path: Path) -> None:
    train, validation = tmp_path / "train.txt", tmp_path / "valid.txt"
    train.write_text("".join(f"train {i:03d}\n" for i in range(900)))  # 10 characters a line
    validation.write_text("rain 99\n" * 20)
    module = prepared(tmp_path, {"train": str(train), "validation": str(validation)})
    assert decoded(module, "validation") == "rain 99\n" * 20 + END_OF_TEXT
    # data.split gives test 10 %: the last 90 lines of train (train keeps 90 %).
    assert decoded(module, "test") == "".join(f"train {i:03d}\n" for i in range(810, 900)) + END_OF_TEXT
    assert decoded(module, "train") == "".join(f"train {i:03d}\n" for i in range(810))
    asked = prepared(tmp_path, {"train": str(train), "validation": str(validation)}, test_on_validation=True)
    assert decoded(asked, "test") == decoded(asked, "validation")
    with pytest.raises(ConfigError, match="data.test_on_validation=true needs a given validation split"):
        prepared(tmp_path, str(train), test_on_validation=True)


def test_a_directory_of_files_reads_them_all_as_documents(tmp_path: Path) -> None:
    folder = tmp_path / "corpus"
    (folder / "part").mkdir(parents=True)
    (folder / "b.txt").write_text("second file\n" * 30)
    (folder / "part" / "c.jsonl").write_text("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(30)))
    (folder / "a.txt").write_text("first file\n" * 30)
    (folder / "notes.md").write_text("not data")
    module = prepared(tmp_path, {"train": str(folder), "validation": str(folder / "a.txt"), "test": str(folder / "b.txt")})
    expected = "first file\n" * 30 + END_OF_TEXT + "second file\n" * 30 + END_OF_TEXT
    assert decoded(module, "train") == expected + "".join(f"row {i}{END_OF_TEXT}" for i in range(30))


def test_a_gzip_text_file_is_one_document_like_its_plain_copy(tmp_path: Path) -> None:
    text = "first line\r\nsecond line\n" * 20  # line ends as written, Windows' too
    (tmp_path / "a.txt.gz").write_bytes(gzip.compress(text.encode()))
    (tmp_path / "b.txt").write_text(text)
    module = prepared(tmp_path, {"train": str(tmp_path / "a.txt.gz"), "validation": str(tmp_path / "b.txt"),
                                 "test": str(tmp_path / "a.txt.gz")})
    assert decoded(module, "train") == decoded(module, "validation") == text + END_OF_TEXT


def test_a_gzip_text_file_cut_short_is_one_line(tmp_path: Path) -> None:
    """Its first block reads (check_file), its end does not: a copy or download cut short."""
    text = "".join(f"line {i}: {i * 7919 % 104729}\n" for i in range(40_000)).encode()
    compressed = gzip.compress(text, mtime=0)
    path = tmp_path / "cut.txt.gz"
    path.write_bytes(compressed[: len(compressed) // 2])
    with pytest.raises(DataError, match=r"cut.txt.gz is damaged gzip data \(.*\): compress it again"):
        prepared(tmp_path, str(path))


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("bad.jsonl", '{"text": "a"}\n{"text": "b"}\n{"text": "c",\n', r"bad.jsonl line 3 is not valid JSON"),
        ("list.jsonl", '{"text": "a"}\n["b"]\n', r"list.jsonl line 2 is a JSON list, not an object"),
        ("other.jsonl", '{"body": "a", "id": 1}\n', r"has no column 'text' \(its columns: body, id\): set the data"),
        ("empty.txt", "", r"empty.txt is empty: put data in it"),
        ("blank.jsonl", "\n\n  \n", r"blank.jsonl is empty"),
        ("header.csv", "text,id\n", r"header.csv has no rows \(a header only\): put data in it or remove it from data.files"),
        ("header.tsv.gz", gzip.compress(b"text\tid\n\n", mtime=0), r"header.tsv.gz has no rows \(a header only\)"),
        ("binary.txt", b"\x89PNG\r\n\x1a\n\x00\x00\x00", r"binary.txt is a binary file, not text"),
        ("latin1.txt", "caf\xe9 au lait\n".encode("latin-1"), r"latin1.txt is not UTF-8 text"),
        ("fake.parquet", "a,b\n1,2\n", r"fake.parquet is not a parquet file \(no PAR1 header\)"),
        ("data.xlsx", "x", r"data.xlsx has suffix '.xlsx', which trident cannot read"),
        ("latin1.csv", "text,id\ncaf\xe9,1\n".encode("latin-1"), r"latin1.csv is not UTF-8 text \(line 2, byte 0xe9: "),
        ("latin1.jsonl", ('{"text": "a"}\n' * 3 + '{"text": "caf\xe9"}\n').encode("latin-1"),
         r"latin1.jsonl is not UTF-8 text \(line 4, byte 0xe9: .*\): convert it to UTF-8"),
        ("latin1.txt.gz", gzip.compress("ok\ncaf\xe9\n".encode("latin-1"), mtime=0), r"latin1.txt.gz is not UTF-8 text \(line 2"),
        ("plain.jsonl.gz", '{"text": "a"}\n', r"plain.jsonl.gz is not gzip data .*: decompress it with gunzip, or drop the .gz"),
        ("docs.parquet.gz", gzip.compress(b"PAR1", mtime=0),
         r"docs.parquet.gz is gzip-compressed .parquet, which trident reads only uncompressed: decompress it with gunzip"),
        ("docs.xlsx.gz", gzip.compress(b"x", mtime=0), r"docs.xlsx.gz has suffix '.xlsx.gz', which trident cannot read"),
    ],
)
def test_bad_files_are_one_line_errors(tmp_path: Path, name: str, content: str | bytes, message: str) -> None:
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(DataError, match=message) as caught:
        prepared(tmp_path, str(path))
    assert "\n" not in str(caught.value)


def test_a_file_datasets_cannot_parse_is_one_line_without_its_logged_errors(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    """The csv builder logs the file it cannot read at ERROR, on its own stderr handler and the root
    logger's, then raises: only trident's one line is left."""
    path = tmp_path / "ragged.csv"
    path.write_text("text,id\na,1\nb,2,3,4\n")
    with caplog.at_level(logging.INFO), pytest.raises(DataError, match=r"could not read \S*ragged.csv as csv"):
        prepared(tmp_path, str(path))
    assert not [record for record in caplog.records if record.levelno >= logging.ERROR]
    assert "Failed to read" not in capfd.readouterr().err


def test_a_split_too_small_names_the_numbers(tmp_path: Path) -> None:
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("one line only, no room for more\n")
    with pytest.raises(DataError, match=r"the validation split of data.source=files is empty \(\d+ train tokens\)"):
        prepared(tmp_path, str(corpus))


def test_the_character_fast_path_matches_the_tokenizer() -> None:
    tokenizer = train_tokenizer("char", ["hello world\n", "naïve café 🙂"], end_of_text=True)
    encoder = Encoder(tokenizer, [tokenizer.token_to_id(END_OF_TEXT)])
    text = "hello\tnaïve 🙂 wörld ☃ café\n"  # a tab, ö and ☃ are unknown to this tokenizer
    ids = encoder([(text, True), ("ol", False)])
    expected = tokenizer.encode(text).ids + [tokenizer.token_to_id(END_OF_TEXT)] + tokenizer.encode("ol").ids
    assert ids.tolist() == expected and ids.dtype == np.uint16
    assert tokenizer.encode("\t").ids == [0]


def test_byte_level_bpe_batches_match_one_by_one_encoding() -> None:
    texts = [f"The {i}th sentence of a small corpus, repeated.\n" for i in range(200)]
    tokenizer = train_tokenizer("bpe", iter(texts), vocab_size=300, length=len(texts))
    pieces = [(t, i % 3 == 0) for i, t in enumerate(texts[:20])]
    eot = tokenizer.token_to_id(END_OF_TEXT)
    expected = [i for t, ends in pieces for i in tokenizer.encode(t).ids + ([eot] if ends else [])]
    assert Encoder(tokenizer, [eot])(pieces).tolist() == expected


def test_a_preparation_that_dies_leaves_nothing_a_later_run_uses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"Line {i} of the corpus.\n" for i in range(3000)))
    real_write = lm_module.write_tokens

    def dies_during_validation(stream, encoder, path):  # type: ignore[no-untyped-def]
        if path.name == "validation.bin":
            path.write_bytes(b"\x01\x00" * 10)  # half a file, then the process dies
            raise KeyboardInterrupt
        return real_write(stream, encoder, path)

    monkeypatch.setattr(lm_module, "write_tokens", dies_during_validation)
    with pytest.raises(KeyboardInterrupt):
        prepared(tmp_path, str(corpus))
    module = LMDataModule(source="files", files=str(corpus), tokenizer="char", split=SPLIT, cache_dir=str(tmp_path / "cache"))
    assert not module.cache_path.exists(), "only the staging directory may hold a half-built cache"
    monkeypatch.setattr(lm_module, "write_tokens", real_write)
    again = prepared(tmp_path, str(corpus))
    fresh = LMDataModule(source="files", files=str(corpus), tokenizer="char", block_size=8, split=SPLIT,
                         cache_dir=str(tmp_path / "fresh_cache"))
    fresh.prepare_data()
    fresh.setup()
    for name in ("train", "validation", "test"):
        np.testing.assert_array_equal(again.splits[name], fresh.splits[name])
    assert not Path(str(again.cache_path) + ".tmp").exists()


def test_ranks_map_one_file_and_hold_no_copy(tmp_path: Path) -> None:
    """What DDP ranks do: each builds its data module; the second finds the cache and maps the
    same file read-only (the page cache holds one copy for all)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"Line {i} of the corpus.\n" for i in range(2000)))
    rank0, rank1 = prepared(tmp_path, str(corpus)), prepared(tmp_path, str(corpus))
    for name in ("train", "validation", "test"):
        a, b = rank0.splits[name], rank1.splits[name]
        assert isinstance(a, np.memmap) and isinstance(b, np.memmap)
        assert Path(a.filename) == Path(b.filename) == (rank0.cache_path / f"{name}.bin").resolve()
        assert a.mode == "r" and not a.flags.writeable
        assert a.dtype == np.uint16
    x0, _ = rank0.blocks("train")[5]
    x1, _ = rank1.blocks("train")[5]
    assert x0.tolist() == x1.tolist()


def test_two_line_aligned_files_are_a_parallel_corpus(tmp_path: Path) -> None:
    english = [f"house number {i}" for i in range(40)]
    german = [f"Haus Nummer {i}" for i in range(40)]
    for stem, rows in (("train", slice(0, 30)), ("dev", slice(30, 35)), ("test", slice(35, 40))):
        (tmp_path / f"{stem}.en").write_text("\n".join(english[rows]) + "\n")
        (tmp_path / f"{stem}.de").write_text("\n".join(german[rows]) + "\n")
    files = {"train": [str(tmp_path / "train.de"), str(tmp_path / "train.en")],  # either order
             "validation": str(tmp_path / "dev"), "test": str(tmp_path / "test")}  # or the common prefix
    pairs, _ = load_pairs("files", {"files": files}, "en", "de", SPLIT)
    assert pairs["train"]["src"] == english[:30] and pairs["train"]["tgt"] == german[:30]
    assert pairs["validation"]["src"] == english[30:35] and pairs["test"]["tgt"] == german[35:]
    (tmp_path / "train.de").write_text("\n".join(german[:29]) + "\n")
    with pytest.raises(DataError, match=r"train.en has 30 lines but .*train.de has 29"):
        load_pairs("files", {"files": files}, "en", "de", SPLIT)


def test_gzip_parallel_files_are_read_and_latin1_ones_are_one_line(tmp_path: Path) -> None:
    english = [f"house number {i}" for i in range(20)]
    german = [f"Haus Nummer {i} \u00e4" for i in range(20)]
    for language, rows in (("en", english), ("de", german)):
        (tmp_path / f"train.{language}.gz").write_bytes(gzip.compress(("\n".join(rows) + "\n").encode()))
    (tmp_path / "dev.tsv.gz").write_bytes(gzip.compress(b"hello\thallo\n"))
    (tmp_path / "test.jsonl.gz").write_bytes(gzip.compress((json.dumps({"en": "yes", "de": "ja"}) + "\n").encode()))
    files = {"train": [str(tmp_path / "train.en.gz"), str(tmp_path / "train.de.gz")],
             "validation": str(tmp_path / "dev.tsv.gz"), "test": str(tmp_path / "test.jsonl.gz")}
    pairs, _ = load_pairs("files", {"files": files}, "en", "de", SPLIT)
    assert pairs["train"]["src"] == english and pairs["train"]["tgt"] == german
    assert (pairs["validation"]["tgt"], pairs["test"]["tgt"]) == (["hallo"], ["ja"])
    (tmp_path / "train.de.gz").write_bytes(gzip.compress(("\n".join(german) + "\n").encode("latin-1")))
    with pytest.raises(DataError, match=r"train.de.gz is not UTF-8 text \(line 1, byte 0xe4: "):
        load_pairs("files", {"files": files}, "en", "de", SPLIT)
    (tmp_path / "train.de.gz").write_bytes(gzip.compress(("\n".join(german) + "\n").encode()))
    (tmp_path / "dev.tsv.gz").write_bytes(gzip.compress("bye\ttsch\u00fcss\n".encode("latin-1")))
    with pytest.raises(DataError, match=r"dev.tsv.gz is not UTF-8 text \(line 1, byte 0xfc: "):
        load_pairs("files", {"files": files}, "en", "de", SPLIT)


def test_given_parallel_splits_are_kept_and_only_missing_ones_cut(tmp_path: Path) -> None:
    train = [f"sentence {i}\tSatz {i}" for i in range(300)]
    (tmp_path / "train.tsv").write_text("\n".join(train) + "\n")
    (tmp_path / "dev.tsv").write_text("hello\thallo\nbye\ttschüss\n")
    pairs, _ = load_pairs("files", {"files": {"train": str(tmp_path / "train.tsv"), "dev": str(tmp_path / "dev.tsv")}},
                          "en", "de", [0.8, 0.1, 0.1])
    assert pairs["validation"]["src"] == ["hello", "bye"]
    assert 10 < len(pairs["test"]) < 60 and len(pairs["train"]) + len(pairs["test"]) == 300
    assert set(pairs["train"]["src"]).isdisjoint(pairs["test"]["src"])


def image_folder(root: Path, count: int, classes: tuple[str, ...] = ("cat", "dog")) -> Path:
    for i in range(count):
        folder = root / classes[i % len(classes)]
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.full((8, 8, 3), i % 256, dtype=np.uint8)).save(folder / f"{i:04d}.png")
    return root


def test_an_image_folder_of_200_images_works_with_the_defaults(tmp_path: Path) -> None:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(Path(__file__).parents[1] / "conf"), version_base=None):
        cfg = compose("train", overrides=["task=vit", "data=imagefolder", f"data.data_dir={tmp_path}"])
    options = {k: cfg.data[k] for k in ("validation_size", "test_size", "split_seed", "test_on_validation")}
    data = load_image_source("imagefolder", {"data_dir": str(image_folder(tmp_path, 200)), **options})
    sizes = {name: len(split) for name, split in data.splits.items()}
    assert sizes == {"train": 160, "validation": 20, "test": 20}
    ids = {name: {row["image"].getpixel((0, 0))[0] * 1000 + row["label"] for row in split} for name, split in data.splits.items()}  # type: ignore[union-attr]
    assert ids["validation"].isdisjoint(ids["test"]) and ids["train"].isdisjoint(ids["test"])
    with pytest.raises(DataError, match=r"the train split has 200 images, too few to cut data.validation_size=150.0 \(150\) \+ data.test_size=100.0 \(100\)"):
        load_image_source("imagefolder", {**options, "data_dir": str(tmp_path), "validation_size": 150, "test_size": 100})


def test_image_split_folders_are_used_as_given(tmp_path: Path) -> None:
    image_folder(tmp_path / "train", 40)
    image_folder(tmp_path / "validation", 6)
    options = {"data_dir": str(tmp_path), "validation_size": 0.1, "test_size": 0.1, "split_seed": 0}
    data = load_image_source("imagefolder", options)
    assert {n: len(s) for n, s in data.splits.items()} == {"train": 36, "validation": 6, "test": 4}
    asked = load_image_source("imagefolder", {**options, "test_on_validation": True})
    assert {n: len(s) for n, s in asked.splits.items()} == {"train": 40, "validation": 6, "test": 6}
    image_folder(tmp_path / "test", 4)
    given = load_image_source("imagefolder", options)
    assert {n: len(s) for n, s in given.splits.items()} == {"train": 40, "validation": 6, "test": 4}


@pytest.mark.slow
def test_a_killed_preparation_process_is_followed_by_a_clean_one(tmp_path: Path) -> None:
    """SIGKILL while the token file is being written (no Python cleanup runs), then prepare again."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"Line {i} of a corpus large enough for a few batches.\n" for i in range(20_000)))
    cache = tmp_path / "cache"
    # The process kills itself once the first batch of the train split is on disk: mid-write, every time.
    script = (
        "import os, signal\n"
        "from trident.data import lm\n"
        "from trident.data.token_files import batches\n"
        "def write_then_die(stream, encoder, path):\n"
        "    with path.open('wb') as out:\n"
        "        out.write(encoder(next(batches(stream))).tobytes())\n"
        "        out.flush()\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "lm.write_tokens = write_then_die\n"
        f"lm.LMDataModule(source='files', files={str(corpus)!r}, tokenizer='bpe', vocab_size=300, split={SPLIT},"
        f" cache_dir={str(cache)!r}).prepare_data()\n"
    )
    killed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240, check=False)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert next(cache.glob("lm/*.tmp/train.bin")).stat().st_size > 0, "killed with the token file half written"
    staging = next(cache.glob("lm/*.tmp"))
    cache_path = staging.with_name(staging.name.removesuffix(".tmp"))
    assert not cache_path.exists()
    module = LMDataModule(source="files", files=str(corpus), tokenizer="bpe", vocab_size=300, block_size=8,
                          split=SPLIT, cache_dir=str(cache))
    assert module.cache_path == cache_path
    module.prepare_data()
    module.setup()
    assert not staging.exists() and (cache_path / "meta.json").is_file()
    meta = json.loads((cache_path / "meta.json").read_text())
    assert module.token_counts() == meta["tokens"]
    assert module.tokenizer is not None
    assert module.tokenizer.decode(module.splits["validation"][:40].tolist()).count("of a corpus large") >= 1
