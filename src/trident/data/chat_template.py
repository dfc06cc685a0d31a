"""Conversations and chat templates: reading OpenAI-style ``messages`` and Alpaca-style rows, rendering
them with a Jinja chat template, and the per-token mask of what the loss trains on (the answers).

A Hugging Face tokenizer directory brings its template (``chat_template`` of ``tokenizer_config.json``, or
``chat_template.jinja``), rendered as ``transformers``' ``apply_chat_template`` does (a sandboxed Jinja
environment with ``trim_blocks`` and ``lstrip_blocks``, the special tokens of ``tokenizer_config.json``,
``add_generation_prompt``). trident's own tokenizers get :data:`DEFAULT_TEMPLATE`: each turn as
``ROLE:\\n<content>\\n\\n``, the "SPEAKER:\\nline" form of the Shakespeare corpus, made of characters any
character tokenizer trained on English text encodes.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trident.errors import ConfigError, DataError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

ROLES = ("system", "user", "assistant")
# trident's default: "USER:\nHow now?\n\nASSISTANT:\nWell.\n\n". The blank line after an answer ends it
# (the end marker the model learns, and where trident-chat stops).
DEFAULT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | upper }}:\n{{ message['content'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:\n{% endif %}"
)
Message = dict[str, str]


@dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template with the values it may read beside ``messages`` (special tokens)."""

    source: str  # what data.template named, for error lines
    text: str
    special_tokens: dict[str, str]

    def render(self, messages: list[Message], add_generation_prompt: bool = False) -> str:
        from jinja2 import TemplateError  # jinja2 comes with torch; imported where a template is rendered

        try:
            return _compiled(self.text).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                               **self.special_tokens)
        except TemplateError as err:
            raise DataError(f"the chat template of data.template={self.source} fails on a conversation ({err}): "
                            "fix the template or the conversation") from err

    def end_marker(self) -> str:
        """What the template writes after an answer (``<|im_end|>\\n``, or the default's blank line), without
        trailing white space unless that is all of it: where a generated answer ends (the white space after it
        is the template's to write)."""
        asked = [{"role": "user", "content": "?"}]
        prompt = self.render(asked, add_generation_prompt=True)
        after = self.render([*asked, {"role": "assistant", "content": "ANSWER"}])[len(prompt):].split("ANSWER", 1)[-1]
        return after.rstrip() or after

    def segments(self, messages: list[Message]) -> list[tuple[str, bool]]:
        """The rendered conversation as pieces of text, each with whether the loss trains on it: the text the
        template adds for an assistant turn after the generation prompt (the answer and its end marker) is
        trained, every other piece (system and user turns, role headers, the generation prompt) is not."""
        pieces: list[tuple[str, bool]] = []
        done = ""
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self.render(messages[:i], add_generation_prompt=True)
            full = self.render(messages[: i + 1])
            if not (prompt.startswith(done) and full.startswith(prompt)):
                raise DataError(f"the chat template of data.template={self.source} does not render a conversation as the "
                                "start of its continuation, so its answers cannot be told apart: use another template")
            pieces += [(prompt[len(done):], False), (full[len(prompt):], True)]
            done = full
        rest = self.render(messages)[len(done):]
        return [*pieces, (rest, False)] if rest else pieces


@functools.lru_cache(maxsize=4)
def _compiled(text: str) -> Any:
    """The template compiled as transformers compiles chat templates (``raise_exception`` and ``tojson`` included)."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        from jinja2 import TemplateError

        raise TemplateError(message)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    environment.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    environment.globals["raise_exception"] = raise_exception
    return environment.from_string(text)


def read_template(choice: str | None, tokenizer_choice: str) -> ChatTemplate:
    """``data.template``: null takes the template of ``data.tokenizer`` when that is a tokenizer directory and
    :data:`DEFAULT_TEMPLATE` otherwise; ``default`` is that template; anything else is a tokenizer directory or a
    ``.jinja`` file."""
    if choice is None:
        choice = tokenizer_choice if Path(tokenizer_choice).is_dir() else "default"
    if choice == "default":
        return ChatTemplate("default", DEFAULT_TEMPLATE, {})
    path = Path(choice)
    if path.is_file():
        return ChatTemplate(choice, path.read_text(encoding="utf-8"), {})
    if not path.is_dir():
        raise ConfigError(f"data.template={choice} is neither default, a .jinja file nor a tokenizer directory: fix the path")
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    text = config.get("chat_template")
    if isinstance(text, list):  # several named templates: transformers takes the one named "default"
        text = next((t["template"] for t in text if t.get("name") == "default"), None)
    if (path / "chat_template.jinja").is_file():
        text = (path / "chat_template.jinja").read_text(encoding="utf-8")
    if not text:
        raise ConfigError(f"data.template={choice}: the tokenizer directory has no chat template (neither chat_template "
                          "in tokenizer_config.json nor chat_template.jinja): give a .jinja file, or data.template=default")
    special = {k: v.get("content", "") if isinstance(v, dict) else v for k, v in config.items()
               if k.endswith("_token") and isinstance(v, (str, dict))}
    return ChatTemplate(choice, text, special)


def conversation_of(row: Any, where: str) -> list[Message]:
    """One row of a chat file -> its messages: OpenAI-style ``{"messages": [{"role", "content"}]}``, or
    Alpaca-style ``{"instruction", "input", "output"}`` (the input, when given, after the instruction and a
    blank line, as Alpaca's prompt puts it; an optional ``system``)."""
    if isinstance(row, dict) and "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "content" in m for m in messages):
            raise DataError(f"{where}: 'messages' must be a list of {{role, content}} objects: fix that row")
        for message in messages:
            if message.get("role") not in ROLES:
                raise DataError(f"{where}: role {message.get('role')!r} is not one of {', '.join(ROLES)}: "
                                "rename the role (tool and function turns are not read)")
        conversation = [{"role": str(m["role"]), "content": str(m["content"])} for m in messages]
    elif isinstance(row, dict) and "instruction" in row and "output" in row:
        asked = str(row["instruction"]) + (f"\n\n{row['input']}" if row.get("input") else "")
        conversation = [{"role": "user", "content": asked}, {"role": "assistant", "content": str(row["output"])}]
        if row.get("system"):
            conversation.insert(0, {"role": "system", "content": str(row["system"])})
    else:
        raise DataError(f"{where} has neither 'messages' nor 'instruction' and 'output': give each row "
                        "messages=[{role, content}, ...] (OpenAI style) or instruction/input/output (Alpaca style)")
    if not any(m["role"] == "assistant" for m in conversation):
        raise DataError(f"{where} has no assistant message, nothing to train on: add the answer, or drop the row")
    return conversation


def read_conversations(path: Path) -> list[list[Message]]:
    """A ``.jsonl`` file (one conversation a line) or a ``.json`` file (a list of them, Alpaca's layout)."""
    if not path.is_file():
        raise DataError(f"data.files: {path} not found: give .jsonl or .json chat files")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix == ".json":
            rows = json.loads(text) if text.strip() else []
            if not isinstance(rows, list):
                raise DataError(f"{path} is not a JSON list of conversations: write a list, or one conversation a line (.jsonl)")
            places = [f"{path} item {i + 1}" for i in range(len(rows))]
        else:
            numbered = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
            rows = [json.loads(line) for _, line in numbered]
            places = [f"{path} line {n}" for n, _ in numbered]
    except json.JSONDecodeError as err:
        raise DataError(f"{path} is not valid JSON ({err}): fix the file (.jsonl: one JSON object a line)") from err
    if not rows:
        raise DataError(f"{path} holds no conversations: give a .jsonl file with one conversation a line")
    return [conversation_of(row, where) for row, where in zip(rows, places, strict=True)]


def encode_conversation(tokenizer: Tokenizer, template: ChatTemplate, messages: list[Message]) -> tuple[list[int], list[bool]]:
    """Token ids of the rendered conversation and, for each, whether the loss trains on it (each piece of
    :meth:`ChatTemplate.segments` encoded on its own, without a post-processor's extra tokens: the template
    writes any beginning-of-text token itself)."""
    ids: list[int] = []
    trained: list[bool] = []
    for text, train in template.segments(messages):
        piece = tokenizer.encode(text, add_special_tokens=False).ids
        ids += piece
        trained += [train] * len(piece)
    return ids, trained
