"""Masked-LM data: the language-modelling corpora, tokenizers and cache, cut into packed blocks
without next-token targets, and a vocabulary extended by ``[MASK]`` and ``[PAD]``.

The special tokens are appended to the cached tokenizer after loading, so their ids come after
the corpus vocabulary, the cached token arrays are shared with ``task=lm`` runs on the same data,
and no corpus token is ever one of them. Masking itself happens per batch in the task
(:mod:`trident.data.masking`), from a seeded generator.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from tokenizers import AddedToken
from torch import Tensor
from torch.utils.data import Dataset

from trident.data.lm import LMDataModule
from trident.data.special_tokens import MASK_TOKEN, PAD_TOKEN, SEQ_MASK_TOKEN
from trident.data.token_files import PAD_NAMES

# The mask token: trident's, or RoBERTa's where a tokenizer that came with its weights holds it (the padding: PAD_NAMES).
MASK_NAMES = (MASK_TOKEN, SEQ_MASK_TOKEN)


class TokenBlocks(Dataset[Tensor]):
    """Non-overlapping windows of ``block_size`` tokens (RoBERTa's full-sentence packing: text
    runs on across sentence and document boundaries, so no position is padding)."""

    def __init__(self, ids: np.ndarray, block_size: int) -> None:
        self.ids = ids
        self.block_size = block_size

    def __len__(self) -> int:
        return len(self.ids) // self.block_size

    def __getitem__(self, index: int) -> Tensor:
        start = index * self.block_size
        return torch.from_numpy(self.ids[start : start + self.block_size].astype(np.int64))  # (T,)


class MLMDataModule(LMDataModule):
    """:class:`LMDataModule` for ``task=mlm``: the same data options (``data=shakespeare``,
    ``bible_kjv``, ``text_files``, hub corpora; ``data.tokenizer=char`` or ``bpe``)."""

    num_regular_tokens: int = 0  # the corpus vocabulary, before the special tokens
    mask_token, pad_token = MASK_TOKEN, PAD_TOKEN  # the tokenizer's (load_splits)

    def load_splits(self, meta: dict[str, Any]) -> dict[str, str]:
        sizes = super().load_splits(meta)
        assert self.tokenizer is not None
        # Without added tokens: a tokenizer that came with MLM weights has [MASK] and [PAD] already.
        self.num_regular_tokens = self.tokenizer.get_vocab_size(with_added_tokens=False)
        # Byte-level BPE carries a word's leading space inside its token ("Ġbe"): "[MASK]" absorbs the
        # space before it (lstrip, as RoBERTa's), so "to [MASK]" stands for "to" + "Ġbe", not "Ġ" + "be".
        # A character tokenizer keeps the space as a token of its own.
        # A tokenizer that came with ALBERT's or RoBERTa's weights names them <pad> (and <mask>): those are used.
        self.mask_token, self.pad_token = (next((name for name in names if self.tokenizer.token_to_id(name) is not None),
                                                names[0]) for names in (MASK_NAMES, PAD_NAMES))
        held = {token.content for token in self.tokenizer.get_added_tokens_decoder().values()}
        mask = AddedToken(self.mask_token, lstrip=self.tokenizer_kind == "bpe", special=True)
        self.tokenizer.add_special_tokens([token for token in (mask, AddedToken(self.pad_token, special=True))
                                           if token.content not in held or token.content in (MASK_TOKEN, PAD_TOKEN)])
        return sizes

    def blocks(self, split: str) -> Dataset:
        return TokenBlocks(self.splits[split], self.block_size)

    def task_inputs(self) -> dict[str, Any]:
        inputs = super().task_inputs()
        inputs.pop("sample_prompts")  # prompts to continue: a causal LM's, not a masked LM's
        assert self.tokenizer is not None
        return {
            **inputs,
            "mask_id": self.tokenizer.token_to_id(self.mask_token),
            "pad_id": self.tokenizer.token_to_id(self.pad_token),
            "num_regular_tokens": self.num_regular_tokens,
        }
