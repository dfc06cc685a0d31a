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
