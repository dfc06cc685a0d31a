"""BERT's masking for masked language modelling (Devlin et al. 2019, section 3.1 and appendix A.1).

A fixed share of each sequence's tokens is selected for prediction (15%); of those, 80% are
replaced by ``[MASK]``, 10% by a random token and 10% left unchanged, so the model cannot learn
that only ``[MASK]`` positions matter. Only selected positions carry a loss: the targets hold
``IGNORE_INDEX`` everywhere else.

As in BERT's own data generation (``create_pretraining_data.py``), each sequence gets exactly
``max(1, round(rate x length))`` selected positions rather than an independent coin per token:
the rate is exact per sequence, and no batch is ever without a prediction. The random draws come
from a generator the caller seeds per batch, so the masks are a function of (seed, batch) alone
and a resumed run masks exactly as the uninterrupted one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from trident.data.special_tokens import IGNORE_INDEX
from trident.errors import ConfigError, is_number


@dataclass(frozen=True)
class Masking:
    """Share of tokens selected for prediction, and how the selected inputs are corrupted
    (``mask_fraction`` -> ``[MASK]``, ``random_fraction`` -> a random token, the rest unchanged)."""

    rate: float = 0.15
    mask_fraction: float = 0.8
    random_fraction: float = 0.1

    def __post_init__(self) -> None:
        if not is_number(self.rate) or not 0.0 < self.rate < 1.0:
            raise ConfigError(f"task.mask_rate must be in (0, 1), got {self.rate!r}: use e.g. task.mask_rate=0.15")
        fractions = {"mask_token_fraction": self.mask_fraction, "random_token_fraction": self.random_fraction}
        for name, value in fractions.items():
            if not is_number(value) or not 0.0 <= value <= 1.0:
                raise ConfigError(f"task.{name} must be in [0, 1], got {value!r}: BERT uses 0.8 [MASK] and 0.1 random")
        total = self.mask_fraction + self.random_fraction
        if total > 1.0 + 1e-9:
            raise ConfigError(
                f"task.mask_token_fraction + task.random_token_fraction = {total:g} exceeds 1: they share the "
                "selected tokens with the unchanged ones (BERT: 0.8 + 0.1, 0.1 unchanged)"
            )

    def count(self, length: int) -> int:
        """Positions selected in a sequence of ``length`` tokens."""
        return max(1, round(self.rate * length))

    def check_room(self, block_size: int) -> None:
        """A sequence must keep at least one unselected token as context for its predictions."""
        if self.count(block_size) >= block_size:
            raise ConfigError(
                f"task.mask_rate={self.rate:g} selects {self.count(block_size)} of the {block_size} tokens of a block "
                f"(data.block_size): no context is left to predict from; raise data.block_size or lower task.mask_rate"
            )


def masking_generator(device: torch.device, *key: int) -> torch.Generator:
    """A generator on ``device`` seeded from ``key`` (e.g. seed, stage, batch counter, rank):
    well-mixed seeds for neighbouring keys, and never the global random state."""
    seed = int(np.random.SeedSequence(list(key)).generate_state(1, dtype=np.uint64)[0])
    return torch.Generator(device=device).manual_seed(seed)


def mask_tokens(
    ids: Tensor,
    masking: Masking,
    *,
    mask_id: int,
    num_regular_tokens: int,
    generator: torch.Generator,
) -> tuple[Tensor, Tensor]:
    """``ids``: (B, T) token ids, every one real (MLM data are packed blocks, without padding).

    Returns ``(inputs, targets)``, both (B, T): the corrupted inputs, and the original ids at the
    selected positions with ``IGNORE_INDEX`` elsewhere. Random replacements are drawn uniformly
    from the ``num_regular_tokens`` ids of the corpus vocabulary (no special tokens)."""
    count = masking.count(ids.size(1))
    scores = torch.rand(ids.shape, generator=generator, device=ids.device)
    # The `count` lowest scores of each row: a uniformly random subset of that size.
    ranks = scores.argsort(dim=1).argsort(dim=1)  # (B, T): rank of each position within its row
    selected = ranks < count
    action = torch.rand(ids.shape, generator=generator, device=ids.device)
    to_mask = selected & (action < masking.mask_fraction)
    to_random = selected & ~to_mask & (action < masking.mask_fraction + masking.random_fraction)
    random_ids = torch.randint(num_regular_tokens, ids.shape, generator=generator, device=ids.device)
    inputs = torch.where(to_mask, mask_id, torch.where(to_random, random_ids, ids))
    targets = ids.masked_fill(~selected, IGNORE_INDEX)
    return inputs, targets
