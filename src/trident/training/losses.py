"""Training losses shared by the tasks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def label_smoothed_cross_entropy(
    logits: Tensor, targets: Tensor, *, epsilon: float = 0.1, ignore_index: int | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Cross entropy against a smoothed target q = (1 - eps) * one_hot + eps / V (Szegedy et al.
    2016; the paper's eps_ls = 0.1): loss = (1 - eps) * NLL + eps * mean_v(-log p_v).

    ``logits``: (..., V); ``targets``: (...) with ``ignore_index`` at padding, which counts for
    nothing. Returns the loss and the plain NLL, each averaged over the real tokens, and the
    number of real tokens (so callers can weight batches by it). Same as
    ``F.cross_entropy(..., label_smoothing=eps)``, which also spreads eps over all V classes.
    """
    if not 0.0 <= epsilon < 1.0:
        raise ValueError(f"label smoothing must be in [0, 1), got {epsilon}")
    log_probs = F.log_softmax(logits.float(), dim=-1).flatten(0, -2)  # (N, V), fp32 even under autocast
    flat = targets.flatten()  # (N,)
    keep = flat != ignore_index if ignore_index is not None else torch.ones_like(flat, dtype=torch.bool)
    safe = flat.masked_fill(~keep, 0)  # any valid index; the padded rows are masked out below
    nll = -log_probs.gather(1, safe[:, None]).squeeze(1)  # (N,)
    smooth = -log_probs.mean(dim=-1)  # (N,)  the cross entropy against the uniform distribution
    n_tokens = keep.sum()
    denominator = n_tokens.clamp(min=1)
    nll_loss = (nll * keep).sum() / denominator
    smooth_loss = (smooth * keep).sum() / denominator
    return (1.0 - epsilon) * nll_loss + epsilon * smooth_loss, nll_loss, n_tokens
