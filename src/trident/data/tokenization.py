"""Tokenizers trained with Hugging Face ``tokenizers``: character level and byte-level BPE.

Both are plain ``tokenizers.Tokenizer`` objects, so one JSON string saves and restores either
(with the run directory and inside checkpoints).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from trident.data.progress import progress_track
from trident.errors import ConfigError, DataError

UNK = "<unk>"
END_OF_TEXT = "<|endoftext|>"
TOKENIZER_KINDS = ("char", "bpe")


def train_tokenizer(
    kind: str, texts: Iterable[str], *, vocab_size: int = 8192, length: int | None = None, end_of_text: bool = False
) -> Tokenizer:
    """``char``: one token per character seen in ``texts`` (plus ``<unk>``, and ``<|endoftext|>``
    last with ``end_of_text``); ``vocab_size`` is ignored. ``bpe``: byte-level BPE (GPT-2 style)
    with ``vocab_size`` tokens, ``<|endoftext|>`` among them; it never produces unknowns.
    ``texts`` may be an iterator (read once); ``length``, its number of items, sizes the progress bar."""
    if kind == "char":
        return _char_tokenizer(progress_track(texts, "Collecting characters", total=length), end_of_text)
    if kind == "bpe":
        if vocab_size < 257:
            raise ConfigError(f"data.vocab_size={vocab_size} is too small for byte-level BPE: use at least 257")
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[END_OF_TEXT],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=True,
        )
        tokenizer.train_from_iterator(texts, trainer=trainer, length=length)
        return tokenizer
    raise ConfigError(f"unknown data.tokenizer {kind!r}: choose one of {', '.join(TOKENIZER_KINDS)}")


def tokenizer_for(
    choice: str, texts: Iterable[str], *, vocab_size: int = 8192, length: int | None = None, end_of_text: bool = False
) -> Tokenizer:
    """``data.tokenizer``: ``char`` or ``bpe`` are trained on ``texts`` (:func:`train_tokenizer`); anything
    else is a tokenizer.json file or a Hugging Face tokenizer directory (one that holds tokenizer.json),
    used as it is and never retrained."""
    if choice in TOKENIZER_KINDS:
        return train_tokenizer(choice, texts, vocab_size=vocab_size, length=length, end_of_text=end_of_text)
    return read_tokenizer(choice)


def read_tokenizer(choice: str) -> Tokenizer:
    """The tokenizer of ``data.tokenizer=<tokenizer.json or a directory holding one>``."""
    path = tokenizer_file(choice)
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises plain Exception on a file that is not its JSON
        raise DataError(f"data.tokenizer={choice}: {str(path)!r} is not a Hugging Face tokenizer.json "
                        f"({str(err).splitlines()[0][:120]}): point data.tokenizer at another file") from err


def tokenizer_file(choice: str) -> Path:
    path = Path(choice)
    path = path / "tokenizer.json" if path.is_dir() else path
    if not path.is_file():
        raise ConfigError(
            f"data.tokenizer={choice} is neither one of {', '.join(TOKENIZER_KINDS)} nor a tokenizer.json file or a "
            "directory holding one: fix the path, or choose data.tokenizer=bpe"
        )
    return path


def tokenizer_key(choice: str) -> str:
    """What a prepared-data cache depends on: the kind to train, or a tokenizer file's content."""
    if choice in TOKENIZER_KINDS:
        return choice
    return hashlib.sha256(tokenizer_file(choice).read_bytes()).hexdigest()


def _char_tokenizer(texts: Iterable[str], end_of_text: bool) -> Tokenizer:
    alphabet: set[str] = set()
    for text in texts:
        alphabet.update(text)
    vocab = {UNK: 0} | {char: i + 1 for i, char in enumerate(sorted(alphabet))}
    if end_of_text:  # a vocabulary entry of its own (never produced from text), after the characters
        vocab[END_OF_TEXT] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = every_character()
    tokenizer.decoder = decoders.Fuse()  # join characters back without separators
    return tokenizer


def every_character() -> pre_tokenizers.PreTokenizer:
    """The character tokenizer's pre-tokenizer: each character (code point) a word of its own."""
    return pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")


def decode(tokenizer: Tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False)


def plain_encoder(tokenizer: Tokenizer) -> Tokenizer:
    """A copy of ``tokenizer`` that encodes text as the training data is encoded: without the file's truncation
    and padding (a ``tokenizer.json`` may turn both on); call its ``encode`` with ``add_special_tokens=False``
    (:func:`encode_plain`), so no post-processor wraps a text in ``<s> ... </s>`` or ``[CLS] ... [SEP]``."""
    copy = Tokenizer.from_str(tokenizer.to_str())
    copy.no_truncation()
    copy.no_padding()
    return copy


def encode_plain(tokenizer: Tokenizer, text: str) -> list[int]:
    """The ids of ``text`` as a prompt continuing training text: :func:`plain_encoder`'s, without special tokens."""
    return plain_encoder(tokenizer).encode(text, add_special_tokens=False).ids
