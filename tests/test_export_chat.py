"""The hf export of a chat run (issue 50, item 11): the template the run trained with (trident's default included)
and the end of its answers go with the model, so transformers' ``apply_chat_template`` renders what the run trained
on and ``generate`` stops where its answers end."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from tests.conftest import SMALL
from tests.convert_helpers import randomise
from tests.entry_points import run_in_process
from trident.commands.chat import run_template
from trident.commands.export import export_hf
from trident.data.chat_template import DEFAULT_TEMPLATE, ChatTemplate
from trident.data.tokenization import END_OF_TEXT, train_tokenizer
from trident.runs.compose import compose_train_config
from trident.runs.pipeline import train
from trident.tasks.lm import LanguageModelTask
from trident.weights.checkpoints import checkpoint_of, load_task_checkpoint

transformers = pytest.importorskip("transformers")

CORPUS = "".join(f"USER:\nLine {i}: the quick brown fox?\n\nASSISTANT:\nIt jumps over the lazy dog.\n\n" for i in range(50))
LLAMA = {"d_model": 32, "n_heads": 2, "n_layers": 1, "d_ff": 48, "max_seq_len": 64, "pos_encoding": "rope",
         "norm": "rmsnorm", "activation": "swiglu", "bias": False, "dropout": 0.0}
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MESSAGES = [{"role": "user", "content": "the quick fox?"}, {"role": "assistant", "content": "It jumps."},
            {"role": "user", "content": "and then?"}]


def chat_task(tokenizer: Tokenizer, template: ChatTemplate) -> LanguageModelTask:
    """A Llama-style lm task holding what a data=chat run records of its template (the data module's
    ``tokenizer_settings``: the template, the special tokens it reads, the text that ends an answer)."""
    task = LanguageModelTask(LLAMA, tokenizer.get_vocab_size(), {"name": "adamw", "lr": 1e-3}, {"name": "constant"},
                             tie_embeddings=False, tokenizer_json=tokenizer.to_str())
    randomise(task.net, seed=0)
    task.tokenizer_settings = {**template.special_tokens, "chat_template": template.text,
                               "end_of_turn": template.end_marker()}
    return task.eval()


def chatml_tokenizer() -> Tokenizer:
    """A byte-level BPE with ChatML's <|im_start|> and <|im_end|> as special tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[END_OF_TEXT, "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator([CORPUS], trainer=trainer)
    return tokenizer


# Llama 3's pre-tokenizer: punctuation takes the newlines after it (".\n\n" is one pre-token), as Qwen2's does.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
                r"\s+(?!\S)|\s+")


def llama3_style_tokenizer() -> Tokenizer:
    """A byte-level BPE split as Llama 3's, whose vocabulary has "\n\n" as one token and ".\n\n" as another."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
                                                       pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[END_OF_TEXT], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator([CORPUS + "And then\n\n" * 50], trainer=trainer)
    assert len(tokenizer.encode("\n\n").ids) == 1 and tokenizer.encode(".\n\n").tokens == [".ĊĊ"]
    return tokenizer


def exported_files(directory: Path) -> dict[str, Any]:
    return {name: json.loads((directory / name).read_text()) for name in ("config.json", "generation_config.json")}


def test_the_default_template_and_its_blank_line_go_with_a_chat_export(tmp_path: Path) -> None:
    """trident's default template under a character tokenizer: its blank line is two tokens, which generate stops at
    when given as ``stop_strings``; apply_chat_template renders what the run trained on, prompt included. A plain
    generate and pipeline("text-generation") work (with stop_strings in generation_config.json both raised)."""
    tokenizer = train_tokenizer("char", [CORPUS], end_of_text=True)
    template = ChatTemplate("default", DEFAULT_TEMPLATE, {})
    export_hf(chat_task(tokenizer, template), tmp_path)
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for prompt in (False, True):
        assert exported.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=prompt) == template.render(
            MESSAGES, add_generation_prompt=prompt)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert model.generate(torch.tensor([[1, 2]]), max_new_tokens=2, do_sample=False).shape == (1, 4)
    generator = transformers.pipeline("text-generation", model=model, tokenizer=exported)
    assert generator("Line", max_new_tokens=2, do_sample=False)[0]["generated_text"].startswith("Line")
    ids = exported.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    word, newline, start = tokenizer.token_to_id("I"), tokenizer.token_to_id("\n"), ids["input_ids"].shape[1]

    def blank_line_answer(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:  # "I", then newlines
        chosen = word if input_ids.shape[1] == start else newline
        return torch.where(torch.arange(scores.shape[-1]) == chosen, 0.0, -torch.inf).expand_as(scores)

    out = model.generate(**ids, tokenizer=exported, stop_strings=[template.end_marker()], max_new_tokens=20, do_sample=False,
                         logits_processor=transformers.LogitsProcessorList([blank_line_answer]))
    assert out[0, start:].tolist() == [word, newline, newline], "generate stops at the blank line that ends an answer"


def test_an_end_of_turn_token_the_answers_do_not_end_in_is_not_the_eos_of_a_chat_export(tmp_path: Path) -> None:
    """trident's default template under a Llama 3-style tokenizer: "\n\n" is one token alone, but an answer ending
    "jumps." ends in the ".\n\n" token, so eos_token_id "\n\n" would never stop generate there (and would stop it
    at a paragraph break): the export keeps the tokenizer's own eos."""
    tokenizer = llama3_style_tokenizer()
    export_hf(chat_task(tokenizer, ChatTemplate("default", DEFAULT_TEMPLATE, {})), tmp_path)
    files = exported_files(tmp_path)
    assert files["config.json"]["eos_token_id"] == files["generation_config.json"]["eos_token_id"] == tokenizer.token_to_id(
        END_OF_TEXT)


def test_a_one_token_end_of_turn_is_the_eos_of_a_chat_export(tmp_path: Path) -> None:
    """ChatML's <|im_end|> is one special token: it is config.json's and generation_config.json's eos_token_id and the
    tokenizer's eos_token, so a plain generate stops there."""
    tokenizer = chatml_tokenizer()
    template = ChatTemplate("chatml.jinja", CHATML, {})
    export_hf(chat_task(tokenizer, template), tmp_path)
    end = tokenizer.token_to_id("<|im_end|>")
    files = exported_files(tmp_path)
    assert files["config.json"]["eos_token_id"] == files["generation_config.json"]["eos_token_id"] == end
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert (exported.eos_token, exported.eos_token_id) == ("<|im_end|>", end)
    assert exported.apply_chat_template(MESSAGES, tokenize=False) == template.render(MESSAGES)
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path).generation_config.eos_token_id == end


@pytest.mark.slow
def test_a_chat_run_exported_renders_and_stops_in_transformers_as_it_trained(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """train.py task=lm data=chat (trident's default template, a Llama-shaped one-step run) -> trident-export --format hf
    -> transformers: apply_chat_template renders the run's template, the logits are the run's, and generate given the
    end of turn stops there."""
    # "bad chef": transformers' stop strings need "abcdef" in the vocabulary (a run's own characters here).
    rows = [{"messages": [{"role": "user", "content": f"Say {word}, bad chef."}, {"role": "assistant", "content": word.upper()}]}
            for word in ("yes", "no", "maybe")] * 10
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    train(compose_train_config(
        [*SMALL, "task=lm", "data=chat", "data.source=files", f"data.files=[{tmp_path / 'chats.jsonl'}]",
         "data.block_size=64", "data.batch_size=2", "trainer.max_steps=1", "logger=none", "test=false",
         "model.norm=rmsnorm", "model.activation=swiglu", "model.bias=false"], output_dir=tmp_path / "run"))
    result = run_in_process("trident.commands.export", [str(tmp_path / "run"), "--format", "hf", "--out", str(tmp_path / "hf")],
                            tmp_path, monkeypatch)
    assert result.returncode == 0, result.stderr
    checkpoint = checkpoint_of(tmp_path / "run")
    task, template = load_task_checkpoint(LanguageModelTask, checkpoint).eval(), run_template(checkpoint, None)
    assert template.text == DEFAULT_TEMPLATE
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    messages = [*rows[0]["messages"], rows[1]["messages"][0]]
    assert exported.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == template.render(
        messages, add_generation_prompt=True)
    inputs = exported.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, task.net(inputs["input_ids"]), atol=1e-4, rtol=1e-4)
    # The answer "N", then the end of turn token after token and on: generate stops at the end of the turn.
    start, end = inputs["input_ids"].shape[1], exported(template.end_marker(), add_special_tokens=False)["input_ids"]
    answer = [exported.convert_tokens_to_ids("N"), *end, *end]

    def scripted(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        chosen = answer[min(input_ids.shape[1] - start, len(answer) - 1)]
        return torch.where(torch.arange(scores.shape[-1]) == chosen, 0.0, -torch.inf).expand_as(scores)

    assert model.generate(**inputs, max_new_tokens=2, do_sample=False).shape[1] == start + 2  # no tokenizer needed
    out = model.generate(**inputs, tokenizer=exported, stop_strings=[template.end_marker()], max_new_tokens=10,
                         do_sample=False, logits_processor=transformers.LogitsProcessorList([scripted]))
    assert exported.decode(out[0, start:]) == "N" + template.end_marker()
