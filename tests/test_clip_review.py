"""Review of task=clip (issue 54 items 2-3): what the first tests left open. A table whose later row lacks its
caption (a JSONL row without the key, a null or empty cell) is one line naming the row, not a KeyError or a caption
"None"; captions in a script without spaces (Chinese) are tokenized a character at a time, not one word a caption;
image files read as channels they cannot be converted to are one line; the hf export refuses an <|endoftext|> id of
2, which transformers pools as its legacy configs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trident.data.image_text import ImageTextDataModule
from trident.errors import DataError

from .test_clip import _images, _module


def _table(tmp_path: Path, captions: list[object], name: str = "pairs.jsonl") -> Path:
    images = _images(tmp_path / "images", len(captions))
    rows = [{"image": image} | ({} if caption is ... else {"caption": caption})
            for image, caption in zip(images, captions, strict=True)]
    table = tmp_path / name
    table.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return table


@pytest.mark.parametrize("caption", [..., None, ""], ids=["key_missing", "null", "empty"])
def test_a_later_row_without_its_caption_is_one_line(caption: object, tmp_path: Path) -> None:
    """The columns are checked on the first row; a JSONL row without the key was a KeyError, a null one the caption
    "None"."""
    table = _table(tmp_path, ["a grey square", "a lighter square", caption, "a white square", "a black square",
                              "a dark square"])
    with pytest.raises(DataError, match=r"pairs.jsonl: row 3 has no 'caption' \(data.caption_column\): give every "
                                        r"pair an image path and a caption, or drop the row"):
        _module(table).setup("fit")


def test_captions_without_spaces_are_tokenized_a_character_at_a_time(tmp_path: Path) -> None:
    """A Chinese caption was one word of the word-level tokenizer (its pre-tokenizer splits at spaces and
    punctuation): no two captions shared a token, and a caption with one character changed was one unseen word.
    Now each character is a token: captions share theirs, and the spaced words stay words."""
    captions = ["一张猫的照片", "一张狗的照片", "一只猫", "一只狗", "猫和狗", "a photo 的猫"]
    data = _module(_table(tmp_path, captions))
    data.setup("fit")
    tokenizer = data.tokenizer
    assert tokenizer is not None
    assert tokenizer.encode("一张猫的照片").tokens == ["一", "张", "猫", "的", "照", "片", "<|endoftext|>"]
    assert tokenizer.encode("A photo 的猫").tokens == ["a", "photo", "的", "猫", "<|endoftext|>"]
    unseen = tokenizer.encode("一张鸟的照片")  # 鸟 is in no caption: only it is unknown
    assert unseen.tokens == ["一", "张", "<unk>", "的", "照", "片", "<|endoftext|>"]


def test_an_end_of_text_id_of_2_is_refused_by_the_hf_export_in_one_line(tmp_path: Path) -> None:
    """transformers reads a CLIP config's ``eos_token_id=2`` as its legacy argmax pooling: a run whose tokenizer has
    ``<|endoftext|>`` at id 2 was exported as a CLIPModel pooled at each caption's largest id, other features."""
    from trident.errors import ConfigError
    from trident.weights.adapters.hf_export import write_hf

    from .test_convert_clip import trident_clip

    net = trident_clip()
    net.text.eos_id = 2
    with pytest.raises(ConfigError, match=r"^task.eos_id=2 has no CLIP \(hf export\) equivalent: a CLIPModel whose "
                                          r"eos_token_id is 2 pools at each row's largest id"):
        write_hf(net, None, None, tmp_path / "hf")


def test_image_files_read_as_channels_they_cannot_have_is_one_line(tmp_path: Path) -> None:
    """The files of a table are converted to grey or RGB: data.in_channels=4 gave three-channel images and a traceback
    in the normalisation of the first batch. Other sizes and channels than the data settings are converted."""
    from trident.errors import ConfigError

    table = _table(tmp_path, ["a", "b", "c", "d", "e", "f"])
    with pytest.raises(ConfigError, match=r"^data.in_channels=4: the images of data.source=.*pairs.jsonl are read as "
                                          r"grey \(1\) or RGB \(3\) images: choose one$"):
        _module(table, in_channels=4, mean=[0.5] * 4, std=[0.5] * 4).setup("fit")
    data = ImageTextDataModule(source=str(table), image_size=12, patch_size=4, in_channels=3, mean=[0.5] * 3,
                               std=[0.5] * 3, validation_size=2, test_size=2, batch_size=2)
    data.setup("fit")  # grey 8x8 files
    images, _, _ = next(iter(data.split_loader("train", train=True)))
    assert images.shape == (2, 3, 12, 12)
