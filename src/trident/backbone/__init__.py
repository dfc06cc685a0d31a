"""The shared Transformer backbone: the public API that every task builds on.

Tasks import from here only::

    from trident.backbone import TransformerConfig, Decoder, TokenEmbedding

Parts chosen by name in the ``model`` config come from tables (``NORMS``, ``ACTIVATIONS``,
``ATTENTION_IMPLS``, ``SDPA_KERNELS``, the positional-encoding registry) that build the layers and
that :class:`TransformerConfig` checks names against: an unknown name fails naming the choices.
"""

from trident.backbone.attention import ATTENTION_IMPLS, SDPA_KERNELS, MultiHeadAttention
from trident.backbone.block import TransformerBlock
from trident.backbone.config import TransformerConfig
from trident.backbone.kv_cache import KVCache, LayerKVCache
from trident.backbone.layers import ACTIVATIONS, GATED_ACTIVATIONS, NORMS, FeedForward, TokenEmbedding, make_norm
from trident.backbone.linear_attention import ATTENTIONS, CHUNK, default_features, redraw_features
from trident.backbone.lora import (
    LORA_TARGETS,
    LoRALinear,
    adapters_off,
    add_lora,
    has_adapters,
    is_lora_parameter,
    merge_lora,
)
from trident.backbone.masks import build_attention_mask, causal_mask
from trident.backbone.memory import RecurrentCache, SegmentMemory
from trident.backbone.parallel_plan import VOCABULARY_PLAN, Columns, Heads, ParallelPlan, Rows, Split
from trident.backbone.positional import (
    PositionalEncoding,
    apply_rotary,
    available_pos_encodings,
    bidirectional_pos_encodings,
    pos_encoding_class,
    register_pos_encoding,
)
from trident.backbone.stack import Decoder, Encoder, TransformerStack
from trident.backbone.vocabulary_head import VocabularyHead, scored

__all__ = [
    "ACTIVATIONS",
    "ATTENTIONS",
    "ATTENTION_IMPLS",
    "CHUNK",
    "GATED_ACTIVATIONS",
    "LORA_TARGETS",
    "NORMS",
    "SDPA_KERNELS",
    "VOCABULARY_PLAN",
    "Columns",
    "Decoder",
    "Encoder",
    "FeedForward",
    "Heads",
    "KVCache",
    "LayerKVCache",
    "LoRALinear",
    "MultiHeadAttention",
    "ParallelPlan",
    "PositionalEncoding",
    "RecurrentCache",
    "Rows",
    "SegmentMemory",
    "Split",
    "TokenEmbedding",
    "TransformerBlock",
    "TransformerConfig",
    "TransformerStack",
    "VocabularyHead",
    "adapters_off",
    "add_lora",
    "apply_rotary",
    "available_pos_encodings",
    "bidirectional_pos_encodings",
    "build_attention_mask",
    "causal_mask",
    "default_features",
    "has_adapters",
    "is_lora_parameter",
    "make_norm",
    "merge_lora",
    "pos_encoding_class",
    "redraw_features",
    "register_pos_encoding",
    "scored",
]
