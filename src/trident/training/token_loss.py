"""One loss reduction for every task: the summed token losses of an optimizer step divided by the number of
trained tokens in its global batch, over every micro-batch of gradient accumulation and every data-parallel
rank (transformers' Trainer does the same with ``num_items_in_batch``). A "token" is whatever the task trains
on: a target token (lm, mlm, translation), a sequence (classify) or an image (vit).

Why: a mean per micro-batch weighs each micro-batch alike, whatever it holds. Two micro-batches of 40 and
3,016 answer tokens then weigh each of the 40 tokens 75 times; Lightning divides by
``accumulate_grad_batches`` and DDP / FSDP average over ranks on top, so the accumulated or multi-rank gradient
was not the gradient of the batch as one.

How (:class:`StepLoss`): the count of the whole step is known only after its last micro-batch, so each
micro-batch's ``training_step`` returns its *summed* loss times a factor ``c``, the same for every micro-batch
and rank of a step (so the loss Lightning and the fp16 scaler see has the size of a
mean: ``c`` is 1 / the mean trained tokens of a rank's micro-batch in the previous step, or in the first
micro-batch that trained any); after the step's last backward, in
``on_before_optimizer_step`` (Lightning 2.x calls it after fp16 unscaling and before gradient clipping), the
gradients, which hold ``c / (A * W) * sum of the summed losses' gradients`` (Lightning's 1/A, the
data-parallel average's 1/W), are multiplied by ``A * W / (c * N)``, ``N`` the all-reduced count of trained
tokens. A step of 0 trained tokens has zero gradients (each micro-batch's sum is 0, never 0/0).

The data-parallel ranks are those that average gradients: every rank under DDP, the data-parallel dimension
of the device mesh under ``trainer=fsdp`` (the ranks of a tensor-parallel group share one batch, and count it
once).
"""

from __future__ import annotations

import math

import lightning as L
import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup
from torchmetrics import Metric

from trident.errors import DataError, TrainingDiverged
from trident.parallel.fsdp import DATA_PARALLEL


def data_parallel_group(module: L.LightningModule) -> ProcessGroup | None:
    """The process group the gradients of ``module`` are averaged over (None: a single process)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    mesh = module.device_mesh
    if mesh is not None and DATA_PARALLEL in (mesh.mesh_dim_names or ()):
        return mesh[DATA_PARALLEL].get_group()
    return dist.group.WORLD


def _all_reduce_sum(values: Tensor, group: ProcessGroup | None) -> Tensor:
    if group is not None:
        dist.all_reduce(values, op=dist.ReduceOp.SUM, group=group)
    return values


class StepLoss:
    """The loss of one optimizer step over its micro-batches and data-parallel ranks, and the training
    metrics logged with it (each a weighted sum and its weight, e.g. a token-weighted NLL)."""

    LOSS = "train/loss"

    def __init__(self) -> None:
        #: ``c``: 1 / the mean count of a rank's micro-batch, from the first micro-batch that trained a token, then
        #: from each step as it ends (checkpointed: a resumed run's loss keeps its size for the fp16 scaler). Fixed
        #: from the first micro-batch for good, a first micro-batch of 0 or 1 tokens made every later loss a sum
        #: of thousands (fp16 gradients then overflow and the scaler skips steps until it has shrunk).
        self.scale: float | None = None
        self._sums: dict[str, tuple[Tensor, Tensor]] = {}  # name -> (weighted sum, weight), this rank's, this step
        #: The metrics of the last optimizer step :meth:`finish` ended (the learning-rate finder records its loss).
        self.last_step: dict[str, float] = {}

    def micro_batch(self, summed: Tensor, count: Tensor, group: ProcessGroup | None) -> Tensor:
        """What ``training_step`` returns for a micro-batch whose ``count`` trained tokens have the summed
        loss ``summed`` (a scalar with its graph)."""
        if self.scale is None:  # the same on every rank: the count is global
            counts = _all_reduce_sum(count.detach().double().reshape(1).clone(), group)
            ranks = dist.get_world_size(group) if group is not None else 1
            if counts[0] > 0:  # a sum over no token has zero gradients whatever it is multiplied by
                self.scale = ranks / float(counts[0])
        self.add(self.LOSS, summed.detach(), count)
        return summed * (self.scale or 1.0)

    def add(self, name: str, total: Tensor | float, weight: Tensor | float) -> None:
        """Add ``total`` (a sum over ``weight`` items) to metric ``name`` of this step."""
        total_so_far, weight_so_far = self._sums.get(name, (0.0, 0.0))
        self._sums[name] = (total_so_far + torch.as_tensor(total).double(), weight_so_far + torch.as_tensor(weight).double())

    def finish(self, parameters: list[Tensor], accumulate: int, group: ProcessGroup | None) -> dict[str, float]:
        """At the step's end (every backward done): rescale the gradients of ``parameters`` to the global token
        mean and return the step's metrics (a metric of weight 0, nothing trained, is left out)."""
        names = list(self._sums)  # the same names in the same order on every rank: the same code logged them
        device = parameters[0].device if parameters else torch.device("cpu")
        values = torch.stack([torch.stack([torch.as_tensor(v, dtype=torch.float64) for v in self._sums[n]])
                              for n in names]).to(device) if names else torch.zeros(0, 2, dtype=torch.float64, device=device)
        values = _all_reduce_sum(values, group)
        self._sums = {}
        step = {n: (float(t), float(w)) for n, (t, w) in zip(names, values.tolist())}
        count = step.get(self.LOSS, (0.0, 0.0))[1]
        ranks = dist.get_world_size(group) if group is not None else 1
        if self.scale is not None:
            factor = accumulate * ranks / (self.scale * max(1.0, count))  # 0 tokens: the gradients are 0 already
            for param in parameters:
                if param.grad is not None:
                    param.grad.mul_(factor)
        if count > 0:
            self.scale = accumulate * ranks / count  # the next step's c (the ranks agree: the count is global)
        self.last_step = {n: t / w for n, (t, w) in step.items() if w > 0}
        return self.last_step


class TokenMean(Metric):
    """A loss over a whole validation or test epoch: summed losses over summed counts, over every batch and
    rank (not a mean of batch means, which weighs a batch of 3 tokens as one of 3,000)."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, total: Tensor, count: Tensor) -> None:
        self.total += total.detach().double()
        self.count += torch.as_tensor(count, device=self.count.device).double()

    def compute(self) -> Tensor:
        """(2,): the summed loss and the token count of every rank. The count is returned, not read from
        ``self.count`` afterwards: torchmetrics puts this rank's own states back once ``compute`` returns, and a
        rank that holds no trained token of a split others do would stop alone (the others waiting for it)."""
        return torch.stack([self.total, self.count])


def checked_mean_loss(metric: TokenMean, name: str, step: int) -> float:
    """``metric``'s epoch value (synced over ranks), reset for the next epoch. An epoch without a trained token,
    or a non-finite loss, stops the run in one line naming the cause: a NaN monitored by ModelCheckpoint would
    count as +inf, keep the worst checkpoint "best" and let the run report "completed"."""
    total, count = metric.compute().tolist()
    metric.reset()
    if count == 0:
        raise DataError(f"{name} has no token to average at step {step}: every target of the split is ignored "
                        "(e.g. chat rows whose prompt fills data.block_size, or rows of padding only): raise "
                        "data.block_size or give the split rows with trained targets")
    value = total / count
    if not math.isfinite(value):
        raise TrainingDiverged(f"{name} is {value} at step {step}: the model's predictions are not finite; lower "
                               "optimizer.lr, raise scheduler.warmup_steps, set trainer.gradient_clip_val, or use "
                               "precision=bf16 instead of fp16")
    return value


def perplexity(mean_loss: float) -> float:
    """exp of the token-weighted mean loss (infinite only when the loss is too large for a float)."""
    try:
        return math.exp(mean_loss)
    except OverflowError:
        return math.inf
