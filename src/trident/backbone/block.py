"""One Transformer block: self-attention, optional cross-attention, feed-forward, each a residual sub-layer."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from torch import Tensor, nn

from trident.backbone.attention import MultiHeadAttention
from trident.backbone.config import TransformerConfig
from trident.backbone.kv_cache import LayerKVCache
from trident.backbone.layers import FeedForward, make_norm
from trident.backbone.linear_attention import build_mixer
from trident.backbone.residual import DropPath, LayerScale


class TransformerBlock(nn.Module):
    """Post-norm (``norm_first=False``, the paper): x = Norm(x + Dropout(Sublayer(x))).
    Pre-norm (``norm_first=True``): x = x + Dropout(Sublayer(Norm(x))), which trains stably
    without warmup and needs a final norm after the stack. ``sandwich_norm`` (Gemma) adds a norm on each
    sub-layer's output: x = x + Dropout(PostNorm(Sublayer(Norm(x))))."""

    def __init__(self, cfg: TransformerConfig, *, cross_attention: bool = False, drop_path: float = 0.0,
                 causal: bool = False) -> None:
        super().__init__()
        self.norm_first = cfg.norm_first

        def attention(cross: bool) -> MultiHeadAttention:
            return MultiHeadAttention(
                cfg.d_model,
                cfg.n_heads,
                n_kv_heads=cfg.n_kv_heads,
                head_dim=cfg.head_dim,
                cross=cross,
                qkv_bias=cfg.qkv_bias,
                out_bias=cfg.attn_out_bias,
                qk_norm=partial(make_norm, cfg.norm, bias=cfg.bias, eps=cfg.norm_eps) if cfg.qk_norm else None,
                attn_dropout=cfg.attn_dropout,
                impl=cfg.attn_impl,
                sdpa_backend=cfg.sdpa_backend,
                scale_dim=cfg.attn_scale_dim,
                softcap=cfg.attn_softcap,
                # model.attention replaces self-attention's softmax; cross-attention keeps it (docs/architecture.md).
                mixer=None if cross else build_mixer(
                    cfg.attention, cfg.performer if cfg.attention == "performer" else cfg.linformer,
                    head_dim=cfg.head_dim, scale_dim=cfg.attn_scale_dim or cfg.head_dim, max_seq_len=cfg.max_seq_len,
                    causal=causal),
            )

        def norm() -> nn.Module:
            return make_norm(cfg.norm, cfg.d_model, bias=cfg.bias, eps=cfg.norm_eps)

        def post_norm() -> nn.Module | None:
            return norm() if cfg.sandwich_norm else None  # None, not Identity: no call per decoding step

        def layer_scale() -> nn.Module:
            # CaiT's per-channel scale on each residual branch, started small so deep stacks train.
            return LayerScale(cfg.d_model, cfg.layer_scale_init) if cfg.layer_scale_init else nn.Identity()

        self.self_attn = attention(cross=False)
        self.self_attn_norm = norm()
        self.self_attn_scale = layer_scale()
        self.self_attn_post_norm = post_norm()
        self.cross_attn = attention(cross=True) if cross_attention else None
        self.cross_attn_norm = norm() if cross_attention else None
        self.cross_attn_scale = layer_scale() if cross_attention else None
        self.cross_attn_post_norm = post_norm() if cross_attention else None
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, activation=cfg.activation, bias=cfg.mlp_bias)
        self.ffn_norm = norm()
        self.ffn_scale = layer_scale()
        self.ffn_post_norm = post_norm()
        self.dropout = nn.Dropout(cfg.dropout)
        # Stochastic depth: drop the whole residual branch per sample (Huang et al. 2016).
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def _residual(
        self, x: Tensor, norm: nn.Module, scale: nn.Module, sublayer: Callable[[Tensor], Tensor],
        post_norm: nn.Module | None,
    ) -> Tensor:
        if self.norm_first:
            out = sublayer(norm(x))
            return x + self._branch(out if post_norm is None else post_norm(out), scale)
        return norm(x + self._branch(sublayer(x), scale))

    def _branch(self, out: Tensor, scale: nn.Module) -> Tensor:
        """Dropout, layer scale and stochastic depth on a sub-layer's output. Outside training, or at rate 0, dropout
        and stochastic depth return their input (torch launches nothing then): not calling them saves their Python
        call (~3-9 us each, twice per block and step). The rate is read at each call: DPO sets it to 0 after build."""
        if not self.training:
            return scale(out)
        if self.dropout.p:
            out = self.dropout(out)
        return self.drop_path(scale(out))

    def forward(
        self,
        x: Tensor,
        *,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
        rope: tuple[Tensor, Tensor] | None = None,
        memory: Tensor | None = None,
        memory_mask: Tensor | None = None,
        cache: LayerKVCache | None = None,
        need_weights: bool = False,
        prefix: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """``x``: (B, T, D); ``memory``: (B, S, D) encoder output for cross-attention. ``prefix``: (B, m, D) earlier
        inputs of this block that self-attention also reads keys and values from (model.memory_length's memory).
        Returns the block output and the self-attention weights (when asked for)."""
        self_weights: list[Tensor | None] = []
        # The memory goes through the same norm as the input it once was (pre-norm: before the sub-layer).
        before = prefix if prefix is None or not self.norm_first else self.self_attn_norm(prefix)

        def self_attention(h: Tensor) -> Tensor:
            out, weights = self.self_attn(
                h, attn_mask=attn_mask, is_causal=is_causal, rope=rope, cache=cache, need_weights=need_weights,
                **({"prefix": before} if before is not None else {}),
            )
            self_weights.append(weights)
            return out

        x = self._residual(x, self.self_attn_norm, self.self_attn_scale, self_attention, self.self_attn_post_norm)
        if self.cross_attn is not None and self.cross_attn_norm is not None and self.cross_attn_scale is not None:
            cross_attn = self.cross_attn
            x = self._residual(
                x,
                self.cross_attn_norm,
                self.cross_attn_scale,
                lambda h: cross_attn(h, memory, attn_mask=memory_mask, cache=cache)[0],
                self.cross_attn_post_norm,
            )
        x = self._residual(x, self.ffn_norm, self.ffn_scale, self.ffn, self.ffn_post_norm)
        return x, self_weights[0]
