"""The tokenizer of translation data: one byte-level BPE trained on both languages, or a given
``tokenizer.json`` used as it is; either way it has the special tokens the task needs."""

from __future__ import annotations

from collections.abc import Iterator

import datasets
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from trident.data.special_tokens import SEQ_END_TOKEN, SEQ_PAD_TOKEN, SEQ_START_TOKEN
from trident.data.tokenization import TOKENIZER_KINDS, read_tokenizer
from trident.errors import ConfigError, DataError

# Special tokens every translation tokenizer has: ids 0, 1, 2 in a trained one, any ids in a given one.
PAD, BOS, EOS = SEQ_PAD_TOKEN, SEQ_START_TOKEN, SEQ_END_TOKEN
TRAINED_TOKENIZER = "bpe"  # data.tokenizer: train a shared BPE; anything else names a tokenizer file


def train_shared_bpe(texts: datasets.Dataset, vocab_size: int) -> Tokenizer:
    """One byte-level BPE for source and target (what makes three-way weight tying possible),
    trained on both sides of the training split; PAD, BOS, EOS get ids 0, 1, 2."""
    if vocab_size < 260:
        raise ConfigError(f"data.vocab_size={vocab_size} is too small for byte-level BPE: use at least 260")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()  # one code point sequence for each accented letter
    # A prefix space makes a sentence's first word tokenize like the same word mid-sentence.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )

    def both_sides() -> Iterator[str]:
        for start in range(0, len(texts), 1000):
            chunk = texts[start : start + 1000]
            yield from chunk["src"]
            yield from chunk["tgt"]

    tokenizer.train_from_iterator(both_sides(), trainer=trainer, length=2 * len(texts))
    return tokenizer


def special_id(tokenizer: Tokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise DataError(f"the tokenizer has no {token} token: it was not trained by trident's translation data")
    return token_id


def given_tokenizer(choice: str, decoder_start: str = BOS) -> Tokenizer:
    """The tokenizer of ``data.tokenizer=<tokenizer.json or a directory holding one>``, as it is;
    one line when it lacks a special token that translation needs (the decoder's first, ``decoder_start``: <s>, or
    a T5 tokenizer's <pad>)."""
    if choice in TOKENIZER_KINDS:
        raise ConfigError(f"data.tokenizer={choice} is not a translation tokenizer: choose {TRAINED_TOKENIZER} (one BPE "
                          "trained on both languages) or a tokenizer.json file")
    tokenizer = read_tokenizer(choice)
    needed = dict.fromkeys((PAD, decoder_start, EOS))
    for token in needed:
        if tokenizer.token_to_id(token) is None:
            raise DataError(f"data.tokenizer={choice} has no {token} token, which translation needs ({', '.join(needed)}): "
                            f"add it to the tokenizer, or use data.tokenizer={TRAINED_TOKENIZER}")
    return tokenizer
