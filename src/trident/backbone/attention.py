"""Multi-head scaled dot-product attention with a fused fast path and an explicit path."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from trident.backbone.kv_cache import LayerKVCache
from trident.backbone.linear_attention import LinformerProjection, PerformerFeatures
from trident.backbone.masks import causal_mask
from trident.backbone.parallel_plan import Columns, Heads, ParallelPlan, Rows, Split
from trident.backbone.positional import apply_rotary
from trident.errors import ConfigError, choose

# model.sdpa_backend: the kernel torch.nn.attention.sdpa_kernel forces; "auto" lets SDPA choose. On
# CPU only math and flash (a CPU flash kernel) exist; efficient and cudnn are CUDA kernels.
# "no_cudnn": auto's choice without cuDNN. PyTorch puts cuDNN first on Hopper/Blackwell with cuDNN > 9.15, and cuDNN
# builds an execution plan for each new shape (tens to hundreds of ms): batches that change shape every step
# (translation's token budgets) or every token (KV-cache decoding) would pay it each time (docs/gpu.md).
SDPA_KERNELS: dict[str, SDPBackend | list[SDPBackend] | None] = {
    "auto": None,
    "math": SDPBackend.MATH,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "no_cudnn": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
}
# How PyTorch says that the forced kernel refuses these inputs: the CPU dispatcher's and the CUDA
# dispatcher's wording (the latter after warnings that name the kernel's reasons, e.g. a mask).
NO_KERNEL_MESSAGES = ("No viable backend", "No available kernel")


class HeadShare(Protocol):
    """A rank's share of an attention module's heads (trident.parallel.tensor_parallel.HeadDropoutRNG)."""

    ranks: int  # the ranks the heads are split over

    def __call__(self, compute: Callable[..., tuple[Tensor, Tensor | None]], module: nn.Module, q: Tensor,
                 *args: Any) -> tuple[Tensor, Tensor | None]:
        """``compute(module, q, *args)`` on the rank's own random stream."""


class MultiHeadAttention(nn.Module):
    """Self-attention (one fused QKV projection) or cross-attention (Q from x, K/V from context).

    ``impl="sdpa"`` calls :func:`torch.nn.functional.scaled_dot_product_attention`, which picks
    flash / memory-efficient kernels where available; ``impl="explicit"`` writes out
    softmax(QK^T / sqrt(d_k) + mask) V and can return the attention weights. Both agree.
    ``sdpa_backend`` forces one SDPA kernel (``math``, ``flash``, ``efficient``, ``cudnn``);
    ``auto`` lets PyTorch choose per call.

    Grouped-query attention: ``n_kv_heads`` key/value heads (default ``n_heads``), query head h
    reading key/value head h // (n_heads / n_kv_heads); the KV cache holds the key/value heads only.
    ``head_dim`` (default d_model // n_heads) sets the width of every head apart from ``d_model``.
    ``qk_norm`` builds a norm of one head's width, applied to each head's queries and keys (one
    module for all query heads, one for all key heads, as Qwen3) before rope.
    ``scale_dim`` divides the scores by its square root instead of the head width's (Gemma's
    query_pre_attn_scalar); ``softcap`` caps them smoothly, cap * tanh(scores / cap), before the mask
    (Gemma 2), which SDPA cannot: a capped layer computes its attention on the explicit path.
    ``mixer`` (self-attention only, ``model.attention``): a :class:`PerformerFeatures` computes FAVOR+ instead of
    softmax; a :class:`LinformerProjection` projects the keys and values along the sequence before softmax attention.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        n_kv_heads: int | None = None,
        head_dim: int | None = None,
        cross: bool = False,
        qkv_bias: bool = True,
        out_bias: bool = True,
        qk_norm: Callable[[int], nn.Module] | None = None,
        attn_dropout: float = 0.0,
        impl: str = "sdpa",
        sdpa_backend: str = "auto",
        scale_dim: float | None = None,
        softcap: float | None = None,
        mixer: nn.Module | None = None,
    ) -> None:
        super().__init__()
        # All the heads, as configured: a tensor-parallel plan leaves them as built (n_heads: this rank's share).
        self.heads = n_heads
        self.kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        self.kv_group = n_heads // self.kv_heads  # query heads per key/value head (on every rank alike)
        self.head_dim = d_model // n_heads if head_dim is None else head_dim
        # SDPA's scale: None is its own 1/sqrt(head_dim), the same as the explicit path's default.
        self.scale = None if scale_dim is None else scale_dim**-0.5
        self.scale_dim = self.head_dim if scale_dim is None else scale_dim
        self.softcap = softcap
        self.cross = cross
        self.impl = impl
        self.compute = choose(ATTENTION_IMPLS, impl, "model.attn_impl")
        self.sdpa_backend = sdpa_backend
        self.kernel = choose(SDPA_KERNELS, sdpa_backend, "model.sdpa_backend")
        self.attn_dropout = attn_dropout
        # This rank's share of the heads, given by the parallel plan (its Heads split, trident.parallel.tensor_parallel):
        # how many ranks split the heads, and the attention (its dropout) run on the rank's own random stream, as each
        # rank holds other heads. None: every head here, on the default stream.
        self.head_rng: HeadShare | None = None
        q_width, kv_width = n_heads * self.head_dim, self.kv_heads * self.head_dim
        self.widths = (q_width, kv_width, kv_width)  # rows of the fused projection: [q; k; v], all heads
        if cross:
            self.q_proj = nn.Linear(d_model, q_width, bias=qkv_bias)
            self.kv_proj = nn.Linear(d_model, 2 * kv_width, bias=qkv_bias)
        else:
            self.qkv_proj = nn.Linear(d_model, q_width + 2 * kv_width, bias=qkv_bias)
        self.out_proj = nn.Linear(q_width, d_model, bias=out_bias)
        # QK-norm over each head's width: before rope, as Qwen3 and OLMo 2 do.
        self.q_norm = qk_norm(self.head_dim) if qk_norm is not None else nn.Identity()
        self.k_norm = qk_norm(self.head_dim) if qk_norm is not None else nn.Identity()
        self.mixer = mixer

    def parallel_plan(self) -> ParallelPlan:
        """Megatron-LM's: the query, key and value projections split by heads ([q; k; v] and cross-attention's
        [k; v] part by part), the output projection by its input, each rank computing its own heads."""
        if self.cross:  # queries from the decoder (q_proj: its heads in order), [k; v] from the encoder output
            projections: dict[str, Split] = {"q_proj": Columns(), "kv_proj": Columns(parts=self.widths[1:])}
        else:
            projections = {"qkv_proj": Columns(parts=self.widths)}
        return {"": Heads(), **projections, "out_proj": Rows()}

    @property
    def ranks(self) -> int:
        """The tensor-parallel ranks this module's heads are split over (1: all of them here)."""
        return 1 if self.head_rng is None else self.head_rng.ranks

    @property
    def n_heads(self) -> int:
        """The query heads this module computes: all of them, or this rank's share under tensor parallelism."""
        return self.heads // self.ranks

    @property
    def n_kv_heads(self) -> int:
        """The key/value heads this module computes (this rank's share under tensor parallelism)."""
        return self.kv_heads // self.ranks

    @property
    def split_sizes(self) -> tuple[int, int, int]:
        """The widths of q, k and v this module's projections return (this rank's share of ``widths``)."""
        q_width, k_width, v_width = (width // self.ranks for width in self.widths)
        return q_width, k_width, v_width

    def _split_heads(self, x: Tensor, n_heads: int) -> Tensor:
        batch, length, _ = x.shape
        return x.view(batch, length, n_heads, self.head_dim).transpose(1, 2)  # (B, heads, T, hs)

    def _project(
        self, x: Tensor, context: Tensor | None, cache: LayerKVCache | None, rope: tuple[Tensor, Tensor] | None,
        prefix: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Queries (B, nh, Tq, hs) and keys/values (B, n_kv_heads, Tk, hs). ``prefix``: (B, m, D) states before ``x``
        whose keys and values come first (a memory; ``rope`` then covers m + Tq positions, the queries the last Tq)."""
        if self.cross:
            q = self.q_norm(self._split_heads(self.q_proj(x), self.n_heads))
            if cache is not None and cache.memory is not None:
                return q, *cache.memory  # encoder keys/values were projected (and normalised) on the first step
            if context is None:
                raise ValueError("cross-attention needs a context (the encoder output)")
            k, v = (self._split_heads(t, self.n_kv_heads) for t in self.kv_proj(context).chunk(2, dim=-1))
            k = self.k_norm(k)
            if cache is not None:
                cache.memory = (k, v)
            return q, k, v
        length = x.size(1)
        if prefix is not None:  # one projection of [prefix; x] (the prefix's queries unused): LoRA, tensor parallel alike
            x = torch.cat((prefix.to(x.dtype), x), dim=1)  # (B, m + T, D)
        q, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        q = self.q_norm(self._split_heads(q, self.n_heads))
        k = self.k_norm(self._split_heads(k, self.n_kv_heads))
        v = self._split_heads(v, self.n_kv_heads)
        if rope is not None:
            cos, sin = (table.to(q.dtype) for table in rope)  # cast once for q and k (bf16 under autocast)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if prefix is not None:
            q = q[:, :, -length:]  # (B, nh, T, hs)
        if cache is not None:
            k, v = cache.append(k, v)  # cached keys are stored already rotated, n_kv_heads of them
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
        prefix: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """``x``: (B, T, D). ``attn_mask``: boolean allowed mask or additive float mask broadcastable
        to (B, nh, Tq, Tk). ``prefix``: (B, m, D) earlier states attended to as keys before ``x`` (self-attention).
        Returns the output (B, T, D) and, on the explicit path, the weights."""
        batch, length, _ = x.shape
        q, k, v = self._project(x, context, cache, rope, prefix)  # (B, nh, T, hs); k, v: (B, n_kv_heads, T, hs)
        if isinstance(self.mixer, PerformerFeatures):
            if need_weights:
                raise ConfigError("model.attention=performer forms no attention weights to return: use "
                                  "model.attention=softmax to look at them")
            if self.kv_group > 1:
                k, v = k.repeat_interleave(self.kv_group, dim=1), v.repeat_interleave(self.kv_group, dim=1)
            y = self.mixer(q, k, v, _keys_seen(attn_mask))  # (B, nh, Tq, hs)
            return self.out_proj(y.transpose(1, 2).reshape(batch, length, self.n_heads * self.head_dim)), None
        if isinstance(self.mixer, LinformerProjection):
            k, v = self.mixer(k, v, _keys_seen(attn_mask))  # (B, n_kv_heads, linformer.k, hs): padding projected out
            attn_mask = None
        if attn_mask is not None and attn_mask.is_floating_point():
            attn_mask = attn_mask.to(q.dtype)  # SDPA wants the float mask in the query's dtype
        dropout_p = self.attn_dropout if self.training else 0.0
        # Only the explicit path has weights, and soft-capping.
        compute = MultiHeadAttention._explicit if need_weights or self.softcap is not None else self.compute
        if dropout_p and self.head_rng is not None:
            y, weights = self.head_rng(compute, self, q, k, v, attn_mask, is_causal, dropout_p)  # (B, nh, Tq, hs)
        else:
            y, weights = compute(self, q, k, v, attn_mask, is_causal, dropout_p)
        y = y.transpose(1, 2).reshape(batch, length, self.n_heads * self.head_dim)  # (B, T, nh*hs)
        return self.out_proj(y), weights

    def _sdpa(
        self, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, is_causal: bool, dropout_p: float
    ) -> tuple[Tensor, None]:
        # SDPA's grouped-query path reads each key/value head for its group of query heads without
        # copying them; asked for only when grouped, so multi-head attention keeps every kernel.
        grouped = self.kv_group > 1
        if self.kernel is None:
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, enable_gqa=grouped,
                scale=self.scale,
            )
            return y, None
        try:
            with sdpa_kernel(self.kernel):
                y = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, enable_gqa=grouped,
                    scale=self.scale,
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
        if self.kv_group > 1:  # each key/value head serves its group of query heads (transformers' repeat_kv)
            k, v = k.repeat_interleave(self.kv_group, dim=1), v.repeat_interleave(self.kv_group, dim=1)  # (B, nh, Tk, hs)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.scale_dim)  # (B, nh, Tq, Tk)
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
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


def _keys_seen(attn_mask: Tensor | None) -> Tensor | None:
    """The keys (not padding) of a boolean allowed mask (…, Tq, Tk) of a stack without windows, biases or packed
    documents, as (B or 1, 1, Tk): the last query's row, which causality leaves whole (it is the last position)."""
    if attn_mask is None:
        return None
    return attn_mask[..., -1, :].reshape(-1, 1, attn_mask.size(-1))


def _mask_kind(attn_mask: Tensor | None, is_causal: bool) -> str:
    """How the inputs are masked, in the words of the refusal message."""
    if attn_mask is None:
        return "causal, no mask tensor" if is_causal else "no mask"
    return f"{'boolean' if attn_mask.dtype == torch.bool else 'float bias'} mask"
