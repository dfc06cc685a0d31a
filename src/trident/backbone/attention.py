"""Multi-head scaled dot-product attention with a fused fast path and an explicit path."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from trident.backbone.kv_cache import LayerKVCache
from trident.backbone.masks import causal_mask
from trident.backbone.positional import apply_rotary
from trident.errors import ConfigError, choose

# model.sdpa_backend: the kernel torch.nn.attention.sdpa_kernel forces; "auto" lets SDPA choose. On
# CPU only math and flash (a CPU flash kernel) exist; efficient and cudnn are CUDA kernels.
SDPA_KERNELS: dict[str, SDPBackend | None] = {
    "auto": None,
    "math": SDPBackend.MATH,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}
# How PyTorch says that the forced kernel refuses these inputs: the CPU dispatcher's and the CUDA
# dispatcher's wording (the latter after warnings that name the kernel's reasons, e.g. a mask).
NO_KERNEL_MESSAGES = ("No viable backend", "No available kernel")


class MultiHeadAttention(nn.Module):
    """Self-attention (one fused QKV projection) or cross-attention (Q from x, K/V from context).

    ``impl="sdpa"`` calls :func:`torch.nn.functional.scaled_dot_product_attention`, which picks
    flash / memory-efficient kernels where available; ``impl="explicit"`` writes out
    softmax(QK^T / sqrt(d_k) + mask) V and can return the attention weights. Both agree.
    ``sdpa_backend`` forces one SDPA kernel (``math``, ``flash``, ``efficient``, ``cudnn``);
    ``auto`` lets PyTorch choose per call.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        cross: bool = False,
        bias: bool = True,
        attn_dropout: float = 0.0,
        impl: str = "sdpa",
        sdpa_backend: str = "auto",
    ) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.cross = cross
        self.impl = impl
        self.compute = choose(ATTENTION_IMPLS, impl, "model.attn_impl")
        self.sdpa_backend = sdpa_backend
        self.kernel = choose(SDPA_KERNELS, sdpa_backend, "model.sdpa_backend")
        self.attn_dropout = attn_dropout
        if cross:
            self.q_proj = nn.Linear(d_model, d_model, bias=bias)
            self.kv_proj = nn.Linear(d_model, 2 * d_model, bias=bias)
        else:
            self.qkv_proj = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)

    def _split_heads(self, x: Tensor) -> Tensor:
        batch, length, _ = x.shape
        return x.view(batch, length, self.n_heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)

    def _project(
        self, x: Tensor, context: Tensor | None, cache: LayerKVCache | None, rope: tuple[Tensor, Tensor] | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        if self.cross:
            q = self._split_heads(self.q_proj(x))
            if cache is not None and cache.memory is not None:
                return q, *cache.memory  # encoder keys/values were projected on the first step
            if context is None:
                raise ValueError("cross-attention needs a context (the encoder output)")
            k, v = (self._split_heads(t) for t in self.kv_proj(context).chunk(2, dim=-1))
            if cache is not None:
                cache.memory = (k, v)
            return q, k, v
        q, k, v = (self._split_heads(t) for t in self.qkv_proj(x).chunk(3, dim=-1))
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        if cache is not None:
            k, v = cache.append(k, v)  # cached keys are stored already rotated
        return q, k, v

    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        *,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
        rope: tuple[Tensor, Tensor] | None = None,
        cache: LayerKVCache | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """``x``: (B, T, D). ``attn_mask``: boolean allowed mask or additive float mask broadcastable
        to (B, nh, Tq, Tk). Returns the output (B, T, D) and, on the explicit path, the weights."""
        batch, length, d_model = x.shape
        q, k, v = self._project(x, context, cache, rope)  # (B, nh, T, hs)
        if attn_mask is not None and attn_mask.is_floating_point():
            attn_mask = attn_mask.to(q.dtype)  # SDPA wants the float mask in the query's dtype
        dropout_p = self.attn_dropout if self.training else 0.0
        compute = MultiHeadAttention._explicit if need_weights else self.compute  # only the explicit path has weights
        y, weights = compute(self, q, k, v, attn_mask, is_causal, dropout_p)  # (B, nh, Tq, hs)
        y = y.transpose(1, 2).reshape(batch, length, d_model)  # (B, T, nh*hs)
        return self.out_proj(y), weights

    def _sdpa(
        self, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, is_causal: bool, dropout_p: float
    ) -> tuple[Tensor, None]:
        if self.kernel is None:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal)
            return y, None
        try:
            with sdpa_kernel(self.kernel):
                y = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal
                )
            return y, None
        except RuntimeError as err:
            if not any(message in str(err) for message in NO_KERNEL_MESSAGES):
                raise
            kernels = ("on a CPU only math and flash exist" if q.device.type == "cpu"
                       else "math takes every input; flash takes no mask tensor and only fp16/bf16")
            raise ConfigError(
                f"model.sdpa_backend={self.sdpa_backend} has no kernel for these inputs (device {q.device.type}, "
                f"{q.dtype}, head size {q.size(-1)}, {_mask_kind(attn_mask, is_causal)}): use model.sdpa_backend=auto, "
                f"or a kernel that takes them ({kernels})"
            ) from None

    def _explicit(
        self, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, is_causal: bool, dropout_p: float
    ) -> tuple[Tensor, Tensor]:
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)  # (B, nh, Tq, Tk)
        if is_causal:
            attn_mask = causal_mask(q.size(2), k.size(2), q.device)
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                scores = scores.masked_fill(~attn_mask, float("-inf"))
            else:
                scores = scores + attn_mask
        # A query that may see no key at all (left padding) has an all -inf row, whose softmax is
        # NaN in the forward and the backward. Such rows get finite scores before the softmax and
        # zero weight after it, as SDPA does: zero output, and zero gradient to q, k and the bias.
        blind = torch.isneginf(scores).all(dim=-1, keepdim=True)  # (B, nh, Tq, 1)
        scores = scores.masked_fill(blind, 0.0)
        # Softmax in fp32 even under autocast: exp(-inf) is exactly 0, so masked keys get zero weight.
        weights = torch.softmax(scores.float(), dim=-1).masked_fill(blind, 0.0).to(q.dtype)
        y = F.dropout(weights, p=dropout_p) @ v  # (B, nh, Tq, hs)
        return y, weights


# model.attn_impl: name -> how the attention is computed (both return (output, weights or None)).
ATTENTION_IMPLS = {"sdpa": MultiHeadAttention._sdpa, "explicit": MultiHeadAttention._explicit}


def _mask_kind(attn_mask: Tensor | None, is_causal: bool) -> str:
    """How the inputs are masked, in the words of the refusal message."""
    if attn_mask is None:
        return "causal, no mask tensor" if is_causal else "no mask"
    return f"{'boolean' if attn_mask.dtype == torch.bool else 'float bias'} mask"
