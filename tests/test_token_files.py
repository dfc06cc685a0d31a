"""Outside tokenizer.json files on LM / MLM corpora: the ids of ``tokenizers``' own encode for every
model, normalizer, pre-tokenizer and post-processor; the character fast path only where it is exact."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

from trident.data import streams, token_files
from trident.data.lm import LMDataModule
from trident.data.token_files import Encoder, check_informative
from trident.data.tokenization import END_OF_TEXT, train_tokenizer
from trident.errors import DataError

# Upper and lower case, punctuation, line breaks, a tab, accents (composed and combining), an emoji
# and characters no vocabulary below has.
TEXT = "Hello World, the naïve CAFÉ sells 3 cakes!\nzebra\tdances e\u0301 🙂 ☃ 漢字\n\nThe end.\n"
WORDS = ["hello", "world", "the", "naive", "cafe", "sells", "cakes", "dances", "end", "zebra"]
CORPUS = [TEXT, "the cafe sells cakes to the zebra\n", "hello hello world\n"] * 20


def word_level_whitespace() -> Tokenizer:
    """A word per vocabulary entry, split at whitespace and punctuation: ``encode`` gives whole words."""
    words = ["Hello", "World", ",", "!", "The", ".", "Document", "line", ":", "to", *WORDS, *"0123456789"]
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return tokenizer


def word_level_lowercase() -> Tokenizer:
    """The issue's case: padding first, a lowercasing normalizer (the old fast path made every id 0)."""
    vocab = {"[PAD]": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.Sequence([normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase()])
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return tokenizer


def word_level_single_characters() -> Tokenizer:
    """Single characters as words, but split at whitespace: "ab" is one unknown word, not a, b."""
    vocab = {"<unk>": 0, **{c: i + 1 for i, c in enumerate(sorted(set("helo wrd")))}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return tokenizer


def bert_word_piece() -> Tokenizer:
    """BERT's pipeline: BertNormalizer, BertPreTokenizer, WordPiece, [CLS] $A [SEP], and truncation on."""
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    pieces = sorted(set("abcdefghijklmnopqrstuvwxyz.,!")) + ["##" + c for c in "abcdefghijklmnopqrstuvwxyz"]
    vocab = {token: i for i, token in enumerate(specials + WORDS + ["##s", "sell"] + pieces)}
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    tokenizer.enable_truncation(max_length=8)  # as Hub files often say (512): a corpus is never cut to it
    return tokenizer


def byte_level_bpe() -> Tokenizer:
    """GPT-2 style, as trident trains it (``<|endoftext|>`` in the vocabulary), with merges of line
    breaks and the spaces around them."""
    texts = CORPUS + documents(5)
    return train_tokenizer("bpe", iter(texts), vocab_size=400, length=len(texts))


def roberta_bpe() -> Tokenizer:
    """Byte-level BPE with RoBERTa's post-processor (<s> $A </s>) and no <|endoftext|>."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "<pad>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    tokenizer.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    return tokenizer


def unigram() -> Tokenizer:
    """SentencePiece style: NFKC, Metaspace, a Unigram model trained here, </s> after each text."""
    tokenizer = Tokenizer(models.Unigram())
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=60, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>",
                                      show_progress=False)
    tokenizer.train_from_iterator([t.replace("漢字", "") for t in CORPUS], trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return tokenizer


def trident_characters() -> Tokenizer:
    """trident's own character tokenizer, trained without ☃, 漢, 字 or the tab."""
    return train_tokenizer("char", [TEXT.replace("☃", "").replace("漢字", "").replace("\t", " ")], end_of_text=True)


def split_characters_then_lowercase() -> Tokenizer:
    """trident's character pipeline plus a lowercasing normalizer: not the fast path's case."""
    tokenizer = trident_characters()
    tokenizer.normalizer = normalizers.Lowercase()
    return tokenizer


def isolated_letters_only() -> Tokenizer:
    """Character vocabulary, but a pre-tokenizer that isolates letters only (digits run together)."""
    tokenizer = trident_characters()
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"\p{L}"), behavior="isolated")
    return tokenizer


def documents(count: int, first: int = 0) -> list[str]:
    """Documents of 24 lines (~750 characters), several pieces each at the test's piece size, with
    trailing spaces and indented lines (GPT-2's BPE joins those spaces to the line break)."""
    lines = ["Document {d} line {i}: the cafe sells cakes \n", "    to the zebra.\n", "The end {i}.\n"]
    return ["".join(lines[i % 3].format(d=d, i=i) for i in range(24)) for d in range(first, first + count)]


def trident_characters_without_end() -> Tokenizer:
    """trident's character tokenizer of a packaged corpus (no <|endoftext|>), as an LM run keeps it."""
    return train_tokenizer("char", documents(5))


def bert_without_post_processor() -> Tokenizer:
    tokenizer = bert_word_piece()
    tokenizer.post_processor = None
    return tokenizer


def untruncated(tokenizer: Tokenizer) -> Tokenizer:
    copy = Tokenizer.from_str(tokenizer.to_str())
    copy.no_truncation()
    return copy


BUILDERS: dict[str, Callable[[], Tokenizer]] = {
    "word-level whitespace": word_level_whitespace,
    "word-level lowercase": word_level_lowercase,
    "word-level single characters": word_level_single_characters,
    "bert word-piece": bert_word_piece,
    "byte-level bpe": byte_level_bpe,
    "roberta bpe": roberta_bpe,
    "unigram": unigram,
    "trident characters": trident_characters,
    "trident characters without end": trident_characters_without_end,
    "bert without post-processor": bert_without_post_processor,
    "characters lowercased": split_characters_then_lowercase,
    "letters isolated": isolated_letters_only,
}


@pytest.mark.parametrize("name", BUILDERS)
def test_every_tokenizer_gives_the_ids_of_its_own_encode(name: str) -> None:
    tokenizer = BUILDERS[name]()
    texts = [TEXT, "e\u0301 🙂\r\n", "", "ab 12 cafe\n"]
    encoder = Encoder(tokenizer, separator=None)
    expected = [i for text in texts for i in untruncated(tokenizer).encode(text, add_special_tokens=False).ids]
    assert encoder([(text, False) for text in texts]).tolist() == expected
    assert len(expected) > 8  # longer than the truncation some files carry: the corpus is never cut
    # The numpy table is trident's character tokenizer only, where it is exact.
    assert (encoder.char_table is not None) == name.startswith("trident characters")


def test_the_character_fast_path_is_exact_on_unknown_and_astral_characters() -> None:
    tokenizer = trident_characters()
    text = "☃\t漢字 e\u0301🙂\n\r\n🚀" + TEXT  # 🚀: past the largest code point the tokenizer knows (🙂)
    ids = Encoder(tokenizer, separator=None)([(text, False)])
    assert ids.tolist() == tokenizer.encode(text).ids
    unknown = sum(char not in tokenizer.get_vocab() for char in text)  # ☃, 漢, 字, the tab, \r, 🚀; some twice
    assert unknown == 10 and ids.tolist().count(tokenizer.token_to_id("<unk>")) == unknown


SEPARATORS = {  # tokenizer -> what must end each document
    "bert word-piece": "[SEP]",  # the post-processor's closing token ([CLS] $A [SEP])
    "bert without post-processor": "[SEP]",  # a vocab.txt tokenizer built without one
    "roberta bpe": "</s>",  # <s> $A </s>
    "unigram": "</s>",  # $A </s>
    "byte-level bpe": END_OF_TEXT,  # the vocabulary has it
    "word-level whitespace": END_OF_TEXT,  # nothing to use: added to the tokenizer
    "trident characters without end": "\n\n",  # a blank line: the vocabulary stays as weights know it
}
WHOLE_DOCUMENT_IDS = {"bert word-piece", "byte-level bpe", "word-level whitespace", "trident characters without end"}


@pytest.mark.parametrize("name", SEPARATORS)
def test_documents_not_pieces_get_special_tokens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture, name: str) -> None:
    # Pieces of 100 characters, not 256 K: each document is cut into about eight.
    monkeypatch.setattr(streams, "text_file_pieces", partial(streams.text_file_pieces, chunk_chars=100))
    given = BUILDERS[name]()
    given.save(str(tmp_path / "tokenizer.json"))
    splits = {"train": documents(3), "validation": documents(1, 3), "test": documents(1, 4)}
    files: dict[str, list[str]] = {}
    for split, docs in splits.items():
        files[split] = []
        for i, doc in enumerate(docs):
            (tmp_path / f"{split}{i}.txt").write_text(doc)
            files[split].append(str(tmp_path / f"{split}{i}.txt"))
    module = LMDataModule(source="files", files=files, tokenizer=str(tmp_path / "tokenizer.json"), block_size=4,
                          batch_size=2, cache_dir=str(tmp_path / "cache"))
    with caplog.at_level("INFO"):
        module.prepare_data()
    module.setup()
    tokenizer = module.tokenizer
    assert tokenizer is not None
    wanted = SEPARATORS[name]
    separator = given.encode(wanted).ids if wanted == "\n\n" else [tokenizer.token_to_id(wanted)]
    closing = given.encode("a")
    specials = {i for i, seq in zip(closing.ids, closing.sequence_ids) if seq is None} | {*separator}
    for split, docs in splits.items():
        ids = module.splits[split].tolist()
        if name in WHOLE_DOCUMENT_IDS:  # pieces cut at line breaks: the whole document's own ids
            whole = untruncated(given)
            assert ids == [i for doc in docs for i in whole.encode(doc, add_special_tokens=False).ids + separator]
        # Exactly one separator after each document, and no special token inside one.
        ends = [i for i, token in enumerate(ids) if token in specials]
        assert ends[-1] == len(ids) - 1
        assert len(ends) == len(docs) or wanted == "\n\n"
    said = "a blank line" if wanted == "\n\n" else wanted
    assert f"each document ends in {said} (ids {separator}" in caplog.text


@pytest.mark.parametrize("broken", ["the old fast path", "padding everywhere"])
def test_a_split_of_mostly_unknown_or_padding_ids_stops_naming_the_tokenizer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, broken: str) -> None:
    # The guard itself, whatever the cause: the case (any word-level file down the character
    # path, its lowercasing normalizer ignored), and an encoder that gives the padding id everywhere.
    monkeypatch.setattr(token_files, "is_character_tokenizer", lambda t: isinstance(t.model, models.WordLevel))
    if broken == "padding everywhere":
        monkeypatch.setattr(Encoder, "_chars", lambda self, text: np.zeros(len(text), dtype=self.dtype))
    word_level_lowercase().save(str(tmp_path / "words.json"))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"The zebra sells cakes to the Cafe, line {i}.\n" for i in range(300)))
    module = LMDataModule(source="files", files=str(corpus), tokenizer=str(tmp_path / "words.json"), block_size=4,
                          batch_size=2, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DataError, match=r"the train split is 100% unknown or padding ids .* data.tokenizer=\S*words.json"):
        module.prepare_data()


def test_the_guard_stops_a_split_more_than_half_unknown_or_padding() -> None:
    check_informative("validation", 1000, 500, "words.json")  # half passes: real text is far below
    with pytest.raises(DataError, match=r"the validation split is 50% unknown or padding ids \(501 of 1,000\) with "
                                        r"data.tokenizer=words.json: that tokenizer does not read this text") as caught:
        check_informative("validation", 1000, 501, "words.json")
    assert "\n" not in str(caught.value)


def test_the_separator_is_the_last_special_the_post_processor_puts_after_a_text() -> None:
    """A template that closes a text with two specials ("$A [SEP] </s>"): documents end in the last one,
    the token that ends the text, not the one between; none after a text: no closing special."""
    vocabulary = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "</s>": 3, "a": 4}
    tokenizer = Tokenizer(models.WordLevel(vocabulary, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    assert token_files.closing_special(tokenizer) is None
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP] </s>", special_tokens=[("[CLS]", 1), ("[SEP]", 2), ("</s>", 3)])
    assert token_files.closing_special(tokenizer) == "</s>"
    assert token_files.end_of_document(tokenizer) == [3]
