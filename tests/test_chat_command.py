"""trident-chat (issue 41): a train.py run on data=chat answers turn after turn through the template and one KV
cache, exactly as a fresh pass over the whole conversation would."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trident.commands.chat import Chat, run_template
from trident.runs.compose import compose_train_config
from trident.runs.pipeline import train
from trident.tasks.lm import LanguageModelTask
from trident.weights.checkpoints import checkpoint_of, load_task_checkpoint

from .backbone_helpers import perturb_
from .conftest import SMALL
from .entry_points import run_in_process

# A template whose end marker, "O", the perturbed one-step model writes soon: answers end before the token limit.
O_TEMPLATE = ("{% for m in messages %}{{ m['role'] | upper }}:\n{{ m['content'] }}O\n{% endfor %}"
                "{% if add_generation_prompt %}ASSISTANT:\n{% endif %}")
TURNS = [{"role": "user", "content": f"Say {word}."} for word in ("yes", "no", "maybe")]


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-step data=chat run from scratch on a small file of conversations."""
    root = tmp_path_factory.mktemp("chat_run")
    rows = [{"messages": [turn, {"role": "assistant", "content": turn["content"].upper()}]} for turn in TURNS] * 20
    (root / "chats.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    train(compose_train_config(
        [*SMALL, "task=lm", "data=chat", "data.source=files", f"data.files=[{root / 'chats.jsonl'}]", "data.block_size=64", "data.max_seq_len=256",
         "data.batch_size=2", "trainer.max_steps=1", "logger=none", "test=false"],
        output_dir=root / "run",
    ))
    return root / "run"


def greedy_answer(task: LanguageModelTask, prompt: str, end_marker: str, max_new_tokens: int) -> str:
    """The greedy answer recomputed from the whole prompt every step (no cache)."""
    assert task.tokenizer is not None
    ids = task.tokenizer.encode(prompt, add_special_tokens=False).ids
    answer: list[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            answer.append(int(task.net(torch.tensor([ids + answer]))[0, -1].argmax()))
            if end_marker in task.tokenizer.decode(answer, skip_special_tokens=False):
                break
    return task.tokenizer.decode(answer, skip_special_tokens=False).split(end_marker, 1)[0]


@pytest.mark.parametrize("template_file", [None, "o.jinja"])
def test_each_turn_through_the_cache_equals_a_fresh_pass_over_the_whole_conversation(
    chat_run: Path, template_file: str | None, tmp_path: Path
) -> None:
    checkpoint = checkpoint_of(chat_run)
    task = load_task_checkpoint(LanguageModelTask, checkpoint)
    perturb_(task.net, std=0.3)  # answers of some length, which a wrong cache would change
    (tmp_path / "o.jinja").write_text(O_TEMPLATE)
    template = run_template(checkpoint, str(tmp_path / template_file) if template_file else None)
    session = Chat(task, template, max_new_tokens=12, temperature=0.0, top_k=None, top_p=None, seed=0)
    session._restart = lambda: pytest.fail("the conversation was fed again from its start")  # type: ignore[method-assign]
    history: list[dict[str, str]] = []
    for turn in TURNS:
        streamed: list[str] = []
        answer = session.reply(turn["content"], streamed.append)
        expected = greedy_answer(task, template.render([*history, turn], add_generation_prompt=True), template.end_marker(), 12)
        assert answer == expected == "".join(streamed)
        history += [turn, {"role": "assistant", "content": answer}]
        # The cache holds the conversation up to the end of this answer, each token fed once.
        assert template.render(history).startswith(session.fed_text) and session.fed_text.endswith((answer, answer + template.end_marker()))
        assert len(session.fed_ids) == len(session.fed_text)  # one token a character
    assert session.messages == history
    if template_file is None:
        assert any(h["content"] for h in history[1::2]), "answers of some length"
    else:
        assert session.fed_text.endswith("O"), "an answer that ended at its marker, which the cache holds"


def test_the_message_mode_answers_each_message_on_a_line(chat_run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    result = run_in_process("trident.commands.chat", [str(chat_run), "--message", "Say yes.", "--message", "Say no.",
                                                       "--max-new-tokens", "5", "--temperature", "0"], chat_run, monkeypatch)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("\n") == 2 and "Traceback" not in result.stderr


def test_the_lm_loss_of_a_packed_batch_is_the_answer_loss_of_each_conversation_alone(chat_run: Path) -> None:
    """Through the task: the documents reach the model, and only answer targets count."""
    task = load_task_checkpoint(LanguageModelTask, checkpoint_of(chat_run))
    perturb_(task.net, std=0.3)
    first, second = torch.randint(1, task.net.vocab_size, (2, 7))
    targets = torch.full((14,), -100)
    targets[3:6], targets[9:13] = first[4:7], second[3:7]  # the answers: the last tokens of each
    documents = torch.tensor([0] * 7 + [1] * 7)
    with torch.no_grad():
        summed, count = task._loss((torch.cat([first, second])[None], targets[None], documents[None]))
        alone = [task.net(ids[None])[0] for ids in (first, second)]
    picked = torch.cat([torch.log_softmax(alone[0][3:6], -1).gather(-1, first[4:7, None]),
                        torch.log_softmax(alone[1][2:6], -1).gather(-1, second[3:7, None])])
    assert int(count) == 7  # the answer tokens, which the summed loss covers alone
    torch.testing.assert_close(summed / count, -picked.mean(), atol=1e-5, rtol=1e-5)


def test_the_run_records_the_template_and_end_of_turn_it_trained_with(chat_run: Path) -> None:
    """trident's default template too (issue 50): the checkpoint's tokenizer_settings, which the export writes."""
    from trident.data.chat_template import DEFAULT_TEMPLATE

    task = load_task_checkpoint(LanguageModelTask, checkpoint_of(chat_run))
    assert task.tokenizer_settings == {"chat_template": DEFAULT_TEMPLATE, "end_of_turn": "\n\n"}


def test_a_run_resumed_from_a_checkpoint_without_tokenizer_settings_records_its_template(chat_run: Path, tmp_path: Path) -> None:
    """A checkpoint written before runs recorded their chat template: the resumed run's checkpoints hold it."""
    from trident.data.chat_template import DEFAULT_TEMPLATE

    older = torch.load(checkpoint_of(chat_run), weights_only=False)
    del older["tokenizer_settings"]
    torch.save(older, tmp_path / "older.ckpt")
    train(compose_train_config(
        [*SMALL, "task=lm", "data=chat", "data.source=files", f"data.files=[{chat_run.parent / 'chats.jsonl'}]",
         "data.block_size=64", "data.max_seq_len=256", "data.batch_size=2", "trainer.max_steps=2", "logger=none",
         "test=false", f"ckpt_path={tmp_path / 'older.ckpt'}"],
        output_dir=tmp_path / "resumed",
    ))
    settings = torch.load(checkpoint_of(tmp_path / "resumed"), weights_only=False)["tokenizer_settings"]
    assert settings == {"chat_template": DEFAULT_TEMPLATE, "end_of_turn": "\n\n"}
