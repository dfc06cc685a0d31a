"""The contrastive image-text objective (``objective=contrastive``, CLIP: Radford et al. 2021), as open_clip's
``ClipLoss`` computes it with ``local_loss=False, gather_with_grad=True``.

Each image's features score against every text's of the batch (and each text against every image), scaled by the
network's learned temperature; the symmetric cross entropy trains the matching pairs (the diagonal) above the rest.
Under data parallelism every rank gathers the features of every rank (:func:`gather_features`, with gradients: the
backward of the gather sums each rank's gradient into the features it computed), so each rank holds the loss of the
global batch, of ``world_size * B`` pairs, not of its own B. That loss is handed to the one loss reduction
(trident.training.token_loss) as ``loss * B`` over B items: every rank returns the same global mean, the gather's
backward multiplies the local features' gradients by the ranks that used them (W) and DDP's average divides by W
again, so 2 processes train as 1 on the global batch. Gradient accumulation treats each micro-batch as a contrastive
batch of its own (open_clip's default without its feature cache). The batch of every rank must be equally long (the
gather needs one size: Lightning's distributed sampler pads the last batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from trident.objectives.base import Loss, Objective, Outputs, OutputSource
from trident.training.token_loss import data_parallel_group


@dataclass(frozen=True)
class PairedFeatures(Outputs):
    """The projected, L2-normalised features of B images and their B captions, and the temperature ``scale``
    (exp of the learned ``logit_scale``, clamped): ``logits`` are the images' scores against the texts (B, B) and
    ``targets`` their matching caption (B,), this rank's alone (what metrics on one batch read)."""

    image: Tensor  # (B, E)
    text: Tensor  # (B, E)
    scale: Tensor  # (1,) or ()


def paired_features(image: Tensor, text: Tensor, scale: Tensor) -> PairedFeatures:
    """``image`` and ``text`` (B, E), already normalised, with their local logits (B, B) and targets (B,)."""
    return PairedFeatures(scale * image @ text.T, torch.arange(image.size(0), device=image.device), image, text, scale)


def gather_features(image: Tensor, text: Tensor, group: Any) -> tuple[Tensor, Tensor]:
    """The features (B, E) of every rank of ``group`` stacked in rank order, (W * B, E), with gradients reaching each
    rank's own rows (``torch.distributed.nn.all_gather``: its backward sums the ranks' gradients of a rank's rows
    into that rank); ``group`` None: as they are."""
    if group is None or dist.get_world_size(group) == 1:
        return image, text
    from torch.distributed.nn import all_gather  # imports torch.distributed.nn's autograd functions on first use

    return torch.cat(all_gather(image, group=group), dim=0), torch.cat(all_gather(text, group=group), dim=0)


def contrastive_loss(image: Tensor, text: Tensor, scale: Tensor) -> Tensor:
    """CLIP's symmetric cross entropy over N pairs of normalised features (N, E): the mean over images of each
    image's loss of finding its text, and over texts of finding its image, averaged."""
    logits_per_image = scale * image @ text.T  # (N, N)
    targets = torch.arange(image.size(0), device=image.device)
    return (F.cross_entropy(logits_per_image, targets) + F.cross_entropy(logits_per_image.T, targets)) / 2


class Contrastive(Objective):
    """The symmetric image-text cross entropy over the global batch (task=clip's default)."""

    NAME = "contrastive"

    def forward(self, source: OutputSource, batch: Any, stage: str) -> tuple[Loss, Outputs]:
        outputs = source.outputs(batch, stage)
        assert isinstance(outputs, PairedFeatures), "objective=contrastive reads paired image and text features"
        # Validation and test gather too: their loss is then that of the global batch, whatever the ranks.
        image, text = gather_features(outputs.image, outputs.text, data_parallel_group(source))  # (W*B, E)
        return self.reduce(PairedFeatures(outputs.logits, outputs.targets, image, text, outputs.scale), stage), outputs

    def reduce(self, outputs: Outputs, stage: str) -> Loss:
        """``outputs``: the gathered features of the global batch, ``logits`` / ``targets`` this rank's (B of them):
        the global batch's mean loss times this rank's B, over B items (module docstring)."""
        assert isinstance(outputs, PairedFeatures)
        rows = outputs.targets.size(0)
        dtype = torch.promote_types(outputs.image.dtype, torch.float32)  # bf16 / fp16 features: the loss in fp32
        loss = contrastive_loss(outputs.image.to(dtype), outputs.text.to(dtype), outputs.scale.to(dtype))
        return Loss(loss * rows, torch.tensor(rows, device=loss.device))
