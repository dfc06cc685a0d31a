"""data=chat beside transformers' apply_chat_template on what a review found (issue 50): templates that render a
conversation's last answer unlike an earlier one, message fields beside role and content, ``{% generation %}``
answer blocks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trident.data.chat_template import read_conversations
from trident.errors import DataError

from .test_chat_data import prepared

# Renders the last answer with a reasoning block it leaves out of an earlier one (as Qwen3's template does), and reads
# each message's name.
LAST_ANSWER_APART = (
    "{% for m in messages %}{% if m.role == 'assistant' and loop.last %}<a><think>{{ m.reasoning_content }}</think>"
    "{{ m.content }}</a>{% elif m.role == 'assistant' %}<a>{{ m.content }}</a>{% else %}<u {{ m.name }}>{{ m.content }}"
    "</u>{% endif %}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
)


def chat_files(path: Path, rows: list[list[dict[str, str]]], template: str) -> dict[str, str]:
    (path / "chats.jsonl").write_text("".join(json.dumps({"messages": row}) + "\n" for row in rows))
    (path / "template.jinja").write_text(template)
    return {"files": str(path / "chats.jsonl"), "template": str(path / "template.jinja")}


def test_a_conversation_the_template_does_not_render_as_its_answers_continuation_is_refused(tmp_path: Path) -> None:
    """A turn after the last answer with such a template: the pieces would not add up to the rendered conversation
    (the trailing turn was lost and the answer trained as the template never writes it there)."""
    rows = [[{"role": "user", "content": f"Hi {i}"}, {"role": "assistant", "content": "Yo."},
             {"role": "user", "content": "Bye."}] for i in range(20)]
    with pytest.raises(DataError, match="does not render a conversation as the start of its continuation") as raised:
        prepared(tmp_path, **chat_files(tmp_path, rows, LAST_ANSWER_APART), block_size=256)
    assert "\n" not in str(raised.value)


def test_a_template_reads_every_field_of_a_message_as_apply_chat_template_passes_it(tmp_path: Path) -> None:
    import transformers

    rows = [[{"role": "user", "content": f"Who is there, {i}?", "name": "horatio"},
             {"role": "assistant", "content": "Me.", "reasoning_content": "It is late."}] for i in range(20)]
    data = prepared(tmp_path, **chat_files(tmp_path, rows, LAST_ANSWER_APART), block_size=256)
    assert data.tokenizer is not None
    reference = transformers.PreTrainedTokenizerFast(tokenizer_object=data.tokenizer)
    expected = reference.apply_chat_template(rows[0], chat_template=LAST_ANSWER_APART, tokenize=False)
    assert expected == "<u horatio>Who is there, 0?</u><a><think>It is late.</think>Me.</a>"
    assert data.template.render(read_conversations(tmp_path / "chats.jsonl")[0]) == expected
    trained = data.tokenizer.decode(data.rows["train"]["ids"].ravel().tolist())
    assert trained.count("<u horatio>") == trained.count("<think>It is late.</think>Me.</a>") > 0


# ChatML with its answers in generation blocks (as TRL's training templates write them): the newline after <|im_end|>
# is outside the block, so transformers' assistant mask leaves it untrained.
GENERATION_CHATML = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_generation_blocks_train_what_transformers_assistant_masks_train(tmp_path: Path) -> None:
    """Chinese and Japanese turns through a byte-level BPE (a character spans several tokens, a token may straddle a
    joint): the trained tokens of every answer are apply_chat_template's assistant_masks, turn by turn."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from trident.data.chat import IGNORE_INDEX, PADDING

    rows = [[{"role": "system", "content": "简短回答。"}, {"role": "user", "content": f"你是谁？{i}"},
             {"role": "assistant", "content": "我是一个助手，名字叫小明。"},
             {"role": "user", "content": "日本語で話してください"}, {"role": "assistant", "content": f"はい、わかりました{i}。"}]
            for i in range(20)]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|im_start|>", "<|im_end|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["你是谁我是一个助手名字叫小明日本語で話してくださいはいわかりました"] * 3, trainer)
    directory = tmp_path / "tokenizer"
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>",
                                         chat_template=GENERATION_CHATML).save_pretrained(directory)
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps({"messages": row}, ensure_ascii=False) + "\n" for row in rows))
    data = prepared(tmp_path, files=str(tmp_path / "chats.jsonl"), tokenizer=str(directory), block_size=256)
    reference = transformers.AutoTokenizer.from_pretrained(directory)
    expected = {}
    for row in rows:
        out = reference.apply_chat_template(row, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        expected[tuple(out["input_ids"])] = [bool(m) for m in out["assistant_masks"]]
    seen = 0
    for ids, targets, documents in zip(*(data.rows["train"][k] for k in ("ids", "targets", "documents")), strict=True):
        for document in set(documents.tolist()) - {PADDING}:
            mask = expected[tuple(ids[documents == document].tolist())]
            assert (targets[documents == document][:-1] != IGNORE_INDEX).tolist() == mask[1:]
            seen += 1
    assert seen > 0


def test_init_from_an_older_directory_reads_its_special_tokens_from_special_tokens_map(tmp_path: Path) -> None:
    """A source directory whose tokenizer_config.json has no added_tokens_decoder: transformers takes the special
    tokens of its special_tokens_map.json, and so does what init_from records (and the export writes)."""
    import transformers

    from tests.test_convert_llama_family import bpe_tokenizer, hf_model
    from trident.weights import read_pretrained

    tokenizer = bpe_tokenizer()
    hf_model("llama", tmp_path, vocab_size=tokenizer.get_vocab_size())
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ bos_token }}{{ messages[0].content }}",
                                                                "eos_token": "<unk>"}))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path)
    settings = read_pretrained(tmp_path).tokenizer_settings
    assert (settings["bos_token"], settings["eos_token"]) == (reference.bos_token, reference.eos_token) == ("<s>", "</s>")


def test_a_gzip_compressed_chat_file_is_read_and_a_file_not_utf8_is_one_line(tmp_path: Path) -> None:
    """docs/data.md: JSON lines files may be gzip-compressed; data=chat read them as UTF-8 text (a traceback)."""
    import gzip

    rows = [{"messages": [{"role": "user", "content": f"Who is there, {i}?"}, {"role": "assistant", "content": "Me."}]}
            for i in range(20)]
    with gzip.open(tmp_path / "chats.jsonl.gz", "wt", encoding="utf-8") as handle:
        handle.write("".join(json.dumps(row) + "\n" for row in rows))
    data = prepared(tmp_path, files=str(tmp_path / "chats.jsonl.gz"), block_size=64)
    assert sum(data.token_counts().values()) == 20 * len("Me.\n\n")
    (tmp_path / "latin1.jsonl").write_bytes(json.dumps(rows[0], ensure_ascii=False).replace("Me.", "Né.").encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1.jsonl is not UTF-8 text .*: save it as UTF-8$"):
        prepared(tmp_path, files=str(tmp_path / "latin1.jsonl"))


def test_a_template_file_reads_the_special_tokens_of_the_tokenizer_directory(tmp_path: Path) -> None:
    """data.template=<file.jinja> with data.tokenizer=<directory>: the answers end in the tokenizer's eos_token, as
    apply_chat_template(chat_template=...) renders them (the template's eos_token rendered empty before: no answer
    trained its end)."""
    import transformers

    from .test_chat_tokenization import saved_directory

    directory = saved_directory("byte_level", "chatml", tmp_path / "tokenizer")
    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}{% if m.role == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
    rows = [[{"role": "user", "content": f"Who is there, {i}?"}, {"role": "assistant", "content": "Nay, answer me."}]
            for i in range(20)]
    options = chat_files(tmp_path, rows, template)
    data = prepared(tmp_path, **options, tokenizer=str(directory), block_size=256)
    reference = transformers.AutoTokenizer.from_pretrained(directory)
    expected = reference.apply_chat_template(rows[0], chat_template=template, tokenize=True, return_dict=True)["input_ids"]
    assert expected[-1] == reference.convert_tokens_to_ids("<|im_end|>")
    packed = data.rows["train"]["ids"].ravel().tolist()
    assert any(packed[i : i + len(expected)] == list(expected) for i in range(len(packed)))


def test_trident_chat_renders_a_template_file_with_the_runs_tokenizer_special_tokens(tmp_path: Path,
                                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """trident-chat --template <file.jinja> on a run whose data.tokenizer is a directory: its eos_token, as in training."""
    from trident.commands import chat

    from .test_chat_tokenization import saved_directory

    directory = saved_directory("byte_level", "chatml", tmp_path / "tokenizer")
    (tmp_path / "config.yaml").write_text(json.dumps({"data": {"tokenizer": str(directory)}}))
    (tmp_path / "t.jinja").write_text("{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}")
    monkeypatch.setattr(chat, "run_config_of", lambda checkpoint: tmp_path / "config.yaml")
    template = chat.run_template(tmp_path / "last.ckpt", str(tmp_path / "t.jinja"))
    assert template.render([{"role": "user", "content": "Who?"}]) == "Who?<|im_end|>"
    assert template.end_marker() == "<|im_end|>"


def test_init_from_records_the_default_of_several_named_chat_templates(tmp_path: Path) -> None:
    """A tokenizer_config.json with a list of named templates (default, tool_use): the source's recorded template
    (which a run from it exports) is the one named default, as transformers and data.template read it."""
    from tests.test_convert_llama_family import bpe_tokenizer, hf_model
    from trident.data.chat_template import read_template
    from trident.weights import read_pretrained

    tokenizer = bpe_tokenizer()
    hf_model("llama", tmp_path, vocab_size=tokenizer.get_vocab_size())
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    named = [{"name": "tool_use", "template": "{{ tools }}"}, {"name": "default", "template": "{{ messages[0].content }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named, "eos_token": "</s>"}))
    settings = read_pretrained(tmp_path).tokenizer_settings
    assert settings["chat_template"] == read_template(str(tmp_path), "bpe").text == "{{ messages[0].content }}"
