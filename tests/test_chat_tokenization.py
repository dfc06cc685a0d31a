"""data=chat tokenizes a conversation as transformers' ``apply_chat_template(tokenize=True)`` does (issue 50):
the rendered text encoded once, for byte-level, Metaspace (SentencePiece-style: Llama 2, Mistral v0.1,
TinyLlama) and WordPiece tokenizers and the Llama 2, Mistral, Zephyr, ChatML, Llama 3 and Qwen templates,
with the answer mask from the tokens' character offsets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from trident.data.chat import IGNORE_INDEX, PADDING, ChatDataModule
from trident.data.chat_template import ChatTemplate, encode_conversation, read_template
from trident.data.tokenization import plain_encoder, read_tokenizer

from .chat_templates import SPECIAL_TOKENS, TEMPLATES

CONVERSATION = [
    {"role": "system", "content": "Speak briefly."},
    {"role": "user", "content": "Who is there?"},
    {"role": "assistant", "content": "Nay, answer me: stand and unfold yourself."},
    {"role": "user", "content": "Long live the king!"},
    {"role": "assistant", "content": "Bernardo? He."},
]
KINDS = ("byte_level", "metaspace", "sentencepiece_normalizer", "wordpiece")


def conversation_for(name: str) -> list[dict[str, str]]:
    return CONVERSATION[1:] if name == "mistral" else CONVERSATION  # Mistral's template refuses a system turn


def trained_tokenizer(kind: str) -> Tokenizer:
    """A small tokenizer of ``kind`` trained on every template's rendering (merges across the templates' joints
    included, where a piece-by-piece encoding would differ), with the templates' special tokens."""
    texts = [ChatTemplate(name, text, {"bos_token": bos or "", "eos_token": eos}).render(conversation_for(name))
             for name, (text, bos, eos) in TEMPLATES.items()] * 5
    if kind == "wordpiece":
        tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tokenizer.normalizer = normalizers.BertNormalizer(lowercase=False)
        tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tokenizer.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(vocab_size=400, special_tokens=["[UNK]", "[CLS]", "[SEP]", *SPECIAL_TOKENS],
                                            show_progress=False)
    else:
        tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
        if kind == "byte_level":
            tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            tokenizer.decoder = decoders.ByteLevel()
        elif kind == "metaspace":  # TinyLlama / tokenizers >= 0.14 style
            tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
            tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
        else:  # Llama 2's and Mistral v0.1's tokenizer.json: a normalizer writes the word starts, no pre-tokenizer
            tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
            tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
            # Trained word by word, as SentencePiece trains (no piece holds a word start inside it); read without one.
            tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL_TOKENS, show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    if kind == "sentencepiece_normalizer":
        tokenizer = Tokenizer.from_str(json.dumps(json.loads(tokenizer.to_str()) | {"pre_tokenizer": None}))
    if kind == "wordpiece":  # a post-processor that wraps a text: encoding the conversation must leave it out
        tokenizer.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", special_tokens=[("[CLS]", tokenizer.token_to_id("[CLS]")),
                                                     ("[SEP]", tokenizer.token_to_id("[SEP]"))])
    else:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))])
    return tokenizer


def saved_directory(kind: str, name: str, path: Path) -> Path:
    """A Hugging Face tokenizer directory (transformers' save_pretrained) with ``name``'s template."""
    import transformers

    text, bos, eos = TEMPLATES[name]
    unk = "[UNK]" if kind == "wordpiece" else "<unk>"
    specials = {"bos_token": bos} if bos else {}
    transformers.PreTrainedTokenizerFast(tokenizer_object=trained_tokenizer(kind), unk_token=unk, eos_token=eos,
                                         chat_template=text, **specials).save_pretrained(path)
    return path


def reference_ids(directory: Path, conversation: list[dict[str, str]]) -> list[int]:
    import transformers

    loaded = transformers.AutoTokenizer.from_pretrained(directory)
    return list(loaded.apply_chat_template(conversation, tokenize=True, return_dict=True)["input_ids"])


def squeezed(text: str) -> str:
    return "".join(text.split())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(TEMPLATES))
def test_a_conversation_tokenizes_as_transformers_apply_chat_template(kind: str, name: str, tmp_path: Path) -> None:
    directory = saved_directory(kind, name, tmp_path)
    conversation = conversation_for(name)
    ids, trained = encode_conversation(plain_encoder(read_tokenizer(str(directory))), read_template(str(directory), "bpe"),
                                       conversation)
    assert ids == reference_ids(directory, conversation)
    # The trained tokens are the answers (and their end markers), nothing else of the prompts than a token that
    # straddles the joint (Mistral's "[/INST]Nay" may be one token: transformers' assistant mask trains it too).
    tokenizer = read_tokenizer(str(directory))
    runs: list[list[int]] = []
    for i, flag in enumerate(trained):
        if flag:
            runs.append([ids[i]]) if i == 0 or not trained[i - 1] else runs[-1].append(ids[i])
    answers = [m["content"] for m in conversation if m["role"] == "assistant"]
    assert len(runs) == len(answers)
    for run, answer in zip(runs, answers, strict=True):
        text, rest = (squeezed(tokenizer.decode(r, skip_special_tokens=True)) for r in (run, run[1:]))
        assert squeezed(answer) in text and len(rest) < len(squeezed(answer)), (text, answer)


def test_the_data_module_packs_the_ids_of_apply_chat_template(tmp_path: Path) -> None:
    """Through the data module: a Mistral v0.1-style directory as data.tokenizer, its template read with it."""
    directory = saved_directory("sentencepiece_normalizer", "mistral", tmp_path / "mistral")
    conversations = [[{"role": "user", "content": f"Who is there, {i}?"},
                      {"role": "assistant", "content": f"Nay, answer me {i} times."}] for i in range(20)]
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    data = ChatDataModule(source="files", files=str(chats), tokenizer=str(directory), block_size=64,
                          cache_dir=str(tmp_path / "cache"))
    data.prepare_data()
    data.setup()
    expected = {tuple(reference_ids(directory, c)) for c in conversations}
    rows = data.rows["train"]
    for ids, documents in zip(rows["ids"], rows["documents"], strict=True):
        for document in set(documents.tolist()) - {PADDING}:
            assert tuple(ids[documents == document].tolist()) in expected
    assert (rows["targets"] != IGNORE_INDEX).any()


def test_templates_render_with_transformers_globals_and_generation_blocks(tmp_path: Path) -> None:
    """Llama 3.1's ``strftime_now`` and ``tools is none``, SmolLM3's ``{% generation %}`` answers, tojson's options."""
    template = ("{{ strftime_now('%Y') }}{% if tools is none %}[no tools]{% endif %}{{ {'b': 1, 'a': 'é'} | tojson(sort_keys=True) }}"
                "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}.{% endgeneration %}"
                "{% else %}{{ m['content'] }}:{% endif %}{% endfor %}")
    directory = saved_directory("byte_level", "chatml", tmp_path)
    import transformers

    reference = transformers.AutoTokenizer.from_pretrained(directory)
    conversation = CONVERSATION[1:3]
    ours = ChatTemplate("t", template, {}).render(conversation)
    assert ours == reference.apply_chat_template(conversation, chat_template=template, tokenize=False)
    assert ours.endswith('[no tools]{"a": "é", "b": 1}Who is there?:Nay, answer me: stand and unfold yourself..')


@pytest.mark.parametrize("kind", ["metaspace", "sentencepiece_normalizer"])
@pytest.mark.parametrize("name", ["zephyr", "default"])
def test_trident_chat_feeds_each_turn_as_the_whole_conversation_encodes(kind: str, name: str) -> None:
    """A later turn's tokens in the cache are those of the whole conversation encoded at once (as in training),
    not of the new text encoded alone (a SentencePiece-style tokenizer starts a piece with a word start)."""
    import torch

    from trident.commands.chat import Chat
    from trident.tasks.lm import LanguageModelTask

    tokenizer = trained_tokenizer(kind)
    backbone = {"d_model": 16, "n_heads": 2, "n_layers": 1, "d_ff": 32, "dropout": 0.0, "max_seq_len": 256}
    torch.manual_seed(0)
    task = LanguageModelTask(backbone, vocab_size=tokenizer.get_vocab_size(), optimizer={}, scheduler={},
                             tokenizer_json=tokenizer.to_str()).eval()
    text, bos, eos = TEMPLATES[name] if name in TEMPLATES else (read_template("default", "char").text, None, None)
    template = ChatTemplate(name, text, {"bos_token": bos or "", "eos_token": eos or ""})
    session = Chat(task, template, max_new_tokens=3, temperature=0.0, top_k=None, top_p=None, seed=0)
    fed: list[int] = []
    feed, restart = session._feed, session._restart

    def recorded_feed(ids: list[int]) -> torch.Tensor:
        fed.extend(ids)
        return feed(ids)

    session._feed = recorded_feed  # type: ignore[method-assign]
    session._restart = lambda: (fed.clear(), restart())  # type: ignore[method-assign]
    for turn in ("Who is there?", "Long live the king!"):
        session.reply(turn, lambda piece: None)
        prompt = template.render(session.messages[:-1], add_generation_prompt=True)
        expected = plain_encoder(tokenizer).encode(prompt, add_special_tokens=False).ids
        assert fed[: len(expected)] == expected


def test_an_older_directory_names_its_special_tokens_in_special_tokens_map(tmp_path: Path) -> None:
    """transformers reads ``special_tokens_map.json`` where ``tokenizer_config.json`` has no added_tokens_decoder."""
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATES["llama2"][0]}))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
    template = read_template(str(tmp_path), "bpe")
    assert template.render(CONVERSATION[1:3]) == "<s>[INST] Who is there? [/INST] Nay, answer me: stand and unfold yourself. </s>"
