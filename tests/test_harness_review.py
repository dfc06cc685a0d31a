"""trident-harness edge cases found in review (issue 52): a chat template that writes its own BOS, special tokens in
generated text, templates of runs that have none, task files the harness cannot build, the output folder."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from tests.convert_helpers import randomise
from tests.test_harness import CORPUS, lm_task, refused, write_tasks
from trident.tasks.lm import LanguageModelTask
from trident.tasks.task_in_checkpoint import TASK_KEY
from trident.weights.adapters.hf_export import write_hf

lm_eval = pytest.importorskip("lm_eval")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("single_thread")

# Mistral's template: the rendered text starts with the BOS the tokenizer would add again.
MISTRAL = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
           "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% else %}{{ message['content'] + eos_token }}{% endif %}"
           "{% endfor %}")
LLAMA = {"d_model": 32, "n_heads": 2, "n_layers": 1, "d_ff": 48, "max_seq_len": 64, "pos_encoding": "rope",
         "norm": "rmsnorm", "activation": "swiglu", "bias": False, "dropout": 0.0}


def bos_tokenizer() -> Tokenizer:
    """A byte-level BPE whose post-processor writes <s> first (a Llama tokenizer's), <s> id 0 and </s> id 1."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return tokenizer


def llama_directory(path: Path) -> Path:
    """A Llama-style Hugging Face directory with Mistral's template, whose head gives every token but <s> and "the"
    a logit of 0: greedy decoding writes <s> (the first of the tied tokens) wherever "the" scores below 0, so its
    generations mix a special token with text."""
    tokenizer = bos_tokenizer()
    task = LanguageModelTask(LLAMA, tokenizer.get_vocab_size(), {"name": "adamw", "lr": 1e-3}, {"name": "constant"},
                             tie_embeddings=False, tokenizer_json=tokenizer.to_str())
    randomise(task.net, seed=0, std=0.3)
    head = next(p for name, p in task.net.named_parameters() if name.endswith("weight") and p.size(0) == 300
                and "embed" not in name)
    with torch.no_grad():
        kept = head[tokenizer.token_to_id("Ġthe")].clone()
        head.zero_()
        head[tokenizer.token_to_id("Ġthe")] = kept
    write_hf(task.net, tokenizer, None, path,
             {"bos_token": "<s>", "eos_token": "</s>", "chat_template": MISTRAL})
    return path


def test_a_directory_with_a_bos_template_scores_and_generates_as_the_hf_model(tmp_path: Path) -> None:
    """A prompt the template starts with <s> gets no second BOS (the hf model's has_bos_prefix); a plain text still
    gets the tokenizer's; a generated special token is no text (the hf model decodes without them)."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from trident.runs.harness import harness_model

    directory = llama_directory(tmp_path / "llama")
    ours = harness_model(directory, batch_size=2, chat=True)
    theirs = HFLM(pretrained=str(directory), device="cpu", batch_size=2)
    turns = [{"role": "user", "content": "Which line follows the quick brown fox?"}]
    prompt = ours.apply_chat_template(turns)
    assert prompt == theirs.apply_chat_template(turns) and prompt.startswith("<s>[INST]")
    assert ours.tok_encode(prompt) == theirs.tok_encode(prompt) and ours.tok_encode(prompt).count(0) == 1
    assert ours.tok_encode("the lazy dog") == theirs.tok_encode("the lazy dog") and ours.tok_encode("the")[0] == 0
    requests = [Instance("loglikelihood", {}, (prompt, " the lazy dog"), 0),
                Instance("loglikelihood", {}, ("the quick brown", " fox"), 1)]
    scores = [score for score, _ in ours.loglikelihood(requests)]
    assert scores == pytest.approx([score for score, _ in theirs.loglikelihood(requests)], abs=1e-4)
    settings = {"until": ["\n"], "max_gen_toks": 12, "do_sample": False}
    generations = [Instance("generate_until", {}, (text, dict(settings)), i)
                   for i, text in enumerate([prompt, "the quick brown fox jumps", "Line 3:"])]
    texts = ours.generate_until(generations)
    assert texts == theirs.generate_until(generations)
    assert all("<s>" not in text for text in texts) and any(" the" in text for text in texts)


def plain_run(folder: Path, data: str) -> Path:
    """A task=lm checkpoint in a run directory whose config names ``data`` (read before the weights, which it
    lacks)."""
    checkpoint = folder / "checkpoints" / "last.ckpt"
    checkpoint.parent.mkdir(parents=True)
    torch.save({TASK_KEY: "trident.tasks.lm.LanguageModelTask", "hyper_parameters": {}, "state_dict": {}}, checkpoint)
    (folder / "config_resolved.yaml").write_text(data)
    return folder


def quick_index(monkeypatch: pytest.MonkeyPatch) -> None:
    """The harness's own thousands of task files take half a minute to index: unknown names are looked up without."""
    import lm_eval.tasks

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", functools.partial(lm_eval.tasks.TaskManager,
                                                                        include_defaults=False))


def test_a_chat_template_where_there_is_none_and_unbuildable_tasks_are_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    quick_index(monkeypatch)
    tasks = write_tasks(tmp_path / "tasks")
    # A run on plain text never saw a template: not given trident's default one.
    run = plain_run(tmp_path / "plain", "data:\n  _target_: trident.data.lm.LMDataModule\n  name: shakespeare\n")
    line = refused([str(run), "--tasks", "tiny_mc", "--include_path", str(tasks), "--apply_chat_template"], capsys)
    assert "was trained on data=shakespeare, not conversations" in line and "without --apply_chat_template" in line
    # A Hugging Face directory without one: named as the harness's option, not data.template.
    task = lm_task()
    write_hf(task.net, task.tokenizer, None, tmp_path / "hf")
    line = refused([str(tmp_path / "hf"), "--tasks", "tiny_mc", "--include_path", str(tasks), "--apply_chat_template"],
                   capsys)
    assert line.startswith("error: --apply_chat_template:") and "has no chat template" in line
    # A task file that does not parse: named, with the parser's reason (the harness skips it without a word).
    (tasks / "broken.yaml").write_text("task: broken\noutput_type: [multiple_choice\n")
    line = refused([str(tmp_path / "hf"), "--tasks", "broken", "--include_path", str(tasks)], capsys)
    assert f"{tasks / 'broken.yaml'} does not parse (ParserError:" in line
    # A task that parses but that the harness cannot build: its value, its data.
    for name, change in (("bad_type", ("output_type: multiple_choice", "output_type: banana")),
                         ("bad_data", ("mc.jsonl", "missing.jsonl"))):
        text = (tasks / "tiny_mc.yaml").read_text().replace("task: tiny_mc", f"task: {name}").replace(*change)
        (tasks / f"{name}.yaml").write_text(text)
        line = refused([str(tmp_path / "hf"), "--tasks", name, "--include_path", str(tasks)], capsys)
        assert line.startswith(f"error: task '{name}' cannot be built from its YAML") and len(line) < 400
    assert "--num_fewshot: must be a whole number >= 0" in refused(
        [str(tmp_path / "hf"), "--tasks", "tiny_mc", "--num_fewshot", "-1"], capsys)


def test_results_never_replace_earlier_ones_and_an_unusable_output_path_is_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import datetime as real

    import trident.commands.harness
    from trident.commands.harness import main

    tasks = write_tasks(tmp_path / "tasks")
    task = lm_task()
    write_hf(task.net, task.tokenizer, None, tmp_path / "hf")
    blocked = tmp_path / "a_file"
    blocked.write_text("mine")
    line = refused([str(tmp_path / "hf"), "--tasks", "tiny_mc", "--include_path", str(tasks), "--output_path",
                    str(blocked)], capsys)
    assert line.startswith(f"error: --output_path '{blocked}' cannot be a folder of results") and \
        blocked.read_text() == "mine"
    # Refused once the folder was made (no room for a prompt in 64 positions): no empty folder left behind.
    text = (tasks / "tiny_gen.yaml").read_text().replace("task: tiny_gen", "task: long_gen")
    (tasks / "long_gen.yaml").write_text(text.replace("max_gen_toks: 6", "max_gen_toks: 64"))
    line = refused([str(tmp_path / "hf"), "--tasks", "long_gen", "--include_path", str(tasks)], capsys)
    assert "max_gen_toks=64 leaves no room for a prompt" in line and not (tmp_path / "hf" / "harness").exists()

    class Frozen(real.datetime):  # two evaluations that end within the same second
        @classmethod
        def now(cls, tz: Any = None) -> real.datetime:
            return real.datetime(2026, 11, 28, 12, 0, 0, tzinfo=tz)

    monkeypatch.setattr(trident.commands.harness, "datetime", Frozen)
    out = tmp_path / "out"
    argv = [str(tmp_path / "hf"), "--tasks", "tiny_mc", "--include_path", str(tasks), "--limit", "1",
            "--output_path", str(out)]
    main([*argv, "--log_samples"])
    first = {path.name: path.read_text() for path in out.iterdir()}
    main(argv)
    assert sorted(first) == ["results_20261128T120000.json", "samples_tiny_mc_20261128T120000.jsonl"]
    assert {path.name: path.read_text() for path in out.iterdir() if path.name in first} == first
    second = json.loads((out / "results_20261128T120000-1.json").read_text())
    assert second["results"]["tiny_mc"]["sample_len"] == 1


def test_a_chat_run_from_a_source_renders_with_the_template_of_its_record(tmp_path: Path) -> None:
    """A data=chat run fine-tuned from a directory with a template: rendered with that template read from the run's
    record (``<run>/init/``), as trident-chat reads it, though the data cache that staged it is gone."""
    from omegaconf import OmegaConf

    from trident.data.chat import source_template_dir
    from trident.runs.harness import _run_template
    from trident.weights import read_pretrained
    from trident.weights.init_from import copy_source

    source = read_pretrained(llama_directory(tmp_path / "llama"))
    run = tmp_path / "run"
    run.mkdir()
    copy_source(source, run)
    data = OmegaConf.create({"_target_": "trident.data.chat.ChatDataModule", "name": "chat", "tokenizer": "char",
                             "cache_dir": str(tmp_path / "cleared_cache")})
    data.template = source_template_dir(data, source.tokenizer_settings)  # as settings_from_source sets it
    OmegaConf.save(OmegaConf.create({"data": data}), run / "config_resolved.yaml")
    checkpoint = plain_run(run, (run / "config_resolved.yaml").read_text()) / "checkpoints" / "last.ckpt"
    template = _run_template(checkpoint)
    assert template.text == MISTRAL
    assert template.render([{"role": "user", "content": "Who?"}], add_generation_prompt=True) == "<s>[INST] Who? [/INST]"
