"""Chat with a language model in the terminal: each turn goes through the run's chat template (``data=chat``'s
``data.template``, else trident's default), the answer streams token by token until the template's end marker,
and one KV cache holds the whole conversation, so a turn feeds only its new tokens.

    trident-chat outputs/runs/<date>/<run>                      # interactive: an empty line or Ctrl-D ends
    trident-chat <run> --message "Continue ROMEO's speech:
    But soft, what light through yonder window breaks?" --message "And then?"   # one turn per --message
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from trident.data.chat_template import ChatTemplate, Message, read_template
from trident.errors import run_with_clear_errors
from trident.weights.run_config import run_config_of

if TYPE_CHECKING:
    from torch import Tensor

    from trident.tasks.base import TridentTask

# torch, the tokenizers and the task are imported once the arguments are parsed: ``--help`` answers without them.


class Chat:
    """A conversation with ``task``'s model: the messages so far, the text the KV cache holds, the cache."""

    def __init__(self, task: TridentTask, template: ChatTemplate, *, max_new_tokens: int, temperature: float,
                 top_k: int | None, top_p: float | None, seed: int) -> None:
        import torch

        from trident.data.tokenization import plain_encoder

        assert task.tokenizer is not None  # load_task_checkpoint refuses a text task's checkpoint without one
        # Turns are encoded as the training text is: without the file's padding and truncation (and no special tokens).
        self.task, self.tokenizer, self.template = task, plain_encoder(task.tokenizer), template
        self.sampling = {"temperature": temperature, "top_k": top_k, "top_p": top_p,
                         "generator": torch.Generator().manual_seed(seed)}
        self.max_new_tokens = max_new_tokens
        self.end_marker = template.end_marker()
        # Longest sequence the model serves; None (a rolling sliding-window cache): no limit.
        self.context = task.net.context_length
        self.messages: list[Message] = []
        self._restart()

    def _restart(self) -> None:
        self.fed_text = ""  # the conversation as text, as far as the cache holds it
        self.fed_ids: list[int] = []  # the tokens in the cache
        self.cache = self.task.net.new_cache(self.context or 1 << 16)

    def _feed(self, ids: list[int]) -> Tensor:
        """Run ``ids`` through the model on top of the cache; the next-token logits (V,)."""
        import torch

        self.fed_ids += ids
        return self.task.net(torch.tensor([ids]), cache=self.cache)[0, -1]

    def reply(self, text: str, write: Callable[[str], None]) -> str:
        """The answer to the user's ``text``, written piece by piece to ``write`` as it is sampled (the end
        marker is not written); it joins the conversation."""
        import torch

        with torch.no_grad():
            return self._reply(text, write)

    def _reply(self, text: str, write: Callable[[str], None]) -> str:
        from trident.data.tokenization import decode
        from trident.models.sampling import sample_next_token

        self.messages.append({"role": "user", "content": text})
        prompt = self.template.render(self.messages, add_generation_prompt=True)
        # The whole conversation encoded at once, as the training data was (a SentencePiece-style tokenizer encodes
        # a piece alone with a word start of its own); the cache serves where it holds the start of those tokens.
        ids = self.tokenizer.encode(prompt, add_special_tokens=False).ids
        if not (prompt.startswith(self.fed_text) and ids[: len(self.fed_ids)] == self.fed_ids):
            self._restart()  # the template rewrote an earlier turn, or the answer's tokens encode otherwise
        if self.context is not None and len(ids) + self.max_new_tokens > self.context:
            # The model's context is full: keep the last question only.
            print(f"(the conversation outgrew the model's {self.context} tokens: starting afresh)", file=sys.stderr)
            self.messages = self.messages[-1:]
            self._restart()
            prompt = self.template.render(self.messages, add_generation_prompt=True)
            ids = self.tokenizer.encode(prompt, add_special_tokens=False).ids
        logits = self._feed(ids[len(self.fed_ids):])
        answer_ids: list[int] = []
        written = ""
        for _ in range(self.max_new_tokens):
            answer_ids.append(int(sample_next_token(logits[None], **self.sampling)))
            logits = self._feed(answer_ids[-1:])  # the cache holds every token of the answer, the end marker too
            text_so_far = decode(self.tokenizer, answer_ids)
            visible, ended = text_so_far.split(self.end_marker, 1)[0], self.end_marker in text_so_far
            # Withheld until told apart: the start of a marker, a character whose bytes are not all sampled yet.
            held = 0 if ended else max(_partial_marker(visible, self.end_marker), int(visible.endswith("\ufffd")))
            write(visible[len(written): len(visible) - held])
            written = visible[: len(visible) - held]
            if ended:
                break
        generated = decode(self.tokenizer, answer_ids)
        self.fed_text = prompt + generated
        answer = generated.split(self.end_marker, 1)[0]
        self.messages.append({"role": "assistant", "content": answer})
        return answer


def _partial_marker(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that starts ``marker``."""
    return next((n for n in range(min(len(marker) - 1, len(text)), 0, -1) if marker.startswith(text[-n:])), 0)


def run_template(checkpoint: Path, choice: str | None) -> ChatTemplate:
    """``--template``, else the template of the run's data settings (its ``data.template`` and ``data.tokenizer``)."""
    from omegaconf import OmegaConf

    config = run_config_of(checkpoint)
    data = OmegaConf.load(config).get("data", {}) if config is not None else {}
    if choice is not None:  # a .jinja file reads the special tokens of the run's tokenizer directory, as in training
        return read_template(choice, str(data.get("tokenizer", "char")))
    if config is not None:  # a template that came with init_from: read from the run's record of its source
        from trident.weights.init_from import run_source_template

        if (recorded := run_source_template(config.parent, data)) is not None:
            return recorded
    return read_template(data.get("template"), str(data.get("tokenizer", "char")))


def chat(session: Chat, messages: Iterable[str]) -> None:
    """Answer each message in turn, streaming each answer to stdout on a line of its own."""
    for message in messages:
        session.reply(message, lambda piece: (sys.stdout.write(piece), sys.stdout.flush()))
        sys.stdout.write("\n")


def ask() -> Iterable[str]:
    """The user's lines until an empty one or end of input."""
    while True:
        try:
            line = input("you> ")
        except EOFError:
            return
        if not line.strip():
            return
        yield line


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="trident-chat", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="a task=lm run directory or .ckpt (fine-tuned with data=chat, or not)")
    parser.add_argument("--message", action="append", default=None,
                        help="a user turn (repeat for several); without it, read turns from the terminal")
    parser.add_argument("--template", default=None,
                        help="default, a tokenizer directory or a .jinja file (default: the run's data.template)")
    parser.add_argument("--max-new-tokens", type=int, default=200, help="most tokens of one answer")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy decoding")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    def run() -> None:
        from trident.models.sampling import check_filters
        from trident.tasks.base import GENERATE
        from trident.weights.capable import load_capable
        from trident.weights.checkpoints import checkpoint_of

        check_filters(args.top_k, args.top_p, args.temperature)
        checkpoint = checkpoint_of(args.run)
        task = load_capable(checkpoint, GENERATE, "trident-chat")
        session = Chat(task, run_template(checkpoint, args.template), max_new_tokens=args.max_new_tokens,
                       temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
        chat(session, args.message if args.message is not None else ask())

    run_with_clear_errors(run)


if __name__ == "__main__":
    main()
