"""Instruction data (issue 41, data=chat): the answer mask token by token, packing that keeps conversations
apart through the real model, and the real-token rate of the shipped set."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from trident.backbone.masks import document_positions
from trident.data.chat import IGNORE_INDEX, PADDING, ChatDataModule, fit, pack
from trident.data.chat_template import ChatTemplate, conversation_of, encode_conversation, read_template
from trident.data.tokenization import train_tokenizer
from trident.errors import DataError
from trident.models import CausalLM

from .backbone_helpers import make_cfg, perturb_

TWO_TURNS = [
    {"role": "system", "content": "Speak briefly."},
    {"role": "user", "content": "Who is there?"},
    {"role": "assistant", "content": "Nay, answer me."},
    {"role": "user", "content": "Long live the king!"},
    {"role": "assistant", "content": "Bernardo?"},
]
# ChatML, as Qwen2's tokenizer_config.json writes it (shortened: no tools).
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def runs_of(pieces: list[tuple[str, bool]]) -> list[tuple[str, bool]]:
    """Consecutive pieces with the same flag joined: the token-by-token mask read as text."""
    joined: list[tuple[str, bool]] = []
    for text, trained in pieces:
        if joined and joined[-1][1] == trained:
            joined[-1] = (joined[-1][0] + text, trained)
        else:
            joined.append((text, trained))
    return joined


def test_the_default_template_masks_every_prompt_and_template_character_and_no_answer_character() -> None:
    template = read_template(None, "char")
    tokenizer = train_tokenizer("char", [template.render(TWO_TURNS)])
    ids, trained = encode_conversation(tokenizer, template, TWO_TURNS)
    expected = [
        ("SYSTEM:\nSpeak briefly.\n\nUSER:\nWho is there?\n\nASSISTANT:\n", False), ("Nay, answer me.\n\n", True),
        ("USER:\nLong live the king!\n\nASSISTANT:\n", False), ("Bernardo?\n\n", True),
    ]
    # One token a character: the mask, character by character, is the expected one.
    assert [tokenizer.id_to_token(i) for i in ids] == list("".join(text for text, _ in expected))
    assert trained == [flag for text, flag in expected for _ in text]


def test_a_tokenizer_directorys_template_masks_its_markers_and_trains_the_end_marker(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>"}))
    template = read_template(str(tmp_path), "bpe")
    tokenizer = train_tokenizer("bpe", [template.render(TWO_TURNS)] * 20, vocab_size=300)
    tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    ids, trained = encode_conversation(tokenizer, template, TWO_TURNS)
    pieces = [(tokenizer.decode([i], skip_special_tokens=False), flag) for i, flag in zip(ids, trained, strict=True)]
    assert runs_of(pieces) == [
        ("<|im_start|>system\nSpeak briefly.<|im_end|>\n<|im_start|>user\nWho is there?<|im_end|>\n<|im_start|>assistant\n", False),
        ("Nay, answer me.<|im_end|>\n", True),
        ("<|im_start|>user\nLong live the king!<|im_end|>\n<|im_start|>assistant\n", False),
        ("Bernardo?<|im_end|>\n", True),
    ]
    assert tokenizer.token_to_id("<|im_end|>") in [i for i, flag in zip(ids, trained, strict=True) if flag]
    assert template.end_marker() == "<|im_end|>" and read_template(None, "char").end_marker() == "\n\n"
    # White space before the marker is the answer's end too: the cache then holds the start of the next prompt.
    assert ChatTemplate("dot", "{% for m in messages %}{{ m['content'] }}\n.\n{% endfor %}", {}).end_marker() == "\n."


def test_packed_targets_are_the_answer_tokens_of_the_same_conversation_only() -> None:
    first = ([1, 2, 3, 4], [False, False, True, True])
    second = ([5, 6, 7], [False, True, True])
    rows = pack([first, second], block_size=10, pad_id=0)
    assert rows["ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7, 0, 0, 0]]
    # Token 4 ends the first conversation: it predicts nothing (never the second's 5); 5 predicts 6 (an answer token).
    assert rows["targets"].tolist() == [[IGNORE_INDEX, 3, 4, IGNORE_INDEX, 6, 7, *[IGNORE_INDEX] * 4]]
    assert rows["documents"].tolist() == [[0, 0, 0, 0, 1, 1, 1, PADDING, PADDING, PADDING]]


def test_best_fit_puts_a_conversation_into_a_row_it_fills_exactly() -> None:
    """6 + 4 and 5 + 5 fill two rows of 10: the second 5 fits the 5 left exactly, the 4 the 4 left."""
    conversations = [([7] * n, [False] + [True] * (n - 1)) for n in (6, 5, 5, 4)]
    rows = pack(conversations, block_size=10, pad_id=0)
    assert len(rows["ids"]) == 2 and (rows["documents"] != PADDING).all()


def chats_file(path: Path, conversations: list[list[dict[str, str]]]) -> Path:
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    return path


def prepared(path: Path, **options: object) -> ChatDataModule:
    data = ChatDataModule(source="files", cache_dir=str(path / "cache"), **options)  # type: ignore[arg-type]
    data.prepare_data()
    data.setup()
    return data


def test_a_prompt_longer_than_the_row_loses_its_start_and_keeps_the_answer(tmp_path: Path,
                                                                            caplog: pytest.LogCaptureFixture) -> None:
    """Through the data module: a 300-character question with an 11-character answer in rows of 64 characters
    trains the whole answer and its end marker after the question's end; one warning line counts it."""
    long = [{"role": "user", "content": "Q" * 300}, {"role": "assistant", "content": "Short reply"}]
    short = [{"role": "user", "content": "Who?"}, {"role": "assistant", "content": "Me."}]
    chats = chats_file(tmp_path / "chats.jsonl", [long, short] * 10)
    with caplog.at_level("WARNING"):
        data = prepared(tmp_path, files=str(chats), block_size=64, split=(0.5, 0.25, 0.25))
    for split in ("train", "validation", "test"):
        rows = data.rows[split]
        assert ((rows["targets"] != IGNORE_INDEX).sum(axis=1) > 0).all(), "a row that trains nothing"
    assert data.tokenizer is not None
    ids, targets = data.rows["train"]["ids"], data.rows["train"]["targets"]
    full = [row for row in ids if "Short reply" in data.tokenizer.decode(row.tolist())]
    assert full and all(data.tokenizer.decode(row.tolist()).endswith("QQ\n\nASSISTANT:\nShort reply\n\n") for row in full)
    trained = [data.tokenizer.decode(t[t != IGNORE_INDEX].tolist()) for t in targets]
    assert "Short reply\n\n" in trained
    (line,) = [r.getMessage() for r in caplog.records if "data.block_size" in r.getMessage()]
    assert "10 conversations" in line and "0 have no answer token" in line


def test_an_answer_longer_than_the_row_keeps_the_prompts_end_and_the_answers_start() -> None:
    ids, trained = list(range(20)), [False] * 8 + [True] * 12
    assert fit(ids, trained, 10) == (list(range(3, 13)), [False] * 5 + [True] * 5)
    # Multi-turn: the oldest turns go first, the last answer stays whole.
    turns = [False] * 4 + [True] * 3 + [False] * 4 + [True] * 3
    assert fit(list(range(14)), turns, 8) == (list(range(6, 14)), turns[6:])
    assert fit([1, 2, 3], [False, False, False], 8) is None and fit([1, 2, 3], [False, False, True], 1) is None


def test_a_conversation_without_a_trainable_answer_token_is_dropped_and_counted(tmp_path: Path,
                                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A one-character answer that starts the conversation (nothing before it predicts it): dropped and counted,
    never an all-ignored row."""
    template = tmp_path / "bare.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    good = [{"role": "user", "content": "Who?"}, {"role": "assistant", "content": "Me."}]
    bad = [{"role": "assistant", "content": "X"}]
    chats = chats_file(tmp_path / "chats.jsonl", [good, good, bad] * 4)
    with caplog.at_level("WARNING"):
        data = prepared(tmp_path, files=str(chats), template=str(template), block_size=16, split=(0.5, 0.25, 0.25))
    (line,) = [r.getMessage() for r in caplog.records if "data.block_size" in r.getMessage()]
    assert "4 have no answer token" in line
    for rows in data.rows.values():
        assert ((rows["targets"] != IGNORE_INDEX).sum(axis=1) > 0).all(), "a row that trains nothing"


def test_positions_restart_with_each_packed_document() -> None:
    documents = torch.tensor([[0, 0, 0, 1, 1, PADDING], [0, 1, 1, 1, 1, 1]])
    assert document_positions(documents).tolist() == [[0, 1, 2, 0, 1, 0], [0, 0, 1, 2, 3, 4]]


@pytest.mark.parametrize("pos_encoding", ["rope", "learned", "alibi"])
def test_a_packed_conversation_neither_sees_another_nor_its_position(pos_encoding: str) -> None:
    """Conversation B's logits in a packed row equal its logits alone, and do not move when A's tokens change."""
    torch.manual_seed(0)
    net = perturb_(CausalLM(make_cfg(pos_encoding=pos_encoding), vocab_size=50)).eval()
    first, second = torch.randint(1, 50, (1, 6)), torch.randint(1, 50, (1, 9))
    documents = torch.tensor([[0] * 6 + [1] * 9 + [PADDING] * 3])
    row = torch.cat([first, second, torch.zeros(1, 3, dtype=torch.long)], dim=1)  # (1, 18)
    with torch.no_grad():
        alone = net(second)[0]
        packed = net(row, documents=documents)[0, 6:15]
        other = torch.cat([torch.randint(1, 50, (1, 6)), second, torch.zeros(1, 3, dtype=torch.long)], dim=1)
        perturbed = net(other, documents=documents)[0, 6:15]
        unmasked = net(row)[0, 6:15]
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(perturbed, packed, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(unmasked, alone, atol=1e-3), "without documents B sees A: the check can fail"


def test_the_shipped_set_fills_at_least_95_percent_of_its_rows_with_real_tokens(tmp_path: Path) -> None:
    data = ChatDataModule(cache_dir=str(tmp_path))
    data.prepare_data()
    data.setup()
    rates = {split: data.real_token_rate(split) for split in ("train", "validation", "test")}
    assert all(rate >= 0.95 for rate in rates.values()), rates
    inputs, targets, documents = data.blocks("train")[0]
    assert inputs.shape == targets.shape == documents.shape == (512,)
    assert data.tokenizer is not None and "Continue " in data.tokenizer.decode(inputs.tolist())
    assert 0 < (targets != IGNORE_INDEX).float().mean() < 0.6  # answers are trained, prompts are not


def test_alpaca_rows_and_openai_messages_read_as_conversations() -> None:
    alpaca = conversation_of({"instruction": "Translate.", "input": "Guten Tag", "output": "Good day"}, "row 1")
    assert alpaca == [{"role": "user", "content": "Translate.\n\nGuten Tag"}, {"role": "assistant", "content": "Good day"}]
    assert conversation_of({"messages": TWO_TURNS}, "row 2") == TWO_TURNS


def test_a_files_source_trains_with_its_own_template_file(tmp_path: Path) -> None:
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": TWO_TURNS}) + "\n" for _ in range(20)))
    (tmp_path / "t.jinja").write_text(CHATML)
    data = ChatDataModule(source="files", files=str(chats), template=str(tmp_path / "t.jinja"), block_size=128,
                          cache_dir=str(tmp_path / "cache"))
    data.prepare_data()
    data.setup()
    assert isinstance(data.template, ChatTemplate) and data.template.text == CHATML
    # The validation samples ask the turns before the first answer of the file's validation conversations.
    asked = ChatTemplate("chatml", CHATML, {}).render(TWO_TURNS[:2], add_generation_prompt=True)
    assert data.task_inputs()["sample_prompts"] == [asked]
    assert "ROMEO" not in asked
    assert data.tokenizer is not None and "<|im_start|>" in data.tokenizer.decode(data.blocks("train")[0][0].tolist())


def llama_with_a_chat_template(path: Path, conversations: list[list[dict[str, str]]]) -> None:
    """A tiny Llama saved by transformers with its tokenizer (a byte-level BPE of the ChatML-rendered
    ``conversations``) and that tokenizer's chat template, ChatML, as a Hub directory has them."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = [ChatTemplate("chatml", CHATML, {}).render(c) for c in conversations]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<|im_end|>",
                                         chat_template=CHATML).save_pretrained(path)
    config = transformers.LlamaConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                      max_position_embeddings=128)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)


def test_init_from_a_hugging_face_directory_renders_chat_data_with_its_template(tmp_path: Path) -> None:
    """``data=chat init_from=<HF dir>`` without ``data.template``: the directory's template (and special tokens) render
    the training rows and their answer mask; an explicit data.template wins; trident-chat of the run reads the
    same template, staged again from the run's copy when the data cache lost it."""
    from tests.conftest import compose_config
    from trident.commands.chat import run_template
    from trident.runs.pipeline import build_data_and_task, check_config, configured_task_class, train
    from trident.weights.checkpoints import checkpoint_of
    from trident.weights.init_from import source_for_run

    conversations = [[{"role": "user", "content": f"Who is there, {i}?"},
                      {"role": "assistant", "content": f"Nay, answer me {i} times."}] for i in range(40)]
    hf_dir, chats = tmp_path / "llama", tmp_path / "chats.jsonl"
    llama_with_a_chat_template(hf_dir, conversations)
    chats.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    chat = ["data=chat", "data.source=files", f"data.files=[{chats}]", "data.block_size=64", "data.batch_size=4",
            f"init_from={hf_dir}", "logger=none", "test=false", "print_config=false", "trainer.max_steps=1",
            "trainer.limit_val_batches=1", "trainer.num_sanity_val_steps=0", "task.sampling.max_new_tokens=4"]

    def data_of(overrides: list[str]) -> ChatDataModule:
        cfg = compose_config(overrides, output_dir=tmp_path / "unused")
        source_for_run(configured_task_class(cfg), cfg, tmp_path / "unused", None, False)
        datamodule, _ = build_data_and_task(cfg, check_config(cfg), "fit")
        assert isinstance(datamodule, ChatDataModule)
        return datamodule

    data = data_of(chat)
    assert data.template.text == CHATML and data.template.special_tokens["eos_token"] == "<|im_end|>"
    assert data.tokenizer is not None
    ids, targets, documents = (data.rows["train"][k][0] for k in ("ids", "targets", "documents"))  # row 0: (T,) each
    first = documents == 0
    text = data.tokenizer.decode(ids[first].tolist(), skip_special_tokens=False)
    (conversation,) = [c for c in conversations if ChatTemplate("chatml", CHATML, {}).render(c) == text]
    trained = data.tokenizer.decode(targets[first & (targets != IGNORE_INDEX)].tolist(), skip_special_tokens=False)
    assert trained == conversation[1]["content"] + "<|im_end|>\n", "the loss on the answer and ChatML's end marker"
    assert data_of([*chat, "data.template=default"]).template.text == read_template("default", "char").text
    (tmp_path / "mine.jinja").write_text(CHATML.replace("<|im_start|>", "<|im_start|> "))
    assert data_of([*chat, f"data.template={tmp_path / 'mine.jinja'}"]).template.text == (tmp_path / "mine.jinja").read_text()

    run = tmp_path / "run"
    train(compose_config(chat, output_dir=run))
    staged = Path(yaml.safe_load((run / "config_resolved.yaml").read_text())["data"]["template"])
    assert (staged / "tokenizer_config.json").is_file()
    shutil.rmtree(staged)  # the data cache lost the staged template
    assert run_template(checkpoint_of(run), None).text == CHATML
    # The run records the template and end of turn it trained with, beside the source's special tokens.
    settings = torch.load(checkpoint_of(run), weights_only=False)["tokenizer_settings"]
    assert settings["chat_template"] == CHATML and settings["end_of_turn"] == "<|im_end|>"
    assert settings["eos_token"] == "<|im_end|>"


def test_data_files_by_split_reads_each_split_from_its_file(tmp_path: Path) -> None:
    """``data.files={train: ..., validation: ...}``: the keys are splits, not file names; test is cut from train."""
    train = [[{"role": "user", "content": f"Train {i}?"}, {"role": "assistant", "content": "Yes."}] for i in range(20)]
    validation = [[{"role": "user", "content": f"Held out {i}?"}, {"role": "assistant", "content": "No."}] for i in range(3)]
    files = {"train": str(chats_file(tmp_path / "train.jsonl", train)), "dev": [str(chats_file(tmp_path / "v.jsonl", validation))]}
    data = prepared(tmp_path, files=files, block_size=64, split=(0.8, 0.1, 0.1), tokenizer="bpe", vocab_size=300)
    assert data.tokenizer is not None
    texts = {split: data.tokenizer.decode(data.rows[split]["ids"].ravel().tolist()) for split in data.rows}
    assert texts["validation"].count("Held out") == 3 and "Train" not in texts["validation"]
    assert texts["test"].count("Train") == 2 and texts["train"].count("Train") == 18
    assert data.task_inputs()["sample_prompts"][0] == "USER:\nHeld out 0?\n\nASSISTANT:\n"
    # The same cache, other prompts: the prompts are not cached.
    assert prepared(tmp_path, files=files, block_size=64, split=(0.8, 0.1, 0.1), sample_prompts=[], tokenizer="bpe",
                    vocab_size=300).task_inputs()["sample_prompts"] == []


@pytest.mark.parametrize(("content", "problem"), [
    (None, "content is null"), ("", "empty answer"), ("  \n", "empty answer"), (42, "content is int"),
    ([{"type": "text", "text": "Look: "}, {"type": "image_url", "image_url": {"url": "x.png"}}], "'image_url'"),
])
def test_a_bad_answer_is_one_line_naming_the_row(tmp_path: Path, content: object, problem: str) -> None:
    rows = [{"messages": [{"role": "user", "content": "Who?"}, {"role": "assistant", "content": "Me."}]}] * 3
    rows.append({"messages": [{"role": "user", "content": "Who?"}, {"role": "assistant", "content": content}]})
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(DataError, match=f"chats.jsonl line 4.*{problem}") as raised:
        prepared(tmp_path, files=str(chats))
    assert "\n" not in str(raised.value)


def test_multi_part_text_contents_are_joined_as_transformers_templates_join_them() -> None:
    parts = [{"type": "text", "text": "Who is "}, {"type": "text", "text": "there?"}]
    row = {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": [{"type": "text", "text": "Me."}]}]}
    assert conversation_of(row, "row 1") == [{"role": "user", "content": "Who is there?"}, {"role": "assistant", "content": "Me."}]
    with pytest.raises(DataError, match="row 2.*'output'.* is null"):
        conversation_of({"instruction": "Say it.", "output": None}, "row 2")
    with pytest.raises(DataError, match="row 3.*'input' is a list"):
        conversation_of({"instruction": "Say it.", "input": ["a"], "output": "It."}, "row 3")


@pytest.mark.parametrize(("init_from", "model_part"), [
    (None, "tiny"), ("models/TinyLlama-1.1B/", "TinyLlama-1.1B"),
    ("outputs/runs/2026-11-28/07-00-00_lm-shakespeare-small-rope-seed1/checkpoints/last.ckpt", "lm-shakespeare-small-rope-seed1"),
    ("vit_small.pth", "vit_small"),
])
def test_a_run_is_named_after_its_init_from_source(init_from: str | None, model_part: str) -> None:
    """The source fixes the architecture: a run from a Llama directory is not named after model=tiny."""
    from tests.conftest import compose_config

    cfg = compose_config(["data=chat", "model=tiny", *([f"init_from={init_from}"] if init_from else [])])
    assert cfg.run_name == f"lm-chat-{model_part}-rope-seed{cfg.seed}"
