"""Encoder and decoder stacks: one layer stack, two thin subclasses (causal or not)."""

from __future__ import annotations

import copy
import math
from functools import partial
from typing import TypedDict, Unpack

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from trident.backbone.block import TransformerBlock
from trident.backbone.config import TransformerConfig
from trident.backbone.kv_cache import KVCache
from trident.backbone.layers import make_norm
from trident.backbone.masks import build_attention_mask, document_positions, padding_allowed, window_band
from trident.backbone.memory import SegmentMemory, check_recurrent_stack
from trident.backbone.positional import PositionalEncoding, build_pos_encoding, positions_from
from trident.errors import ConfigError


class StackInputs(TypedDict, total=False):
    """What a stack reads besides its (B, T, D) embeddings; each is optional.

    ``key_padding_mask``: (B, T_total) True at padding, covering cached positions too. ``memory``: (B, S, D) for
    cross-attention, with ``memory_padding_mask`` (B, S). ``cache``: the KV cache of incremental decoding.
    ``documents``: (B, T) document id of each token of rows packed with several documents (training, no cache): a
    token attends to its own document only, and its absolute position restarts at 0 where its document starts
    (distance-only encodings, rope, alibi and relative, see the same distances as for the document alone).
    ``positions``: (B, T) each token's position in its own row, as rope and the added encodings see it (left-padded
    prompts: counted from the row's first real token, transformers' ``position_ids``); absent: its index in the
    sequence, the cached ones included. ``recurrence``: the :class:`SegmentMemory` of a stack with ``memory_length``
    (Transformer-XL): each layer also attends to the states it holds, which positions place before the tokens."""

    key_padding_mask: Tensor | None
    memory: Tensor | None
    memory_padding_mask: Tensor | None
    cache: KVCache | None
    documents: Tensor | None
    positions: Tensor | None
    recurrence: SegmentMemory | None


class TransformerStack(nn.Module):
    """Positional encoding, dropout, ``n_layers`` blocks and (pre-norm only) a final norm.

    Input and output are embeddings (B, T, D): token or patch embeddings belong to the model
    that owns the stack, so one stack serves text and images alike.
    """

    def __init__(self, cfg: TransformerConfig, *, causal: bool, cross_attention: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        self.causal = causal
        if causal and cfg.attention == "linformer":
            raise ConfigError("model.attention=linformer projects keys from the whole sequence, later positions "
                              "included, and serves encoders only (task=mlm, classify, vit): use model.attention=softmax "
                              "or performer for a causal stack (task=lm, the translation decoder)")
        if cfg.embedding_dim is not None and causal:
            raise ConfigError("model.embedding_dim (ALBERT's factorised embedding) is for an encoder's tokens (task=mlm, "
                              "task=classify with task.stack=encoder): set model.embedding_dim=null")
        # A factorised embedding (ALBERT) adds its positions and takes its norm at its own width E, projected to
        # d_model after (transformers' embedding_hidden_mapping_in).
        embedded = copy.copy(cfg)
        embedded.d_model = cfg.embedding_width
        self.pos_encoding = build_pos_encoding(embedded, causal=causal)
        # model.layers: each layer's window, and which rope rotates it (None: none), as indices into
        # [pos_encoding, *layer_encodings]: one rope per distinct set of options (Gemma 3's local and global bases).
        layers = cfg.layer_settings
        self.windows = [layer.attention_window for layer in layers]
        options = [cfg.pos_encoding_options]
        encodings: list[PositionalEncoding] = []
        self.rope_of_layer: list[int | None] = []
        for layer in layers:
            if not layer.rope:
                self.rope_of_layer.append(None if self.pos_encoding.uses_rotary else 0)
                continue
            if layer.pos_encoding_options not in options:
                options.append(layer.pos_encoding_options)
                shape = copy.copy(cfg)  # the stack's shape with this layer's rope options
                shape.pos_encoding_options = layer.pos_encoding_options
                encodings.append(build_pos_encoding(shape, causal=causal))
            self.rope_of_layer.append(options.index(layer.pos_encoding_options))
        self.layer_encodings = nn.ModuleList(encodings)
        check_recurrent_stack(cfg.memory_length, causal=causal, cross_attention=cross_attention)
        # BERT normalises the summed embeddings before the first block; no other model here does.
        self.embedding_norm = (
            make_norm(cfg.norm, cfg.embedding_width, bias=cfg.bias, eps=cfg.norm_eps) if cfg.embedding_norm
            else nn.Identity()
        )
        self.dropout = nn.Dropout(cfg.dropout)
        self.embedding_projection = (nn.Linear(cfg.embedding_width, cfg.d_model, bias=cfg.bias)
                                     if cfg.embedding_dim is not None else nn.Identity())
        # model.share_layers: layer i runs blocks[block_of_layer[i]]; without sharing, block i. Stochastic depth
        # rises linearly with depth, from 0 to cfg.drop_path at the last block (a shared block: its first layer's).
        self.block_of_layer = cfg.block_of_layer
        first_layers = [self.block_of_layer.index(b) for b in range(self.block_of_layer[-1] + 1)]
        rates = [cfg.drop_path * i / max(1, cfg.n_layers - 1) for i in first_layers]
        self.blocks = nn.ModuleList(
            TransformerBlock(cfg, cross_attention=cross_attention, drop_path=rate, causal=causal) for rate in rates
        )
        # Post-norm blocks end in a norm already; pre-norm stacks need one after the last residual.
        self.final_norm = (
            make_norm(cfg.norm, cfg.d_model, bias=cfg.bias, eps=cfg.norm_eps) if cfg.norm_first else nn.Identity()
        )
        self._init_linear_weights()

    def _init_linear_weights(self) -> None:
        """GPT-2 initialisation: N(0, 0.02), and residual output projections scaled by
        1/sqrt(2 * n_layers) so the residual stream's variance does not grow with depth."""
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, module in self.blocks.named_modules():
            if isinstance(module, nn.Linear):
                is_residual_out = name.endswith(("out_proj", "fc_out"))
                nn.init.normal_(module.weight, std=residual_std if is_residual_out else 0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        if isinstance(self.embedding_projection, nn.Linear):
            nn.init.normal_(self.embedding_projection.weight, std=0.02)
            if self.embedding_projection.bias is not None:
                nn.init.zeros_(self.embedding_projection.bias)

    def new_cache(self, max_len: int) -> KVCache:
        """An empty KV cache for incremental decoding of up to ``max_len`` positions; with
        ``attention_window`` <= ``max_len`` it stores the last ``attention_window`` and rolls on forever."""
        return KVCache(self.cfg.n_layers, max_len, list(self.windows))

    @property
    def context_length(self) -> int | None:
        """Longest sequence generation feeds the stack (``max_seq_len``), or None for no limit: with
        a sliding window in every layer and positions that enter only as distances (rope, alibi, relative,
        none), the KV cache rolls on and every token sees what a pass over the whole sequence shows it."""
        if None not in self.windows and not self.pos_encoding.absolute:
            return None
        return self.cfg.max_seq_len

    def forward(self, x: Tensor, **inputs: Unpack[StackInputs]) -> Tensor:
        """``x``: (B, T, E) embeddings (E: model.embedding_dim, else D), read with ``inputs`` (see :class:`StackInputs`). Returns (B, T, D)."""
        return self._run(x, inputs, need_weights=False)[0]

    def forward_with_attention(self, x: Tensor, **inputs: Unpack[StackInputs]) -> tuple[Tensor, list[Tensor]]:
        """Like :meth:`forward`, also returning each block's self-attention weights (B, nh, Tq, Tk)."""
        hidden, weights = self._run(x, inputs, need_weights=True)
        return hidden, [w for w in weights if w is not None]

    def _run(self, x: Tensor, inputs: StackInputs, *, need_weights: bool) -> tuple[Tensor, list[Tensor | None]]:
        unknown = inputs.keys() - StackInputs.__annotations__.keys()
        if unknown:  # a misspelt input would otherwise be dropped without a word
            raise TypeError(f"{type(self).__name__}.forward got unexpected inputs {sorted(unknown)}")
        key_padding_mask, cache = inputs.get("key_padding_mask"), inputs.get("cache")
        documents, positions = inputs.get("documents"), inputs.get("positions")
        memory, memory_padding_mask = inputs.get("memory"), inputs.get("memory_padding_mask")
        length = x.size(1)
        if documents is not None and self.cfg.attention != "softmax":
            raise ConfigError(f"model.attention={self.cfg.attention} cannot keep the documents of packed rows apart "
                              "(data=chat): use model.attention=softmax for packed documents")
        offset = cache.length if cache is not None else 0
        recurrence = inputs.get("recurrence")
        if recurrence is not None and (documents is not None or positions is not None or key_padding_mask is not None):
            raise ConfigError("a stack with model.memory_length reads whole segments of one text per row: it takes no "
                              "packed documents, padding or per-row positions (generate prompts of different lengths one at a time)")
        # The memory's states come first: the tokens' positions start after them (fed: how many this call feeds).
        fed = recurrence.prefix_length(cached=cache is not None) if recurrence is not None else 0
        # The slots' positions: the masks, the cache and the distance biases (alibi, relative) follow them. Per-row
        # positions of left-padded rows differ from them by the row's padding, the same for a query and its keys.
        q_positions = positions_from(offset + fed, length, x.device)  # (T,)
        # Packed documents restart their positions: the longest document bounds them, not the row.
        embedded_positions = q_positions if documents is None else document_positions(documents)  # (T,) or (B, T)
        if positions is not None:
            embedded_positions = positions  # (B, T)
        self.pos_encoding.check_length(offset + length if embedded_positions is q_positions
                                       else int(embedded_positions.max()) + 1)
        # Everything position-dependent is computed once here and shared by the blocks of the same kind:
        # one rotation per rope (a length-following one, dynamic NTK, takes each packed document's own length),
        # one mask per window.
        encodings = [self.pos_encoding, *self.layer_encodings]
        # With a memory fed, rope rotates its keys too: positions offset .. offset + fed + T - 1 (queries: the last T).
        rotated = positions if positions is not None else positions_from(offset, fed + length, x.device) if fed \
            else q_positions
        ropes = [encoding.rotary(rotated, documents) for encoding in encodings]
        masks = {window: self._mask(window, q_positions, cache, key_padding_mask, documents, fed)
                 for window in dict.fromkeys(self.windows)}
        memory_mask = padding_allowed(memory_padding_mask) if memory_padding_mask is not None else None
        h = self.embedding_norm(self.pos_encoding.add_to_embeddings(x, embedded_positions))  # (B, T, E)
        if self.training and self.dropout.p:  # dropout returns its input otherwise: one call less per step
            h = self.dropout(h)
        h = self.embedding_projection(h)  # (B, T, E) -> (B, T, D); the identity without a factorised embedding
        all_weights: list[Tensor | None] = []
        # Checkpointing only pays off when a backward pass follows (and a KV cache is never trained).
        recompute = self.cfg.activation_checkpointing and self.training and torch.is_grad_enabled() and cache is None
        for i, index in enumerate(self.block_of_layer):
            block = self.blocks[index]
            # Non-reentrant checkpointing keeps keyword arguments and restores the RNG state, so the
            # recomputed forward draws the same dropout masks as the first one.
            run_block = partial(checkpoint, block, use_reentrant=False) if recompute else block
            attn_mask, is_causal = masks[self.windows[i]]
            rope_index = self.rope_of_layer[i]
            prefix = recurrence.prefix(i, cached=cache is not None) if recurrence is not None else None
            if recurrence is not None:
                recurrence.record(i, h)  # the layer's input: the memory of the next segment
            h, weights = run_block(
                h,
                attn_mask=attn_mask,
                is_causal=is_causal,
                rope=None if rope_index is None else ropes[rope_index],
                memory=memory,
                memory_mask=memory_mask,
                cache=cache.layers[i] if cache is not None else None,
                need_weights=need_weights,
                **({"prefix": prefix} if prefix is not None else {}),
            )
            all_weights.append(weights)
        return self.final_norm(h), all_weights

    def _mask(self, window: int | None, q_positions: Tensor, cache: KVCache | None, key_padding_mask: Tensor | None,
              documents: Tensor | None, fed: int = 0) -> tuple[Tensor | None, bool]:
        """The attention mask of the layers with sliding ``window`` (None: the whole context): their keys' absolute
        positions in the order attention sees them (a rolling cache: its slots), the window's band, the padding.
        ``fed``: the memory states fed before the queries (their keys come first, at positions from 0)."""
        length = q_positions.numel()
        layer = self.windows.index(window)
        if cache is not None:
            k_positions = cache.layers[layer].key_positions(fed + length, q_positions.device)
        else:
            k_positions = positions_from(0, fed + length, q_positions.device) if fed else q_positions
        bias = self.pos_encoding.attention_bias(q_positions, k_positions)
        band = window_band(q_positions, k_positions, window, causal=self.causal) if window is not None else None
        if key_padding_mask is not None and band is not None:
            key_padding_mask = key_padding_mask[:, k_positions]  # (B, Tk): absolute positions -> the keys attended
        return build_attention_mask(
            q_len=length,
            k_len=k_positions.numel(),
            causal=self.causal,
            key_padding_mask=key_padding_mask,
            bias=bias,
            band=band,
            documents=documents,
            device=q_positions.device,
        )


class Encoder(TransformerStack):
    """Bidirectional stack: every position attends to every non-padding position."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__(cfg, causal=False)


class Decoder(TransformerStack):
    """Causal stack; with ``cross_attention=True`` each block also attends to an encoder's output."""

    def __init__(self, cfg: TransformerConfig, *, cross_attention: bool = False) -> None:
        super().__init__(cfg, causal=True, cross_attention=cross_attention)
