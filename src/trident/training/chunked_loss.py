"""A cross-entropy that never holds the whole batch's logits: the head's matmul and the softmax computed ``chunk``
tokens at a time (``task.loss_chunk``), forward and backward, with Liger-Kernel's fused kernel where it is installed
and the tensors are on a GPU.

Why: at a vocabulary of 50,304 the logits of 64 x 1,024 tokens are 13 GB in fp32, held for the backward with
the softmax's output and its gradient; their softmax took 11 % of an H200's time in the LM (docs/gpu.md). Here a
chunk's logits live while the chunk is scored and are gone before the next one.

How (:class:`_ChunkedCrossEntropy`, the torch version): the gradient of the loss with respect to each chunk's
logits is known as soon as the chunk is scored (softmax - the smoothed target), so the forward computes the
gradients of the hidden states, the head's weight and bias chunk by chunk (as Liger's kernel does) and the backward
only scales them by the gradient of the loss (a scalar). The step costs the three matmuls of the plain head (no
recomputation) and holds the hidden states' gradient (N, D) and the weight's (V, D) in fp32 instead of the logits.
Without gradients (validation, or nothing to train) only the loss is computed, chunk by chunk.

Precision: each chunk's matmuls run in the dtype the head's would (autocast's under bf16 / fp16 autocast, else the
hidden states'); the logits, the softmax and the loss are fp32, as the plain loss's ``.float()``; the weight's and
bias's gradients are summed over the chunks in fp32.
"""

from __future__ import annotations

import importlib.util
import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor

from trident.backbone import VocabularyHead
from trident.errors import ConfigError, is_int

#: The default ``task.loss_chunk``: tokens scored at a time. The logits of a chunk at a vocabulary of 50,304 are
#: 200 MB in fp32; a chunk larger than the batch's tokens is the whole batch in one piece.
DEFAULT_LOSS_CHUNK = 1024
LIGER = importlib.util.find_spec("liger_kernel") is not None


def check_loss_chunk(value: object) -> int:
    """``task.loss_chunk`` as tokens per chunk (0 or null: the plain loss on the whole logits), or one line."""
    if value is None:
        return 0
    if not is_int(value) or value < 0:  # type: ignore[operator]
        raise ConfigError(f"task.loss_chunk must be a whole number of tokens >= 0 (0 or null: the plain loss on the "
                          f"whole logits), got {value!r}: set e.g. task.loss_chunk={DEFAULT_LOSS_CHUNK}")
    return int(value)  # type: ignore[call-overload]


def chunked_cross_entropy(head: VocabularyHead, targets: Tensor, *, ignore_index: int,
                          label_smoothing: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """The cross entropy of ``head``'s logits against ``targets`` (its hidden states' shape less the last axis;
    ``ignore_index`` where nothing trains), scored ``head.chunk`` rows at a time. With ``label_smoothing`` eps
    the target is (1 - eps) * one_hot + eps / V over every row of the head (``F.cross_entropy``'s, and
    trident.training.losses.label_smoothed_cross_entropy's). Returns the loss and the plain NLL, each summed over the
    trained targets (0 where there is none), and their count."""
    hidden = head.hidden.flatten(0, -2)  # (N, D)
    flat = targets.flatten()  # (N,)
    count = flat.ne(ignore_index).sum()
    weight = head.linear.weight  # (V, D)
    if isinstance(weight, DTensor):
        # A head split over devices (tensor parallelism's vocabulary plan): its own module scores the whole batch,
        # through the plan's hooks that gather the pieces, as the plain loss does.
        return _plain(head.logits().flatten(0, -2), flat, ignore_index, label_smoothing) + (count,)
    bias = head.linear.bias if head.bias is None else (head.bias if head.linear.bias is None
                                                       else head.linear.bias + head.bias)  # (V,) or None
    if LIGER and hidden.is_cuda and label_smoothing == 0.0:
        # Liger's kernel returns the loss only: with label smoothing the NLL part needs the torch version.
        loss = _liger(hidden, weight, bias, flat, ignore_index, head.softcap)
        if loss is not None:
            return loss, loss.detach(), count
    chunk = head.chunk or max(1, hidden.size(0))  # 0: the whole batch in one piece (of at least a row)
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))):
        with torch.no_grad():
            loss, nll = _scores(hidden, weight, bias, flat, ignore_index, label_smoothing, head.softcap, chunk, None)
        return loss, nll, count
    loss, nll = _ChunkedCrossEntropy.apply(hidden, weight, bias, flat, ignore_index, label_smoothing, head.softcap,
                                           chunk)
    return loss, nll, count


def _plain(logits: Tensor, flat: Tensor, ignore_index: int, label_smoothing: float) -> tuple[Tensor, Tensor]:
    """The summed loss and NLL of whole (N, V) ``logits``."""
    loss = F.cross_entropy(logits.float(), flat, ignore_index=ignore_index, label_smoothing=label_smoothing,
                           reduction="sum")
    nll = loss if label_smoothing == 0.0 else F.cross_entropy(logits.detach().float(), flat, ignore_index=ignore_index,
                                                              reduction="sum")
    return loss, nll


def _liger(hidden: Tensor, weight: Tensor, bias: Tensor | None, flat: Tensor, ignore_index: int,
           softcap: float | None) -> Tensor | None:
    """Liger-Kernel's fused linear cross entropy (Triton, CUDA), summed over the trained targets; None where the
    installed Liger has no functional API taking ``reduction`` by name (the torch version then scores the head).

    Its functional API, by keyword, not ``LigerFusedLinearCrossEntropyLoss``: versions of that module accept
    ``reduction`` and do not pass it on (a mean where the sum is asked, silently 1 / tokens of the gradient), and the
    Function's positional order changed between versions. The weight's gradient is summed over Liger's chunks in fp32
    (``accum_dtype``, where this Liger takes it), as the torch version's is; else in the head's dtype. Liger computes
    the weight's and bias's gradients only beside the states' (its ``input_requires_grad``): a head that trains on
    states that do not is left to the torch version too."""
    if torch.is_grad_enabled() and not hidden.requires_grad and any(
            t is not None and t.requires_grad for t in (weight, bias)):
        return None
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy as fused
    except ImportError:
        return None
    names = inspect.signature(fused).parameters
    if not {"input", "weight", "target", "bias", "ignore_index", "reduction"} <= names.keys():
        return None  # an older alias of the Function's apply: positional only
    if softcap is not None and "softcap" not in names:
        return None
    dtype = _compute_dtype(hidden)
    settings: dict[str, Any] = {"ignore_index": ignore_index, "reduction": "sum"}
    if softcap is not None:
        settings["softcap"] = softcap
    if "accum_dtype" in names:
        settings["accum_dtype"] = torch.float32
    with torch.autocast(hidden.device.type, enabled=False):  # the kernel takes the head's dtype, not autocast's
        loss = fused(input=hidden.to(dtype), weight=weight.to(dtype), target=flat,
                     bias=None if bias is None else bias.to(dtype), **settings)
    loss = loss[0] if isinstance(loss, tuple) else getattr(loss, "loss", loss)  # newer versions return a record
    return loss.float()


def _compute_dtype(hidden: Tensor) -> torch.dtype:
    """The dtype the head's matmul runs in: autocast's where it is on, else the hidden states'."""
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype


def _wide(dtype: torch.dtype) -> torch.dtype:
    """fp32 for the logits and sums of a half-precision head (float64 stays float64: a reference computation)."""
    return torch.promote_types(dtype, torch.float32)


def _scores(hidden: Tensor, weight: Tensor, bias: Tensor | None, flat: Tensor, ignore_index: int, epsilon: float,
            softcap: float | None, chunk: int, grads: tuple[Tensor | None, Tensor | None, Tensor | None] | None,
            ) -> tuple[Tensor, Tensor]:
    """The summed loss and NLL, ``chunk`` rows at a time; where ``grads`` are given (the hidden states', the
    weight's, the bias's gradient buffers, None where not wanted), the loss's gradients are written into them."""
    dtype = _compute_dtype(hidden)
    w = weight.to(dtype)  # (V, D) cast once, as autocast caches its cast of a weight
    b = None if bias is None else bias.to(dtype)
    vocab, wide = weight.size(0), _wide(dtype)
    loss = torch.zeros((), dtype=wide, device=hidden.device)
    nll_sum = torch.zeros((), dtype=wide, device=hidden.device)
    with torch.autocast(hidden.device.type, enabled=False):
        for start in range(0, hidden.size(0), chunk):
            h = hidden[start : start + chunk].to(dtype)  # (n, D)
            y = flat[start : start + chunk]  # (n,)
            keep = y.ne(ignore_index)  # (n,)
            logits = F.linear(h, w, b).to(wide)  # (n, V) fp32, as the plain loss's .float()
            if softcap is not None:
                logits = torch.tanh(logits / softcap) * softcap
            log_probs = logits.log_softmax(dim=-1)  # (n, V)
            safe = y.masked_fill(~keep, 0)  # any valid row; the ignored ones are masked out below
            nll = -log_probs.gather(1, safe[:, None]).squeeze(1) * keep  # (n,)
            nll_sum += nll.sum()
            if epsilon:
                smooth = -log_probs.mean(dim=-1) * keep  # (n,) the cross entropy against the uniform distribution
                loss += (1.0 - epsilon) * nll.sum() + epsilon * smooth.sum()
            else:
                loss += nll.sum()
            if grads is None:
                continue
            # d loss / d logits of a trained row: softmax - (1 - eps) * one_hot - eps / V. An ignored row's is 0: its
            # rows of the (n, D) states and of their gradient are zeroed below, not the (n, V) rows here (a pass
            # over the chunk's logits, as long as half a matmul on a GPU).
            del log_probs, nll  # one (n, V) tensor less while the gradient is made
            # softmax, not log_probs.exp(): on a CPU torch's softmax is a fused vectorised kernel, its exp an
            # elementwise one six times slower (measured: 0.2 s against 1.25 s for 1,024 x 50,304).
            grad = logits.softmax(dim=-1)
            if epsilon:
                grad -= epsilon / vocab
            grad.scatter_add_(1, safe[:, None], torch.full_like(grad[:, :1], -(1.0 - epsilon)))
            if softcap is not None:  # through cap * tanh(u / cap): d/du = 1 - (logits / cap)^2
                grad *= 1.0 - (logits / softcap).square()
            del logits
            grad = grad.to(dtype)  # (n, V) the matmuls' dtype, as the plain head's backward under autocast
            trained = keep[:, None].to(dtype)  # (n, 1)
            grad_hidden, grad_weight, grad_bias = grads
            if grad_hidden is not None:
                grad_hidden[start : start + chunk] = (grad @ w) * trained  # (n, D)
            if grad_weight is not None:
                if grad_weight.dtype == grad.dtype:  # fp32: added in place, no (V, D) temporary
                    grad_weight.addmm_(grad.T, h * trained)
                else:  # a bf16 / fp16 chunk's product, summed in fp32
                    grad_weight += grad.T @ (h * trained)
            if grad_bias is not None:
                grad_bias += (trained.T @ grad).squeeze(0)  # (V,) summed in fp32
    return loss, nll_sum


class _ChunkedCrossEntropy(torch.autograd.Function):
    """The chunked loss with the gradients computed in the forward (see the module's docstring): inputs hidden (N, D),
    weight (V, D), bias (V,) or None, targets (N,); outputs the summed loss and the summed NLL (not differentiable:
    a part the task logs)."""

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, flat: Tensor, ignore_index: int,
                epsilon: float, softcap: float | None, chunk: int) -> tuple[Tensor, Tensor]:
        wants, dtype = ctx.needs_input_grad, _compute_dtype(hidden)
        grads = (torch.empty(hidden.shape, dtype=dtype, device=hidden.device) if wants[0] else None,
                 torch.zeros(weight.shape, dtype=_wide(dtype), device=weight.device) if wants[1] else None,
                 torch.zeros(bias.shape, dtype=_wide(dtype), device=bias.device)
                 if bias is not None and wants[2] else None)
        loss, nll = _scores(hidden, weight, bias, flat, ignore_index, epsilon, softcap, chunk, grads)
        ctx.save_for_backward(*(g if g is not None else torch.empty(0) for g in grads))
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(nll)
        return loss, nll

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor, grad_nll: Tensor | None) -> tuple[Tensor | None, ...]:
        scaled = tuple(g.mul(grad_loss).to(dtype) if wanted and dtype is not None else None
                       for g, wanted, dtype in zip(ctx.saved_tensors, ctx.needs_input_grad[:3], ctx.dtypes))
        return (*scaled, None, None, None, None, None)
