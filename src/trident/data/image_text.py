"""Image-text pairs for contrastive training (``data=image_text``, task=clip): batches of (images (B, C, H, W),
caption ids (B, T), class labels (B,), -1 where a pair has none).

Sources (``data.source``):

- a packaged image set (``mnist_5k``, ``digits``, ``fashion_mnist``: trident.data.image_sources), each image captioned
  from its class name by one of ``data.templates`` (image i takes template i mod K); the classes named in
  ``data.zero_shot_classes`` are held out of training (their images stay in validation and test), for zero-shot
  classification by class names and the templates. Their names are learnt from ``data.name_source``, a second packaged
  set of the same classes in another style (the default: scikit-learn's 8x8 digits, upscaled into MNIST's 20 x 20
  box of the 28 x 28 field, ``data.name_source_frame``): all its images, of every class, train (up to ``data.name_source_size``) and none is evaluated, so the held-out classes' words have
  trained embeddings while none of the evaluated source's images of them trained. A zero-shot class whose name no
  training caption holds (no name source) is refused with a word-level tokenizer: its embedding would stay as
  initialised and its zero-shot accuracy stay at chance;
- a JSONL, CSV or parquet file of pairs, its ``data.image_column`` a path (relative to the file's folder) and its
  ``data.caption_column`` the caption; or a folder holding ``captions.jsonl`` / ``.csv`` / ``.parquet``. Its pairs
  are split into train / validation / test by ``data.validation_size`` / ``data.test_size`` (one fixed shuffle). Its
  pairs have no classes: ``class_names``, ``templates`` and ``zero_shot_classes`` (a packaged source's) do not apply.

Captions are tokenized by a word-level tokenizer built from every caption, class name and template
(``data.tokenizer=null``), or by a tokenizer.json (e.g. a CLIP tokenizer's), and end in ``<|endoftext|>``, the token
the text tower pools at; shorter captions are padded with it (after the first, nothing is read: the tower is causal).
"""

from __future__ import annotations

import csv
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, processors
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from trident.data.base import WeightsSource, source_tokenizer_file, stage_source_tokenizer
from trident.data.image_sources import load_image_source
from trident.data.images import ImageDataset, ImageSettingsDataModule, NormalizedArrays, eval_transform
from trident.data.order import EpochShuffleSampler
from trident.data.tokenization import END_OF_TEXT, UNK, read_tokenizer
from trident.errors import ConfigError, DataError

if TYPE_CHECKING:
    from omegaconf import DictConfig

log = logging.getLogger(__name__)

PACKAGED = ("mnist_5k", "digits", "fashion_mnist")
CAPTION_FILES = ("captions.jsonl", "captions.csv", "captions.parquet")
SPLITS = ("train", "validation", "test")
#: The scripts written without spaces between words (Chinese, Japanese, Thai, Lao, Khmer, Burmese): each of their
#: characters is a token of its own, else a caption's whole run of them would be one word, seen in no other caption.
UNSPACED_SCRIPTS = r"[\p{Han}\p{Hiragana}\p{Katakana}\p{Thai}\p{Lao}\p{Khmer}\p{Myanmar}]"


def word_tokenizer(texts: list[str]) -> Tokenizer:
    """A lower-cased word-level tokenizer (words and punctuation; a character of a script without spaces) of every word
    in ``texts``, ``<unk>`` and ``<|endoftext|>`` first, which ends each text in ``<|endoftext|>``."""
    split = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(),
                                     pre_tokenizers.Split(Regex(UNSPACED_SCRIPTS), behavior="isolated")])
    words = sorted({word for text in texts for word, _ in split.pre_tokenize_str(text.lower())})
    vocabulary = {UNK: 0, END_OF_TEXT: 1} | {w: i + 2 for i, w in enumerate(words)}
    tokenizer = Tokenizer(models.WordLevel(vocabulary, unk_token=UNK))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = split
    # Each text ends in <|endoftext|>, as CLIP's tokenizer ends it: the run's exported tokenizer (trident-export --format
    # hf) encodes what the text tower pools at (caption_ids appends it itself, after cutting a caption to fit).
    tokenizer.post_processor = processors.TemplateProcessing(single=f"$A {END_OF_TEXT}",
                                                             special_tokens=[(END_OF_TEXT, vocabulary[END_OF_TEXT])])
    return tokenizer


def end_of_text_id(tokenizer: Tokenizer) -> int:
    """The id of ``<|endoftext|>``, which every caption ends in, or one line naming the fix."""
    eos = tokenizer.token_to_id(END_OF_TEXT)
    if eos is None:
        raise ConfigError(f"the tokenizer has no {END_OF_TEXT} token, which task=clip pools the text at: choose "
                          "data.tokenizer=null (a word-level tokenizer of the captions) or a CLIP tokenizer.json")
    return eos


def caption_ids(tokenizer: Tokenizer, texts: list[str], length: int) -> Tensor:
    """``texts`` -> (N, ``length``) ids, each ending in ``<|endoftext|>`` (cut to fit) and padded with it."""
    eos = end_of_text_id(tokenizer)
    rows = torch.full((len(texts), length), eos, dtype=torch.long)
    for i, encoding in enumerate(tokenizer.encode_batch(texts)):
        ids = [token for token in encoding.ids if token != eos][: length - 1]
        rows[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return rows


def framed(images: np.ndarray, frame: int, size: int) -> np.ndarray:
    """uint8 images (N, H, W) resized to ``frame`` x ``frame`` (bilinear: values stay in range) and centred on a
    ``size`` x ``size`` black field, as MNIST fits its digits into a 20 x 20 box of its 28 x 28 images."""
    pixels = torch.from_numpy(images).float()[:, None]  # (N, 1, H, W)
    if pixels.shape[-2:] != (frame, frame):
        pixels = F.interpolate(pixels, size=(frame, frame), mode="bilinear", align_corners=False).round()
    before = (size - frame) // 2
    return F.pad(pixels, (before, size - frame - before) * 2)[:, 0].to(torch.uint8).numpy()  # (N, size, size)


@dataclass
class Pairs:
    """One split: images (an image dataset of (image, label), or paths), captions and class labels (-1: none)."""

    images: Dataset[tuple[Tensor, int]] | list[Path]
    captions: list[str]
    labels: list[int]


class PairDataset(Dataset[tuple[Tensor, Tensor, int]]):
    def __init__(self, pairs: Pairs, ids: Tensor, transform: Any, channels: int) -> None:
        self.pairs, self.ids, self.transform = pairs, ids, transform
        self.mode = "L" if channels == 1 else "RGB"

    def __len__(self) -> int:
        return len(self.pairs.captions)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor, int]:
        images = self.pairs.images
        if isinstance(images, list):
            with Image.open(images[index]) as opened:
                image = self.transform(opened.convert(self.mode))
        else:
            image = images[index][0]
        return image, self.ids[index], self.pairs.labels[index]


def read_pair_table(path: Path, image_column: str, caption_column: str) -> tuple[list[Path], list[str]]:
    """The image paths (resolved against ``path``'s folder, each one existing) and captions of a JSONL, CSV or parquet
    table; a missing column or image is one line naming it."""
    if path.suffix == ".jsonl":
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    elif path.suffix == ".csv":
        with path.open(newline="") as handle:
            rows = list(csv.DictReader(handle))
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    else:
        raise ConfigError(f"data.source={path} is not a .jsonl, .csv or .parquet file of image-text pairs, nor a folder "
                          f"holding {', '.join(CAPTION_FILES)}")
    if not rows:
        raise DataError(f"{path} holds no image-text pair")
    for column, key in ((image_column, "image_column"), (caption_column, "caption_column")):
        if column not in rows[0]:
            raise DataError(f"{path} has no column {column!r} (data.{key}): its columns are "
                            f"{', '.join(map(str, rows[0]))}; set data.{key}")
    for number, row in enumerate(rows, start=1):  # a JSONL row may lack a key the first has; a CSV / parquet cell be empty
        for column, key in ((image_column, "image_column"), (caption_column, "caption_column")):
            if row.get(column) in (None, ""):
                raise DataError(f"{path}: row {number} has no {column!r} (data.{key}): give every pair an image "
                                "path and a caption, or drop the row")
    images = [path.parent / str(row[image_column]) for row in rows]
    for image in images:
        if not image.is_file():
            raise DataError(f"{path}: the image {str(image)!r} does not exist: fix the path in column {image_column!r} "
                            "(relative to the table's folder)")
    return images, [str(row[caption_column]) for row in rows]


def pair_table(source: str) -> Path:
    """The table ``data.source`` names: a file, or the captions file of a folder."""
    path = Path(source)
    if path.is_dir():
        found = [path / name for name in CAPTION_FILES if (path / name).is_file()]
        if not found:
            raise DataError(f"data.source={source} is a folder without {' or '.join(CAPTION_FILES)}: add one "
                            "(columns: image path, caption)")
        return found[0]
    if not path.is_file():
        raise ConfigError(f"data.source={source} is neither {', '.join(PACKAGED)} nor a file or folder of image-text "
                          "pairs: fix the path")
    return path


class ImageTextDataModule(ImageSettingsDataModule):
    # The statistics an init_from source states that a run may change (as an image classifier's: docs/weights.md); its
    # image size and context are its position tables' lengths, which CLIP's weights do not resample.
    ADAPTABLE_FROM_SOURCE = ("mean", "std")

    @classmethod
    def settings_from_source(cls, source: WeightsSource, data: DictConfig, explicit: Sequence[str]) -> dict[str, Any]:
        """The source's image geometry, statistics (but those the command line set) and context, and its tokenizer
        (a CLIP's own: staged under ``data.cache_dir``, :func:`~trident.data.base.source_tokenizer_file`). The context
        of a trident run, which states its position table's length as the backbone's ``max_seq_len``, is the captions'
        ``data.max_length``."""
        options = dict(source.data_options)
        if "max_seq_len" in options:
            options["max_length"] = options.pop("max_seq_len")
        adapted = {f"data.{key}" for key in cls.ADAPTABLE_FROM_SOURCE} & set(explicit)
        fixed = {f"data.{key}": value for key, value in options.items() if key in data and f"data.{key}" not in adapted}
        return fixed | source_tokenizer_file(source, data, explicit)

    @classmethod
    def stage_source(cls, source: WeightsSource, data: DictConfig) -> None:
        """The source's tokenizer in the file ``data.tokenizer`` names."""
        stage_source_tokenizer(source, data)

    def __init__(
        self,
        source: str = "mnist_5k",
        data_dir: str | None = None,
        image_column: str = "image",
        caption_column: str = "caption",
        class_names: list[str] | None = None,
        templates: list[str] | None = None,
        zero_shot_classes: list[str] | None = None,
        name_source: str | None = None,
        name_source_size: int | None = None,
        name_source_frame: int | None = None,
        tokenizer: str | None = None,
        cache_dir: str | None = None,
        max_length: int = 16,
        image_size: int = 28,
        in_channels: int = 1,
        patch_size: int = 4,
        mean: list[float] | None = None,
        std: list[float] | None = None,
        validation_size: int = 500,
        test_size: int = 500,
        split_seed: int = 0,
        batch_size: int = 64,
        num_workers: int = 0,
        pin_memory: bool = False,
        persistent_workers: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__(image_size, in_channels, patch_size, mean, std, num_workers=num_workers, pin_memory=pin_memory,
                         persistent_workers=persistent_workers)
        self.source, self.data_dir = source, data_dir
        self.image_column, self.caption_column = image_column, caption_column
        self.class_names = list(class_names or [])
        self.templates = list(templates or ["{}"])
        self.zero_shot_classes = list(zero_shot_classes or [])
        self.name_source, self.name_source_size, self.name_source_frame = name_source, name_source_size, name_source_frame
        if any("{}" not in template for template in self.templates):
            raise ConfigError(f"data.templates={self.templates}: each template needs a {{}} for the class name")
        self.tokenizer_choice, self.max_length = tokenizer, max_length  # cache_dir: read from the config (staging)
        self.validation_size, self.test_size, self.split_seed = validation_size, test_size, split_seed
        self.batch_size, self.seed = batch_size, seed
        self.tokenizer: Tokenizer | None = None
        self.datasets: dict[str, PairDataset] = {}

    def prepare_data(self) -> None:
        """Nothing to fetch: packaged images, or files on disk."""

    def _source_options(self) -> dict[str, Any]:
        return {"data_dir": self.data_dir, "validation_size": self.validation_size, "test_size": self.test_size,
                "split_seed": self.split_seed, "image_size": self.image_size}

    def _name_images(self, classes: list[str]) -> tuple[np.ndarray, np.ndarray] | None:
        """``data.name_source``'s images (N, H, W) and labels (N,), every split of it (it is never evaluated), cut to
        ``data.name_source_size`` after one fixed shuffle; None without one. ``classes``: data.source's own class names,
        which the name source's must equal (its labels index data.class_names as data.source's do)."""
        if self.name_source is None:
            return None
        if self.name_source not in PACKAGED:
            raise ConfigError(f"data.name_source={self.name_source} is not a packaged source: choose one of "
                              f"{', '.join(PACKAGED)} other than data.source, or null")
        if self.name_source == self.source:
            raise ConfigError(f"data.name_source={self.name_source} is data.source: its validation and test images would "
                              "train; choose another packaged source (e.g. digits for mnist_5k), or null")
        frame = self.image_size if self.name_source_frame is None else self.name_source_frame
        if not 1 <= frame <= self.image_size:
            raise ConfigError(f"data.name_source_frame={frame}: give a side from 1 to data.image_size={self.image_size}, "
                              "or null to fill the image")
        data = load_image_source(self.name_source, self._source_options() | {"image_size": frame})
        if data.class_names != classes:  # the same count is not enough: digits captioned as Fashion-MNIST's clothes
            raise ConfigError(f"data.name_source={self.name_source}'s classes {data.class_names} are not data.source="
                              f"{self.source}'s {classes}: choose a name source of the same classes, in label order "
                              "(digits for mnist_5k), or data.name_source=null")
        parts = [data.splits[split] for split in SPLITS]  # packaged sources are arrays
        images, labels = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
        size = len(labels) if self.name_source_size is None else self.name_source_size
        if not 1 <= size <= len(labels):
            raise ConfigError(f"data.name_source_size={size}: give a count from 1 to the {len(labels)} images of "
                              f"data.name_source={self.name_source}, or null for all")
        keep = np.random.default_rng(self.split_seed).permutation(len(labels))[:size]
        return framed(images[keep], frame, self.image_size), labels[keep]

    def _packaged(self) -> dict[str, Pairs]:
        data = load_image_source(self.source, self._source_options())
        names = self.class_names or data.class_names
        if len(names) != len(data.class_names):
            raise ConfigError(f"data.class_names names {len(names)} classes; data.source={self.source} has "
                              f"{len(data.class_names)}: give one name a class, in label order")
        self.class_names = names
        unknown = [name for name in self.zero_shot_classes if name not in names]
        if unknown:
            raise ConfigError(f"data.zero_shot_classes names {unknown}, which are not classes of data.source="
                              f"{self.source}: choose among {', '.join(names)}")
        held_out = {names.index(name) for name in self.zero_shot_classes}
        named = self._name_images(data.class_names)
        pairs = {}
        for split in SPLITS:
            images, labels = data.splits[split]  # the packaged sources are arrays
            if split == "train":  # the held-out classes never train; the name source's images of every class do
                keep = ~np.isin(labels, list(held_out))
                images, labels = images[keep], labels[keep]
                if named is not None:
                    images, labels = np.concatenate([images, named[0]]), np.concatenate([labels, named[1]])
            dataset: Dataset[tuple[Tensor, int]]
            if images.shape[1:3] == (self.image_size, self.image_size):
                dataset = NormalizedArrays(images, labels, self.mean, self.std)
            else:
                dataset = ImageDataset((images, labels), eval_transform(self.image_size, self.mean, self.std),
                                       self.in_channels)
            captions = [self.templates[i % len(self.templates)].format(names[label]) for i, label in enumerate(labels)]
            pairs[split] = Pairs(dataset, captions, [int(label) for label in labels])
        return pairs

    def _from_table(self) -> dict[str, Pairs]:
        """The pairs of a table: no classes, so the class settings of a packaged source (the default's digits) do not
        apply and no zero-shot classification is measured."""
        self.class_names, self.zero_shot_classes = [], []
        if self.in_channels not in (1, 3):  # PairDataset converts each file to grey or RGB
            raise ConfigError(f"data.in_channels={self.in_channels}: the images of data.source={self.source} are read as "
                              "grey (1) or RGB (3) images: choose one")
        images, captions = read_pair_table(pair_table(self.source), self.image_column, self.caption_column)
        if self.validation_size + self.test_size >= len(captions):
            raise ConfigError(f"data.validation_size + data.test_size must be below the {len(captions)} pairs of "
                              f"{self.source}")
        order = np.random.default_rng(self.split_seed).permutation(len(captions)).tolist()
        cut = {"validation": order[: self.validation_size],
               "test": order[self.validation_size: self.validation_size + self.test_size],
               "train": order[self.validation_size + self.test_size:]}
        return {split: Pairs([images[i] for i in rows], [captions[i] for i in rows], [-1] * len(rows))
                for split, rows in cut.items()}

    def setup(self, stage: str | None = None) -> None:
        if self.datasets:
            return
        pairs = self._packaged() if self.source in PACKAGED else self._from_table()
        if self.tokenizer_choice is None:
            texts = [c for split in pairs.values() for c in split.captions] + self.class_names + self.templates
            self.tokenizer = word_tokenizer(texts)
        else:
            self.tokenizer = read_tokenizer(self.tokenizer_choice)
        self._check_names_train(pairs["train"].captions)
        transform = eval_transform(self.image_size, self.mean, self.std)
        for split, split_pairs in pairs.items():
            ids = caption_ids(self.tokenizer, split_pairs.captions, self.max_length)
            self.datasets[split] = PairDataset(split_pairs, ids, transform, self.in_channels)

    def _check_names_train(self, captions: list[str]) -> None:
        """Each zero-shot class's prompts (every template filled with its name, as zero-shot classification encodes
        them) are tokens some training caption holds, or one line naming the fix: else its word's embedding stays as
        initialised and its zero-shot accuracy at chance. The prompts, not the bare name: a template "{}s" trains
        "eights", never "eight". A tokenizer file (a pre-trained CLIP's) may have learnt the words before: a warning."""
        tokenizer = self.tokenizer
        assert tokenizer is not None
        trained = set(caption_ids(tokenizer, captions, self.max_length).unique().tolist())

        def prompt_tokens(name: str) -> set[int]:
            prompts = [template.format(name) for template in self.templates]
            return set(caption_ids(tokenizer, prompts, self.max_length).unique().tolist())

        untrained = [name for name in self.zero_shot_classes if not prompt_tokens(name) <= trained]
        if not untrained:
            return
        problem = (f"data.zero_shot_classes {untrained}: no training caption holds their names (data.name_source="
                   f"{self.name_source}), so the text tower never learns them")
        if self.tokenizer_choice is None:
            raise ConfigError(f"{problem} and their zero-shot accuracy stays at chance: set data.name_source=digits "
                              "(another source of the same classes trains their names), or data.zero_shot_classes=[]")
        log.warning("%s: unless the tokenizer's pre-trained text tower (init_from) knows them, their zero-shot accuracy "
                    "stays at chance", problem)

    def task_inputs(self) -> dict[str, Any]:
        assert self.tokenizer is not None, "call setup() before task_inputs()"
        return {
            "vocab_size": self.tokenizer.get_vocab_size(), "tokenizer_json": self.tokenizer.to_str(),
            "eos_id": end_of_text_id(self.tokenizer), "image_size": self.image_size, "in_channels": self.in_channels,
            "patch_size": self.patch_size, "mean": self.mean, "std": self.std, "class_names": self.class_names,
            "templates": self.templates, "zero_shot_classes": self.zero_shot_classes,
        }

    def save_to(self, run_dir: Path) -> None:
        assert self.tokenizer is not None, "call setup() before save_to()"
        self.tokenizer.save(str(run_dir / "tokenizer.json"))
        (run_dir / "classes.json").write_text(json.dumps(self.class_names))

    def split_loader(self, split: str, train: bool) -> DataLoader:
        dataset = self.datasets[split]
        order = EpochShuffleSampler(len(dataset), self.batch_size, self.seed, **self.shard()) if train else None
        # drop_last in training: every rank's batch equally long, as the gathered contrastive loss needs.
        return DataLoader(dataset, batch_size=self.batch_size, sampler=order, drop_last=train, **self.loader_options())
