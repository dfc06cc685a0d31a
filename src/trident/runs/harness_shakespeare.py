"""The questions of the shipped harness tasks beyond the next line (:mod:`trident.runs.harness_tasks` writes them and
their YAML): which play a passage is from, the last word of a line, and the rest of a line. Each is drawn with a
seeded ``random.Random`` from texts of "SPEAKER:\\nline\\n...\\n\\n" speeches (:func:`trident.data.corpora.play_to_text`).
"""

from __future__ import annotations

import random
import re

# A line's last word (letters and apostrophes) and the punctuation after it.
LAST_WORD = re.compile(r"^(?P<before>.*\S) (?P<word>[A-Za-z][A-Za-z']*)[,.;:!?]*$")
MIN_WORDS = 6  # a line to complete: long enough to give a start and leave a rest


def speeches(text: str) -> list[list[str]]:
    """The speeches of ``text``, each [speaker line, its lines...] with at least two lines; a cut one (no speaker) is
    left out."""
    blocks = [block.split("\n") for block in text.split("\n\n")]
    return [[line for line in block if line.strip()] for block in blocks
            if block[0].endswith(":") and sum(1 for line in block[1:] if line.strip()) >= 2]


def play_items(plays: list[tuple[str, str]], rng: random.Random, items: int, lines: int,
               choices: int) -> list[dict[str, object]]:
    """``items`` questions over (title, text) plays: up to ``lines`` lines of a speech (the speaker's name left out,
    which would name the play's characters), then which of ``choices`` titles it is from (the others: other plays)."""
    titles = sorted({title for title, _ in plays})
    by_play = [(title, speeches(text)) for title, text in plays]
    questions = []
    for _ in range(items):
        title, play = rng.choice(by_play)
        speech = rng.choice(play)[1:]
        start = rng.randrange(max(1, len(speech) - lines + 1))
        options = [title, *rng.sample([t for t in titles if t != title], choices - 1)]
        rng.shuffle(options)
        questions.append({"passage": "\n".join(speech[start: start + lines]) + "\n",
                          "choices": [f" {option}" for option in options], "answer": options.index(title)})
    return questions


def cloze_items(text: str, rng: random.Random, items: int, lines: int) -> list[dict[str, object]]:
    """``items`` questions over ``text``: a speaker, up to ``lines - 1`` lines of the speech and a line without its last
    word; the answer is that word (with its leading space; the punctuation after it dropped), as LAMBADA's."""
    places = [(speech, j) for speech in speeches(text) for j in range(1, len(speech)) if LAST_WORD.match(speech[j])]
    questions = []
    for place in sorted(rng.sample(range(len(places)), min(items, len(places)))):  # in the text's order
        speech, j = places[place]
        match = LAST_WORD.match(speech[j])
        assert match is not None
        before = speech[max(1, j - lines + 1): j]
        questions.append({"context": "\n".join([speech[0], *before, match["before"]]), "word": " " + match["word"]})
    return questions


def completion_items(text: str, rng: random.Random, items: int, lines: int) -> list[dict[str, object]]:
    """``items`` questions over ``text``: a speaker, up to ``lines - 1`` lines and the first half of a line's words;
    the answer is the rest of that line (with its leading space), which a model generates up to the line's end."""
    places = [(speech, j) for speech in speeches(text) for j in range(1, len(speech))
              if len(speech[j].split()) >= MIN_WORDS]
    questions = []
    for place in sorted(rng.sample(range(len(places)), min(items, len(places)))):  # in the text's order
        speech, j = places[place]
        words = speech[j].split()
        half = len(words) // 2
        before = speech[max(1, j - lines + 1): j]
        questions.append({"prompt": "\n".join([speech[0], *before, " ".join(words[:half])]),
                          "target": " " + " ".join(words[half:])})
    return questions
