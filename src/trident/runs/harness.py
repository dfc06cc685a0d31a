"""EleutherAI's evaluation harness (``lm-eval``, the ``[eval]`` extra) on a trident language model: :class:`TridentLM`,
the harness's ``LM`` interface over a trident ``CausalLM`` and its tokenizer, and :func:`harness_model`, which reads one
from a trident run (through the GENERATE capability) or a Hugging Face directory.

Requests are scored as the harness's own ``hf`` model scores them, so the two agree on an exported model: a context
and its continuation encoded together and split where the context's tokens end (the harness's ``_encode_pair``), the
last ``max_length + 1`` tokens kept, an empty context replaced by the prefix token (BOS, else EOS), rolling windows
for ``loglikelihood_rolling``. Batches are sorted longest first and right-padded (a causal model's real tokens never
see right padding); ``generate_until`` left-pads its prompts and generates with the KV cache
(:func:`trident.models.generate` with ``padding``), stopping a batch once every row met a stop string or EOS.
A masked LM (a task=mlm run, a BERT directory) is scored by pseudo-log-likelihood instead (:mod:`.harness_mlm`).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import Collator, handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tokenizers import Tokenizer
from torch import Tensor

from trident.data.chat_template import ChatTemplate, Message
from trident.errors import DataError
from trident.models import CausalLM, generate
from trident.models.sampling import check_filters

# The longest context of a model whose sliding windows leave it none (its cache rolls on): the harness's own default.
UNBOUNDED_LENGTH = 2048
# What a run of a task that does not generate is evaluated with instead (task= name -> the commands).
OTHER_EVALUATIONS = {
    "translation": "trident-eval (test BLEU and chrF) or trident-translate",
    "vit": "trident-eval (test accuracy)",
    "classify": "trident-eval (test accuracy)",
    # Scored by trident-harness itself, but not during training (callbacks=harness evaluates causal LMs only).
    "mlm": "trident-harness on its checkpoint afterwards (pseudo-log-likelihood) or trident-eval",
}


class TridentLM(TemplateLM):
    """The harness's language-model interface over a trident ``CausalLM`` (eval mode, no gradients).

    ``eot_token_id``: the end of text (a stop of every generation); ``prefix_token_id``: what stands before a text
    scored from its first token (BOS, else EOS, as the ``hf`` model). ``add_special_tokens``: whether texts are
    encoded with the tokenizer's post-processor (a Hugging Face directory's BOS, as ``hf`` encodes) or plain, as a
    trident run's training text was.
    """

    def __init__(self, net: CausalLM, tokenizer: Tokenizer, *, eot_token_id: int, prefix_token_id: int,
                 add_special_tokens: bool = False, batch_size: int = 1, chat: ChatTemplate | None = None,
                 name: str = "trident") -> None:
        super().__init__()
        self.net = net.eval()
        self.text_tokenizer = tokenizer
        self._eot, self._prefix = eot_token_id, prefix_token_id
        self.add_special_tokens = add_special_tokens
        self.batch_size = batch_size
        self.chat = chat
        self.name = name
        self.max_length = net.context_length or UNBOUNDED_LENGTH
        self._device = next(net.parameters()).device

    @property
    def eot_token_id(self) -> int:
        return self._eot

    @property
    def prefix_token_id(self) -> int:
        return self._prefix

    @property
    def tokenizer_name(self) -> str:
        return self.name

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """``string``'s ids; by default with the tokenizer's own special tokens as :attr:`add_special_tokens` says,
        except on a text that already starts with the prefix token (a chat template's ``{{ bos_token }}``), which
        gets no second one (the ``hf`` model's rule)."""
        special = self.add_special_tokens if add_special_tokens is None else add_special_tokens
        if add_special_tokens is None and special:
            prefix = self.text_tokenizer.decode([self.prefix_token_id], skip_special_tokens=False)
            special = not (prefix and string.startswith(prefix))
        return self.text_tokenizer.encode(string, add_special_tokens=special).ids

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return None if self.chat is None else self.chat.text

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if self.chat is None:
            raise DataError(f"{self.name} has no chat template: run trident-harness without --apply_chat_template")
        messages: list[Message] = [{"role": turn["role"], "content": turn["content"]} for turn in chat_history]
        return self.chat.render(messages, add_generation_prompt=add_generation_prompt)

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        """Each (request, context ids, continuation ids) -> (log-probability of the continuation, whether greedy
        decoding gives it), in the requests' order; computed longest first, ``batch_size`` at a time."""
        results: list[tuple[float, bool]] = []
        longest_continuation = max((len(continuation) for _, _, continuation in requests), default=0)
        if longest_continuation > self.max_length:
            raise DataError(f"a continuation of {longest_continuation} tokens is longer than the model's context of "
                            f"{self.max_length}: {self.name} cannot score this task (its texts are too long for it)")
        order = Collator(requests, sort_fn=lambda r: (-len(r[1] + r[2]), tuple(r[1] + r[2])))
        for chunk in order.get_batched(n=self.batch_size):
            # The last max_length + 1 tokens: the model reads all but the last, each predicting the next one.
            inputs = [(context + continuation)[-(self.max_length + 1):][:-1] for _, context, continuation in chunk]
            longest = max(len(ids) for ids in inputs)
            batch = torch.tensor([ids + [0] * (longest - len(ids)) for ids in inputs], device=self._device)  # (B, T)
            log_probs = F.log_softmax(self.net(batch).float(), dim=-1)  # (B, T, V)
            for row, ids, (_, _, continuation) in zip(log_probs, inputs, chunk, strict=True):
                scored = row[len(ids) - len(continuation): len(ids)]  # (n, V): the continuation's predictions
                target = torch.tensor(continuation, device=self._device)
                total = scored.gather(1, target[:, None]).sum()
                results.append((float(total), bool((scored.argmax(dim=-1) == target).all())))
        return order.get_original(results)

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Each text's log-probability from its first token, in windows of ``max_length`` that each score new tokens
        only, with as much context as fits (the harness's ``get_rolling_token_windows``)."""
        scores = []
        for request in requests:
            (text,) = request.args
            windows = [make_disjoint_window(window) for window in get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                context_len=1)]
            scores.append(sum(score for score, _ in self._loglikelihood_tokens([(None, *w) for w in windows])))
        return scores

    @torch.no_grad()
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Each (context, generation settings) -> the text generated after it, cut before its first stop string (the
        request's ``until`` and the end of text) and at ``max_gen_toks`` tokens; greedy unless ``do_sample``."""
        results: list[str] = []
        order = Collator([request.args for request in requests], sort_fn=lambda r: (-len(self.tok_encode(r[0])), r[0]),
                         group_by="gen_kwargs", group_fn=lambda r: r[1])
        end_of_text = self.text_tokenizer.decode([self.eot_token_id], skip_special_tokens=False)
        for chunk in order.get_batched(n=self.batch_size):
            contexts, settings = zip(*chunk, strict=True)
            options = normalize_gen_kwargs(settings[0], 256)
            stops = handle_stop_sequences(options.pop("until", None), eos=end_of_text)
            new_tokens = int(options.pop("max_gen_toks"))
            sampling = {"temperature": float(options.get("temperature", 0.0)) if options.get("do_sample") else 0.0,
                        "top_k": options.get("top_k"), "top_p": options.get("top_p")}
            check_filters(sampling["top_k"], sampling["top_p"], sampling["temperature"])
            if new_tokens >= self.max_length:
                raise DataError(f"max_gen_toks={new_tokens} leaves no room for a prompt in the model's "
                                f"{self.max_length} positions: ask for fewer tokens")
            prompts = [self.tok_encode(context)[-(self.max_length - new_tokens):] for context in contexts]
            longest = max(len(ids) for ids in prompts)
            ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts], device=self._device)  # (B, T0)
            padding = torch.tensor([[True] * (longest - len(p)) + [False] * len(p) for p in prompts],
                                   device=self._device)
            stopped = partial(self._stopped, start=longest, stops=stops)
            out = generate(self.net, ids, new_tokens, padding=padding, until=stopped, **sampling)
            for row in out[:, longest:].tolist():
                # As the hf model decodes: up to the end of text, without special tokens (a generated <unk> or chat
                # marker is no text), then cut before the first stop string.
                row = row[: row.index(self.eot_token_id)] if self.eot_token_id in row else row
                text = self.text_tokenizer.decode(row, skip_special_tokens=True)
                results.append(postprocess_generated_text(generation=text, stop=stops, think_end_token=None))
        return order.get_original(results)

    def _stopped(self, tokens: Tensor, *, start: int, stops: list[str]) -> Tensor:
        """(B, T) tokens so far -> (B,) whether each row's text after ``start`` holds a stop string."""
        texts = (self.text_tokenizer.decode(row, skip_special_tokens=False) for row in tokens[:, start:].tolist())
        return torch.tensor([any(stop in text for stop in stops) for text in texts])


def special_ids(net: CausalLM, tokenizer: Tokenizer, settings: dict[str, str]) -> tuple[int, int]:
    """(end of text, prefix) ids: the tokens an export names the eos and bos (:func:`special_tokens`), else a
    newline's first token, which starts a line as a text's first token follows one."""
    from trident.weights.adapters.hf_export import special_tokens

    named = special_tokens(net, tokenizer, settings)
    ids = {name: tokenizer.token_to_id(token) for name, token in named.items()}
    fallback = (tokenizer.encode("\n", add_special_tokens=False).ids or [0])[0]
    eot = ids.get("eos_token", ids.get("bos_token", fallback))
    return eot, ids.get("bos_token", eot)


def harness_model(path: Path, *, batch_size: int, chat: bool, device: torch.device | None = None) -> TemplateLM:
    """The :class:`TridentLM` of a trident run or checkpoint, or of a Hugging Face causal-LM directory, on ``device``
    (default: the CPU); a masked LM's :class:`~trident.runs.harness_mlm.MaskedTridentLM`; a run or directory of another
    task refused in one line naming what evaluates it."""
    if (path / "config.json").is_file() and not (path / "checkpoints").is_dir():
        return _from_directory(path, batch_size=batch_size, chat=chat, device=device)
    from trident.runs.harness_mlm import masked_run_model
    from trident.tasks.base import FILL_MASK, GENERATE
    from trident.weights.capable import load_capable
    from trident.weights.checkpoints import checkpoint_of, read_checkpoint
    from trident.weights.task_class import task_class_of

    checkpoint = checkpoint_of(path)
    task_class = task_class_of(read_checkpoint(checkpoint, "the run argument", weights=False), checkpoint)
    if FILL_MASK in task_class.CAPABILITIES:
        return masked_run_model(checkpoint, batch_size=batch_size, chat=chat, device=device)
    if GENERATE not in task_class.CAPABILITIES:
        raise DataError(_refusal(str(checkpoint), task_class.NAME))
    template = _run_template(checkpoint) if chat else None  # before the weights are read: a refusal comes at once
    task = load_capable(checkpoint, GENERATE, "trident-harness")
    if task.tokenizer is None:
        raise DataError(f"checkpoint {str(checkpoint)!r} holds no tokenizer: the harness scores texts")
    eot, prefix = special_ids(task.net, task.tokenizer, task.tokenizer_settings)
    return TridentLM(task.net.to(device), task.tokenizer, eot_token_id=eot, prefix_token_id=prefix,
                     batch_size=batch_size, chat=template, name=str(checkpoint))


def _refusal(what: str, task: str) -> str:
    other = OTHER_EVALUATIONS.get(task, "trident-eval")
    return (f"{what} is a task={task} model, which the harness cannot score (it scores and generates text with a "
            f"language model: a task=lm or task=mlm run, a Hugging Face causal or masked LM directory): evaluate it with {other}")


def _from_directory(path: Path, *, batch_size: int, chat: bool, device: torch.device | None) -> TemplateLM:
    """A Hugging Face directory read into trident's ``CausalLM``, its texts encoded as transformers encodes them."""
    from trident.backbone import TransformerConfig
    from trident.data.chat_template import read_template
    from trident.weights import read_pretrained

    weights = read_pretrained(path)
    if weights.task == "mlm":
        from trident.runs.harness_mlm import masked_directory_model

        return masked_directory_model(weights, path, batch_size=batch_size, chat=chat, device=device)
    if weights.task != "lm":
        raise DataError(_refusal(str(path), weights.task))
    if weights.tokenizer is None or weights.vocab_size is None:
        raise DataError(f"{str(path)!r} holds no tokenizer: the harness scores texts")
    cfg = TransformerConfig(**weights.model, pos_encoding=weights.pos_encoding,
                            pos_encoding_options=weights.pos_encoding_options, dropout=0.0,
                            max_seq_len=weights.data_options["max_seq_len"])
    net = CausalLM(cfg, weights.vocab_size, **weights.task_options)
    net.load_state_dict(weights.state_dict, strict=True)
    eot, prefix = special_ids(net, weights.tokenizer, weights.tokenizer_settings)
    if chat and not weights.tokenizer_settings.get("chat_template"):
        raise DataError(f"--apply_chat_template: {str(path)!r} has no chat template (neither chat_template in "
                        f"tokenizer_config.json nor chat_template.jinja): run trident-harness without it")
    return TridentLM(net.to(device), weights.tokenizer, eot_token_id=eot, prefix_token_id=prefix, add_special_tokens=True,
                     batch_size=batch_size, chat=read_template(str(path), str(path)) if chat else None, name=str(path))


def _run_template(checkpoint: Path) -> ChatTemplate:
    """The template a run's conversations were rendered with, as trident-chat reads it (an ``init_from`` source's
    from the run's record, else its ``data.template``); a run of data with no conversations (no ``data.template``:
    plain text) is refused in one line rather than given trident's default template it never saw."""
    from omegaconf import OmegaConf

    from trident.data.chat_template import read_template
    from trident.weights.init_from import run_source_template
    from trident.weights.run_config import run_config_of

    config = run_config_of(checkpoint)
    if config is None:
        raise DataError(f"--apply_chat_template: {str(checkpoint)!r} is not in a train.py run directory (no "
                        "config_resolved.yaml above it) to read its chat template from: pass the run directory")
    data = OmegaConf.load(config).get("data", {})
    if "template" not in data:
        raise DataError(f"--apply_chat_template: {str(checkpoint)!r} was trained on data={data.get('name')}, not "
                        "conversations (data=chat): it has no chat template; run trident-harness without "
                        "--apply_chat_template")
    recorded = run_source_template(config.parent, data)
    return recorded or read_template(data.get("template"), str(data.get("tokenizer", "char")))
