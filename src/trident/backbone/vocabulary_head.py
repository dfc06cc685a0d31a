"""A vocabulary head and what it reads, before it has scored anything: the logits of a language model are
``linear(hidden) + bias``, capped at +-``softcap`` (Gemma 2), and at a vocabulary of 50 k they are the largest
tensor of a training step (B x T x V, in fp32 for the softmax). A network asked for its scores chunk by chunk
(``chunk`` > 0, ``task.loss_chunk``) returns this instead of the logits: the loss then scores ``chunk`` rows at a
time (trident.training.chunked_loss) and never holds the whole batch's logits; :meth:`VocabularyHead.logits` gives
them whole where something needs them all (a metric, a preference objective's sequence log-probabilities).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class VocabularyHead:
    """The last layer of a vocabulary head, ``linear``, and the hidden states it scores: logits (..., V) =
    ``linear(hidden) + bias``, then ``softcap * tanh(logits / softcap)`` where ``softcap`` is set.

    Every row of ``linear``'s weight is scored, a padded token table's (``task.embedding_rows``) too, as the
    network's forward does. A tied head's weight is the token embedding's: gradients reach the shared matrix.
    """

    hidden: Tensor  # (..., D): what ``linear`` reads (T5 v1.0's rescaled decoder output, BERT's transformed one)
    linear: nn.Linear  # weight (V, D), its own bias (V,) or None
    bias: Tensor | None = None  # (V,) a fixed vector added to the logits (BART's final_logits_bias, a buffer)
    softcap: float | None = None  # model.final_logit_softcap (Gemma 2)
    chunk: int = 0  # rows per chunk of the loss (task.loss_chunk); 0: the loss of the whole logits

    def logits(self) -> Tensor:
        """(..., V): the whole logits, exactly as the network's forward returns them."""
        logits = self.linear(self.hidden)
        if self.bias is not None:
            logits = logits + self.bias
        return logits if self.softcap is None else torch.tanh(logits / self.softcap) * self.softcap


def scored(head: VocabularyHead) -> Tensor | VocabularyHead:
    """What a network's forward returns for ``head``: the logits, or with a chunked loss (``head.chunk`` > 0) the
    head itself, scored by the loss."""
    return head if head.chunk else head.logits()
