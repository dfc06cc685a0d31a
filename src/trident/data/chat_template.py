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
import gzip
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from trident.data.readers import format_suffix, open_text
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
# A template's answer blocks ({% generation %}...{% endgeneration %}: SmolLM3's, TRL's training templates).
GENERATION_BLOCK = re.compile(r"{%-?\s*generation\s*-?%}")
# Where a marked rendering's generation block starts and ends: Unicode noncharacters, which no text should hold.
GENERATION_MARKS = ("\ufdd0", "\ufdd1")
Message = dict[str, Any]  # role and content (text), and any other field of the file's message


@dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template with the values it may read beside ``messages`` (special tokens)."""

    source: str  # what data.template named, for error lines
    text: str
    special_tokens: dict[str, str]

    def render(self, messages: list[Message], add_generation_prompt: bool = False, marked: bool = False) -> str:
        """The conversation as text; ``marked``: each ``{% generation %}`` block's text between
        :data:`GENERATION_MARKS`."""
        from jinja2 import TemplateError  # jinja2 comes with torch; imported where a template is rendered

        try:
            # tools and documents None, as apply_chat_template passes them without any ("tools is none" holds).
            return _compiled(self.text, marked).render(messages=messages, tools=None, documents=None,
                                                       add_generation_prompt=add_generation_prompt, **self.special_tokens)
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
        """The rendered conversation as pieces of text, each with whether the loss trains on it. A template with
        ``{% generation %}`` blocks trains their text and nothing else, as transformers' ``assistant_masks`` (and so
        TRL's ``assistant_only_loss``) read it. Otherwise the text the template adds for an assistant turn after the
        generation prompt (the answer and its end marker) is trained, every other piece (system and user turns, role
        headers, the generation prompt) is not."""
        if GENERATION_BLOCK.search(self.text):
            return self._generation_segments(messages)
        pieces: list[tuple[str, bool]] = []
        done = ""
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self.render(messages[:i], add_generation_prompt=True)
            full = self.render(messages[: i + 1])
            self._check_continues(done, prompt, full)
            pieces += [(prompt[len(done):], False), (full[len(prompt):], True)]
            done = full
        # The whole conversation must continue its last answer too (turns after it, a template that renders the last
        # answer unlike an earlier one): else the pieces would not add up to the text the conversation renders as.
        whole = self.render(messages)
        self._check_continues(done, whole)
        rest = whole[len(done):]
        return [*pieces, (rest, False)] if rest else pieces

    def _generation_segments(self, messages: list[Message]) -> list[tuple[str, bool]]:
        """The conversation rendered once, cut at the marks of its ``{% generation %}`` blocks."""
        if any(mark in json.dumps(messages, ensure_ascii=False) for mark in GENERATION_MARKS):
            raise DataError(f"a conversation holds one of the characters {GENERATION_MARKS!r} that mark the answers of "
                            f"data.template={self.source}'s generation blocks: remove them from the data")
        start, end = GENERATION_MARKS
        pieces: list[tuple[str, bool]] = []
        for i, part in enumerate(self.render(messages, marked=True).split(start)):
            answer, _, rest = part.partition(end) if i else ("", "", part)
            pieces += [(text, trained) for text, trained in ((answer, True), (rest, False)) if text]
        return pieces

    def _check_continues(self, *renderings: str) -> None:
        """Each rendering starts with the one before it."""
        if not all(later.startswith(earlier) for earlier, later in pairwise(renderings)):
            raise DataError(f"the chat template of data.template={self.source} does not render a conversation as the "
                            "start of its continuation, so its answers cannot be told apart: use another template")


@functools.lru_cache(maxsize=8)
def _compiled(text: str, marked: bool = False) -> Any:
    """The template compiled as transformers compiles chat templates: ``raise_exception``, ``strftime_now`` (Llama
    3.1's date), ``tojson`` with its options, and the ``{% generation %}`` blocks that mark answers (rendered as
    their content)."""
    from datetime import datetime

    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        tags: ClassVar[set[str]] = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_content"), [], [], body).set_lineno(lineno)

        def _content(self, caller: Any) -> str:
            start, end = GENERATION_MARKS if marked else ("", "")
            return f"{start}{caller()}{end}"

    def raise_exception(message: str) -> None:
        from jinja2 import TemplateError

        raise TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return environment.from_string(text)


def read_template(choice: str | None, tokenizer_choice: str) -> ChatTemplate:
    """``data.template``: null takes the template of ``data.tokenizer`` when that is a tokenizer directory and
    :data:`DEFAULT_TEMPLATE` otherwise; ``default`` is that template; anything else is a tokenizer directory or a
    ``.jinja`` file, which reads the special tokens of ``data.tokenizer`` where that is a tokenizer directory (as
    ``apply_chat_template(chat_template=...)`` renders another template with the tokenizer's own)."""
    if choice is None:
        choice = tokenizer_choice if Path(tokenizer_choice).is_dir() else "default"
    if choice == "default":
        return ChatTemplate("default", DEFAULT_TEMPLATE, {})
    path = Path(choice)
    if path.is_file():
        tokenizer_dir = Path(tokenizer_choice)
        special = special_tokens_of(tokenizer_dir, _tokenizer_config(tokenizer_dir)) if tokenizer_dir.is_dir() else {}
        return ChatTemplate(choice, path.read_text(encoding="utf-8"), special)
    if not path.is_dir():
        raise ConfigError(f"data.template={choice} is neither default, a .jinja file nor a tokenizer directory: fix the path")
    config = _tokenizer_config(path)
    text = chat_template_of(path, config)
    if not text:
        raise ConfigError(f"data.template={choice}: the tokenizer directory has no chat template (neither chat_template "
                          "in tokenizer_config.json nor chat_template.jinja): give a .jinja file, or data.template=default")
    return ChatTemplate(choice, text, special_tokens_of(path, config))


def recorded_template(source: str, settings: Mapping[str, str]) -> ChatTemplate:
    """A template as a run records it (``tokenizer_settings``: ``chat_template`` and the special tokens, the keys of a
    tokenizer directory's ``tokenizer_config.json``), read as :func:`read_template` reads that directory."""
    return ChatTemplate(source, settings["chat_template"], {k: v for k, v in settings.items() if k.endswith("_token")})


def chat_template_of(directory: Path, config: dict[str, Any]) -> str | None:
    """A tokenizer directory's chat template, as transformers reads it: ``chat_template.jinja``, else
    ``chat_template`` of its ``tokenizer_config.json`` (``config``; of several named ones, the one named "default")."""
    if (directory / "chat_template.jinja").is_file():
        return (directory / "chat_template.jinja").read_text(encoding="utf-8")
    text = config.get("chat_template")
    if isinstance(text, list):
        text = next((t.get("template") for t in text if isinstance(t, dict) and t.get("name") == "default"), None)
    return text if isinstance(text, str) else None


def _tokenizer_config(directory: Path) -> dict[str, Any]:
    config_file = directory / "tokenizer_config.json"
    return json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}


def special_tokens_of(directory: Path, config: dict[str, Any]) -> dict[str, str]:
    """The special tokens (``bos_token``, ...) a tokenizer directory names, as transformers reads them: those of
    its ``tokenizer_config.json`` (``config``), and in an older directory (no ``added_tokens_decoder``) its
    ``special_tokens_map.json``'s over them; a token written as an AddedToken dict gives its content."""
    named = dict(config)
    legacy = directory / "special_tokens_map.json"
    if "added_tokens_decoder" not in config and legacy.is_file():
        named |= json.loads(legacy.read_text(encoding="utf-8"))
    return {k: v.get("content", "") if isinstance(v, dict) else v for k, v in named.items()
            if k.endswith("_token") and isinstance(v, (str, dict))}


def text_of(content: Any, where: str, role: str) -> str:
    """A message's ``content`` as text: a string as it is, or OpenAI's multi-part list (``[{"type": "text",
    "text": ...}, ...]``) with its text parts joined without a separator, as transformers' templates that read parts
    (Llama 3.2, Qwen2-VL, SmolVLM) write them one after another. Anything else (null, a number, an image part) is
    refused: its Python form would be trained as text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(part, dict) for part in content):
        other = [str(part.get("type")) for part in content if part.get("type") != "text" or not isinstance(part.get("text"), str)]
        if other:
            raise DataError(f"{where}: the {role} message has a content part of type {other[0]!r}: only text parts "
                            '({"type": "text", "text": "..."}) are read; drop the other parts or the row')
        return "".join(part["text"] for part in content)
    shown = "null" if content is None else type(content).__name__
    raise DataError(f"{where}: the {role} message's content is {shown}, not text: give a string (or a list of "
                    'text parts), or drop the row')


def _field(row: dict[str, Any], name: str, where: str) -> str:
    """An Alpaca field that must be text when given (null or absent: empty)."""
    value = row.get(name)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise DataError(f"{where}: {name!r} is a {type(value).__name__}, not text: write it as a string, or drop the row")
    return value


def conversation_of(row: Any, where: str) -> list[Message]:
    """One row of a chat file -> its messages: OpenAI-style ``{"messages": [{"role", "content", ...}]}`` (content a
    string or a list of text parts, :func:`text_of`; the other fields kept for the template), or Alpaca-style ``{"instruction", "input", "output"}``
    (the input, when given, after the instruction and a blank line, as Alpaca's prompt puts it; an optional
    ``system``). A row without an answer, or with a null or empty one, is one error line naming it."""
    if isinstance(row, dict) and "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "content" in m for m in messages):
            raise DataError(f"{where}: 'messages' must be a list of {{role, content}} objects: fix that row")
        for message in messages:
            if message.get("role") not in ROLES:
                raise DataError(f"{where}: role {message.get('role')!r} is not one of {', '.join(ROLES)}: "
                                "rename the role (tool and function turns are not read)")
        # Every field passes through, as apply_chat_template passes the messages (a template may read a message's
        # name, reasoning_content, ...); the content as text.
        conversation = [{**m, "content": text_of(m["content"], where, m["role"])} for m in messages]
    elif isinstance(row, dict) and "instruction" in row and "output" in row:
        if row["output"] is None:
            raise DataError(f"{where}: the answer ('output') is null, nothing to train on: write the answer, or drop the row")
        instruction, given = _field(row, "instruction", where), _field(row, "input", where)
        asked = instruction + (f"\n\n{given}" if given else "")
        conversation = [{"role": "user", "content": asked}, {"role": "assistant", "content": _field(row, "output", where)}]
        if system := _field(row, "system", where):
            conversation.insert(0, {"role": "system", "content": system})
    else:
        raise DataError(f"{where} has neither 'messages' nor 'instruction' and 'output': give each row "
                        "messages=[{role, content}, ...] (OpenAI style) or instruction/input/output (Alpaca style)")
    answers = [m["content"] for m in conversation if m["role"] == "assistant"]
    if not answers:
        raise DataError(f"{where} has no assistant message, nothing to train on: add the answer, or drop the row")
    if not all(answer.strip() for answer in answers):
        raise DataError(f"{where} has an empty answer, which would train only the template's end marker: write the "
                        "answer, or drop the row")
    return conversation


def read_conversations(path: Path) -> list[list[Message]]:
    """A ``.jsonl`` file (one conversation a line) or a ``.json`` file (a list of them, Alpaca's layout), either
    gzip-compressed or not."""
    if not path.is_file():
        raise DataError(f"data.files: {path} not found: give .jsonl or .json chat files")
    try:
        with open_text(path) as handle:  # gzip-compressed (chats.jsonl.gz) as every text reader of data.files reads it
            text = handle.read()
    except (gzip.BadGzipFile, EOFError) as err:
        raise DataError(f"{path} is not gzip data ({err}): decompress it with gunzip, or drop the .gz from its name") from None
    except UnicodeDecodeError as err:
        raise DataError(f"{path} is not UTF-8 text ({err.reason} at byte {err.start}): save it as UTF-8") from None
    try:
        if format_suffix(path) == ".json":
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
    """Token ids of the rendered conversation and, for each, whether the loss trains on it. The whole text is
    encoded at once, as ``transformers``' ``apply_chat_template(tokenize=True)`` encodes it (no post-processor's
    extra tokens: the template writes any beginning-of-text token itself; ``tokenizer`` is a
    :func:`~trident.data.tokenization.plain_encoder`), so a SentencePiece-style tokenizer sees no word start at the
    joints of the template's pieces; a token is trained when its characters overlap a trained piece of
    :meth:`ChatTemplate.segments` (``apply_chat_template``'s ``assistant_masks`` rule)."""
    spans: list[tuple[int, int]] = []
    text = ""
    for piece, train in template.segments(messages):
        if train:
            spans.append((len(text), len(text) + len(piece)))
        text += piece
    encoding = tokenizer.encode(text, add_special_tokens=False)
    trained = [any(start < end and token_end > start and token_start < end for start, end in spans)
               for token_start, token_end in encoding.offsets]
    return list(encoding.ids), trained
