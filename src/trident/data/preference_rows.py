"""Preference rows as TRL reads them: a prompt and two answers, the chosen and the rejected, in TRL's two formats.

- standard: ``{"prompt": str, "chosen": str, "rejected": str}``;
- conversational: ``{"prompt": [messages], "chosen": [messages], "rejected": [messages]}`` (messages as data=chat
  reads them: ``{role, content}``, roles system, user, assistant).

Either with an implicit prompt (no ``prompt``): ``chosen`` and ``rejected`` are then whole texts or conversations,
and the prompt is their longest common start (TRL's ``extract_prompt``: whole turns of a conversation; the
characters of a text, less a space it ends in). Each row is encoded as TRL's ``DPOTrainer`` encodes it
(:func:`encode_pair`). Every problem with a row is one :class:`DataError` line that names it.
"""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer

from trident.data.chat_template import ROLES, ChatTemplate, Message, text_of
from trident.data.readers import expand, files_by_split, is_saved_dataset, load_table, saved_splits
from trident.errors import DataError

ANSWERS = ("chosen", "rejected")
# The columns of TRL's unpaired preference format (KTO's): one answer, desirable (label true) or not.
UNPAIRED = ("prompt", "completion", "label")
# A row: its prompt and answers (texts, or lists of messages) and where it is, for error lines.
Row = dict[str, Any]


def read_rows(files: Any) -> dict[str, list[Row]]:
    """``data.files`` (a path, a list, or ``{train: ..., validation: ..., test: ...}``; JSONL, JSON, parquet, CSV
    files, or a ``save_to_disk`` directory) -> the rows of each split it gives, each with ``where`` it is."""
    import datasets

    by_split = files_by_split(files)
    tables: dict[str, list[tuple[Any, str]]] = {}
    for split, paths in by_split.items():
        for path in (p for given in paths for p in expand(given)):
            loaded = load_table(path, [])
            if isinstance(loaded, datasets.DatasetDict):
                if len(by_split) > 1 or len(paths) > 1 or not is_saved_dataset(path):
                    raise DataError(f"{path} holds a DatasetDict ({', '.join(loaded)}): give it as the only data.files path")
                for name, table in saved_splits(loaded, path).items():
                    tables.setdefault(name, []).append((table, f"{path} split {name}"))
            else:
                tables.setdefault(split, []).append((loaded, str(path)))
    rows: dict[str, list[Row]] = {}
    kinds: dict[bool, str] = {}  # whether a table is unpaired -> the first such table
    for split, parts in tables.items():
        for table, place in parts:
            unpaired = "completion" in table.column_names
            kinds.setdefault(unpaired, place)
            if len(kinds) > 1:
                raise DataError(f"{kinds[True]} holds unpaired rows (prompt, completion, label) and {kinds[False]} pairs "
                                "(prompt, chosen, rejected): give every file in one format")
            wanted = UNPAIRED if unpaired else ANSWERS
            missing = [column for column in wanted if column not in table.column_names]
            if missing:
                raise DataError(f"{place} has no {missing[0]!r} column (its columns: {', '.join(table.column_names)}): "
                                + ("give each row a 'prompt', a 'completion' and a boolean 'label' (true: desirable)"
                                   if unpaired else "give each row 'chosen' and 'rejected' answers (and a 'prompt', or "
                                   "let it be their common start)"))
            read = example_of if unpaired else pair_of
            rows.setdefault(split, []).extend(read(row, f"{place} row {i + 1}") for i, row in enumerate(table.to_list()))
    return rows


def _messages(value: Any, where: str, field: str) -> list[Message]:
    """A conversational field as messages: their role and content as data=chat reads them, other fields kept
    where a row gives them (a table fills the fields other rows have with null: those are dropped)."""
    if not all(isinstance(m, dict) and "content" in m for m in value):
        raise DataError(f"{where}: {field!r} must be a list of {{role, content}} messages or a text: fix that row")
    messages = []
    for message in value:
        if message.get("role") not in ROLES:
            raise DataError(f"{where}: role {message.get('role')!r} in {field!r} is not one of {', '.join(ROLES)}: "
                            "rename the role")
        kept = {key: item for key, item in message.items() if item is not None}
        messages.append({**kept, "content": text_of(message["content"], where, message["role"])})
    return messages


def extract_prompt(chosen: Any, rejected: Any) -> tuple[Any, Any, Any]:
    """TRL's ``extract_prompt``: the longest common start of the two answers (turns of a conversation, characters
    of a text, less the space a text's prompt ends in), and each answer without it."""
    index = 0
    for index in range(min(len(chosen), len(rejected))):
        if chosen[index] != rejected[index]:
            if chosen[index - 1] == " ":  # the space before the answer belongs to it
                index -= 1
            break
    return chosen[:index], chosen[index:], rejected[index:]


def pair_of(row: dict[str, Any], where: str) -> Row:
    """One table row -> ``{"prompt", "chosen", "rejected", "conversational", "where"}``, checked: both answers
    given, of one format, not empty and not the same."""
    for field in ANSWERS:
        if row.get(field) is None:
            raise DataError(f"{where} has no {field!r} answer: give both 'chosen' and 'rejected', or drop the row")
    conversational = isinstance(row["chosen"], list)
    values = {field: row.get(field) for field in ("prompt", *ANSWERS)}
    for field, value in values.items():
        if value is not None and isinstance(value, list) != conversational:
            raise DataError(f"{where}: {field!r} is {'a text' if conversational else 'a list'} where 'chosen' is "
                            f"{'a list of messages' if conversational else 'a text'}: give every field in one format")
        if value is not None and not isinstance(value, (list, str)):
            raise DataError(f"{where}: {field!r} is a {type(value).__name__}: give a text or a list of messages")
    if conversational:
        values = {field: None if value is None else _messages(value, where, field) for field, value in values.items()}
    prompt, chosen, rejected = values["prompt"], values["chosen"], values["rejected"]
    if prompt is None:
        prompt, chosen, rejected = extract_prompt(chosen, rejected)
    if chosen == rejected:
        raise DataError(f"{where}: 'chosen' and 'rejected' are the same answer, which no preference can be learnt "
                        "from: fix the row or drop it")
    for field, answer in (("chosen", chosen), ("rejected", rejected)):
        text = "".join(m["content"] for m in answer) if conversational else answer
        if not text.strip():
            raise DataError(f"{where}: the {field!r} answer is empty: write it, or drop the row")
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected, "conversational": conversational, "where": where}


def example_of(row: dict[str, Any], where: str) -> Row:
    """One unpaired table row -> ``{"prompt", "completion", "label", "conversational", "where"}``, checked: a
    prompt and a completion of one format, the completion not empty, the label a boolean."""
    for field in UNPAIRED:
        if row.get(field) is None:
            raise DataError(f"{where} has no {field!r}: give each unpaired row a prompt, a completion and a label "
                            "(true: desirable, false: undesirable), or drop the row")
    label = row["label"]
    if not isinstance(label, bool):
        raise DataError(f"{where}: 'label' is {label!r}: give true (a desirable completion) or false (an undesirable one)")
    conversational = isinstance(row["completion"], list)
    values = {field: row[field] for field in ("prompt", "completion")}
    for field, value in values.items():
        if not isinstance(value, list if conversational else str):
            raise DataError(f"{where}: {field!r} is {'not a list of messages' if conversational else 'not a text'} where "
                            f"'completion' is {'a list of messages' if conversational else 'a text'}: give both in one format")
    if conversational:
        values = {field: _messages(value, where, field) for field, value in values.items()}
    text = "".join(m["content"] for m in values["completion"]) if conversational else values["completion"]
    if not text.strip():
        raise DataError(f"{where}: the 'completion' is empty: write it, or drop the row")
    return {**values, "label": label, "conversational": conversational, "where": where}


def common_prefix_length(first: list[int], second: list[int]) -> int:
    length = 0
    for a, b in zip(first, second):
        if a != b:
            break
        length += 1
    return length


def encode_pair(encoder: Tokenizer, template: ChatTemplate | None, pair: Row, eos_token: str | None) -> tuple[list[int], ...]:
    """A pair's token ids as TRL's ``DPOTrainer`` makes them -> (prompt, chosen answer, rejected answer): see
    :func:`encode_answers`."""
    prompt, answers = encode_answers(encoder, template, pair["prompt"], [pair[field] for field in ANSWERS],
                                     pair["conversational"], eos_token)
    return prompt, *answers


def encode_answers(encoder: Tokenizer, template: ChatTemplate | None, prompt: Any, answers: list[Any],
                   conversational: bool, eos_token: str | None) -> tuple[list[int], list[list[int]]]:
    """A prompt's and its answers' token ids as TRL's ``DPOTrainer`` and ``KTOTrainer`` make them -> (prompt,
    [each answer]).

    Conversational: the prompt rendered with the generation prompt, and the prompt followed by each answer, through
    the chat template (no special tokens added: the template writes them). Standard: the texts as they are, each
    answer ending in the tokenizer's ``eos_token`` when it has one, encoded with its special tokens (as a Hugging
    Face tokenizer's call). The prompt is the tokens the prompt alone and every whole sequence start with (a token
    merged across the joint belongs to the answers); ``encoder`` is a :func:`~trident.data.tokenization.plain_encoder`.
    """
    if conversational:
        assert template is not None, "a conversation's data has a chat template (PreferenceDataModule checks it)"

        def ids(messages: list[Message], asking: bool = False) -> list[int]:
            text = template.render(messages, add_generation_prompt=asking)
            return list(encoder.encode(text, add_special_tokens=False).ids)

        prompt_ids = ids(prompt, asking=True)
        wholes = [ids(prompt + answer) for answer in answers]
    else:
        def answer_text(text: str) -> str:
            return text if not eos_token or text.endswith(eos_token) else text + eos_token

        prompt_ids = list(encoder.encode(prompt).ids)
        wholes = [list(encoder.encode(prompt + answer_text(answer)).ids) for answer in answers]
    length = min(common_prefix_length(prompt_ids, whole) for whole in wholes)
    return prompt_ids[:length], [whole[length:] for whole in wholes]


def fit_pair(prompt: list[int], chosen: list[int], rejected: list[int], max_prompt_length: int | None,
             max_length: int) -> tuple[tuple[list[int], list[int], list[int]] | None, bool]:
    """A pair cut to at most ``max_length`` tokens per sequence, keeping its answers (:func:`fit_answers`) -> (the
    pair or None where it was dropped, whether it was cut). A pair whose answers are cut to the same tokens is
    dropped (None)."""
    prompt, (chosen, rejected), cut = fit_answers(prompt, [chosen, rejected], max_prompt_length, max_length)
    if chosen == rejected:
        return None, cut
    return (prompt, chosen, rejected), cut


def fit_answers(prompt: list[int], answers: list[list[int]], max_prompt_length: int | None,
                max_length: int) -> tuple[list[int], list[list[int]], bool]:
    """A prompt and its answers cut to at most ``max_length`` tokens per sequence, keeping the answers -> (the
    prompt, the answers, whether any was cut). The prompt keeps its last ``max_prompt_length`` tokens (its start
    goes, the turns or words farthest from the answer); where the prompt and the longest answer still exceed
    ``max_length`` the prompt's start goes further, down to one token (which predicts the answer's first); an answer
    still too long loses its end."""
    cut = False
    if max_prompt_length is not None and len(prompt) > max_prompt_length:
        prompt, cut = prompt[len(prompt) - max_prompt_length :], True
    longest = max(len(answer) for answer in answers)
    if len(prompt) + longest > max_length:
        keep = max(1, max_length - longest)
        room = max_length - min(keep, len(prompt))
        prompt, answers, cut = prompt[len(prompt) - min(keep, len(prompt)) :], [a[:room] for a in answers], True
    return prompt, answers, cut
