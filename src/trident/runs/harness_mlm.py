"""A masked language model (task=mlm, a BERT directory) in EleutherAI's evaluation harness: :class:`MaskedTridentLM`
scores a continuation by its pseudo-log-likelihood (Salazar et al. 2020, "Masked Language Model Scoring"): the context
and continuation encoded together, each continuation token masked in turn with every other token left as it is, and
the log-probabilities of the true tokens at their masks summed. It is not a normalised probability of the continuation
(a causal LM's chain rule does not hold: every term sees the tokens after it), so it ranks the choices of one question
(multiple choice, ``acc`` / ``acc_norm``) and compares masked LMs with one another, never with a causal LM.

``loglikelihood_rolling`` is the pseudo-log-likelihood of the whole text (every token masked once; its exponent of
minus the mean is the pseudo-perplexity), in windows of the model's context that each score new tokens only, the last
one filled up with the tokens before it. ``generate_until`` is refused: a masked LM does not generate text.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from tokenizers import Tokenizer

from trident.data.special_tokens import MASK_TOKEN, PAD_TOKEN
from trident.errors import DataError
from trident.models import MaskedLM

if TYPE_CHECKING:
    from trident.weights import PretrainedWeights

# A text the wrapping of a tokenizer's post-processor is found around (any text that encodes to a token or more).
PROBE = "a"


def wrapping(tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
    """The ids a tokenizer's post-processor puts before and after a text (BERT's ``[CLS]`` and ``[SEP]``, RoBERTa's
    ``<s>`` and ``</s>``; none for a trident run's tokenizer), as transformers encodes a text for a masked LM."""
    plain = tokenizer.encode(PROBE, add_special_tokens=False).ids
    full = tokenizer.encode(PROBE, add_special_tokens=True).ids
    start = next(i for i in range(len(full) - len(plain) + 1) if full[i: i + len(plain)] == plain)
    return full[:start], full[start + len(plain):]


class MaskedTridentLM(TemplateLM):
    """The harness's language-model interface over a trident ``MaskedLM`` (eval mode, no gradients), scoring by
    pseudo-log-likelihood. ``mask_id``: the ``[MASK]`` token; ``pad_id``: what pads a batch (hidden from attention);
    ``add_special_tokens``: whether each scored sequence is wrapped as the tokenizer's post-processor wraps a text
    (a Hugging Face directory's ``[CLS] ... [SEP]``) or left plain, as a trident run's training blocks were.
    ``batch_size`` counts masked sequences: a continuation of n tokens is n of them."""

    def __init__(self, net: MaskedLM, tokenizer: Tokenizer, *, mask_id: int, pad_id: int,
                 add_special_tokens: bool = False, batch_size: int = 1, name: str = "trident") -> None:
        super().__init__()
        self.net = net.eval()
        self.text_tokenizer = tokenizer
        self.mask_id, self.pad_id = mask_id, pad_id
        self.start, self.end = wrapping(tokenizer) if add_special_tokens else ([], [])
        self.batch_size = batch_size
        self.name = name
        self.max_length = net.cfg.max_seq_len
        self._device = next(net.parameters()).device

    @property
    def eot_token_id(self) -> int:
        # The harness's interface asks for one; pseudo-log-likelihood conditions on no prefix and nothing is generated.
        return self.end[-1] if self.end else self.pad_id

    @property
    def tokenizer_name(self) -> str:
        return self.name

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """The plain ids of ``string``: the wrapping, if any, goes around the whole scored sequence instead."""
        return self.text_tokenizer.encode(string, add_special_tokens=False).ids

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """Each (context, continuation) -> (its pseudo-log-likelihood, whether every masked token is the model's first
        choice). An empty context stays empty: a masked LM reads the continuation's both sides, it needs no prefix."""
        pairs = [([], self.tok_encode(continuation)) if context == "" else self._encode_pair(context, continuation)
                 for context, continuation in (request.args for request in requests)]
        return self.pseudo_log_likelihoods(pairs)

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Each text's pseudo-log-likelihood, every token masked once, in windows of the model's context that each
        score new tokens only (the last one with as many tokens before it as fit)."""
        room = self._room()
        pairs, owners = [], []
        for index, request in enumerate(requests):
            (text,) = request.args
            ids = self.tok_encode(text)
            for begin in range(0, len(ids), room):
                end = min(begin + room, len(ids))
                pairs.append((ids[max(0, end - room): begin], ids[begin:end]))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (score, _) in zip(owners, self.pseudo_log_likelihoods(pairs), strict=True):
            totals[owner] += score
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        raise DataError(f"{self.name} is a masked language model, which does not generate text: run tasks it scores "
                        "(multiple_choice, loglikelihood, loglikelihood_rolling), not generate_until ones")

    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        return self.pseudo_log_likelihoods([(context, continuation) for _, context, continuation in requests])

    def _room(self) -> int:
        """How many text tokens a scored sequence holds beside the wrapping."""
        room = self.max_length - len(self.start) - len(self.end)
        if room < 1:
            raise DataError(f"{self.name}'s context of {self.max_length} tokens leaves no room for text beside its "
                            f"{len(self.start) + len(self.end)} special tokens")
        return room

    @torch.no_grad()
    def pseudo_log_likelihoods(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """Each (context ids, continuation ids) -> (sum over the continuation's tokens of log p(token | the sequence
        with that token masked), whether each is the most likely token at its mask). The context keeps its last
        tokens that fit; ``batch_size`` masked sequences at a time, longest first, right-padded."""
        room = self._room()
        longest_continuation = max((len(continuation) for _, continuation in pairs), default=0)
        if longest_continuation > room:
            raise DataError(f"a continuation of {longest_continuation} tokens is longer than the {room} a sequence of "
                            f"{self.name} holds: it cannot score this task (its texts are too long for it)")
        # One row per continuation token: (its pair, the masked position, the sequence), scored longest first.
        rows: list[tuple[int, int, list[int]]] = []
        for index, (context, continuation) in enumerate(pairs):
            kept = context[max(0, len(context) + len(continuation) - room):]
            sequence = [*self.start, *kept, *continuation, *self.end]
            first = len(self.start) + len(kept)
            rows.extend((index, position, sequence) for position in range(first, first + len(continuation)))
        rows.sort(key=lambda row: -len(row[2]))
        totals, greedy = [0.0] * len(pairs), [True] * len(pairs)
        for begin in range(0, len(rows), self.batch_size):
            chunk = rows[begin: begin + self.batch_size]
            longest = len(chunk[0][2])
            ids = torch.tensor([seq + [self.pad_id] * (longest - len(seq)) for _, _, seq in chunk], device=self._device)
            padding = torch.tensor([[False] * len(seq) + [True] * (longest - len(seq)) for _, _, seq in chunk],
                                   device=self._device)  # (B, T) True at padding
            rows_index = torch.arange(len(chunk), device=self._device)
            positions = torch.tensor([position for _, position, _ in chunk], device=self._device)  # (B,)
            targets = ids[rows_index, positions].clone()  # (B,) the true tokens
            ids[rows_index, positions] = self.mask_id
            select = torch.zeros_like(padding)
            select[rows_index, positions] = True  # one position a row: the logits come back (B, V) in row order
            logits = self.net(ids, key_padding_mask=padding if padding.any() else None, select=select)
            log_probs = F.log_softmax(logits.float(), dim=-1)  # (B, V)
            scores = log_probs.gather(1, targets[:, None])[:, 0].tolist()
            hits = (log_probs.argmax(dim=-1) == targets).tolist()
            for (index, _, _), score, hit in zip(chunk, scores, hits, strict=True):
                totals[index] += score
                greedy[index] = greedy[index] and hit
        return list(zip(totals, greedy, strict=True))


def masked_run_model(checkpoint: Path, *, batch_size: int, chat: bool, device: torch.device | None) -> MaskedTridentLM:
    """The :class:`MaskedTridentLM` of a task=mlm checkpoint: its texts encoded plain, as its training blocks were."""
    from trident.tasks.base import FILL_MASK
    from trident.weights.capable import load_capable

    _no_chat(chat, str(checkpoint))
    task = load_capable(checkpoint, FILL_MASK, "trident-harness")
    if task.tokenizer is None:
        raise DataError(f"checkpoint {str(checkpoint)!r} holds no tokenizer: the harness scores texts")
    return MaskedTridentLM(task.net.to(device), task.tokenizer, mask_id=int(task.mask_id), pad_id=int(task.pad_id),
                           batch_size=batch_size, name=str(checkpoint))


def masked_directory_model(weights: PretrainedWeights, path: Path, *, batch_size: int, chat: bool,
                           device: torch.device | None) -> MaskedTridentLM:
    """The :class:`MaskedTridentLM` of a Hugging Face masked-LM directory (BERT) read into trident's ``MaskedLM``: each
    scored sequence wrapped as its tokenizer wraps a text (``[CLS] ... [SEP]``), as transformers encodes it."""
    from trident.backbone import TransformerConfig

    _no_chat(chat, str(path))
    tokenizer = weights.tokenizer
    if tokenizer is None or weights.vocab_size is None:
        raise DataError(f"{str(path)!r} holds no tokenizer: the harness scores texts")
    special = {name: tokenizer.token_to_id(weights.tokenizer_settings.get(name, token))
               for name, token in (("mask_token", MASK_TOKEN), ("pad_token", PAD_TOKEN))}
    if special["mask_token"] is None:
        raise DataError(f"{str(path)!r}'s tokenizer has no {MASK_TOKEN} token: pseudo-log-likelihood masks each "
                        "scored token with it")
    cfg = TransformerConfig(**weights.model, pos_encoding=weights.pos_encoding,
                            pos_encoding_options=weights.pos_encoding_options, dropout=0.0,
                            max_seq_len=weights.data_options["max_seq_len"])
    net = MaskedLM(cfg, weights.vocab_size, **weights.task_options)
    net.load_state_dict(weights.state_dict, strict=True)
    pad = special["pad_token"] if special["pad_token"] is not None else special["mask_token"]  # hidden either way
    return MaskedTridentLM(net.to(device), tokenizer, mask_id=special["mask_token"], pad_id=pad,
                           add_special_tokens=True, batch_size=batch_size, name=str(path))


def _no_chat(chat: bool, what: str) -> None:
    if chat:
        raise DataError(f"{what} is a masked language model, which has no chat template: run trident-harness without "
                        "--apply_chat_template")
