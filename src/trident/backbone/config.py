"""The typed configuration of a Transformer stack, checked once when it is built."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trident.backbone.attention import ATTENTION_IMPLS, SDPA_KERNELS
from trident.backbone.layer_settings import LayerSettings, layer_settings
from trident.backbone.layers import ACTIVATIONS, NORMS
from trident.backbone.linear_attention import check_attention
from trident.backbone.memory import check_memory_config
from trident.backbone.positional import pos_encoding_class
from trident.errors import ConfigError, choose, is_int, is_number

# model.family: the outside families a stack can be declared as, each read and written by the adapter of that name
# (trident.weights.adapters.registry; conf/architecture/<family>.yaml sets the switches and this name). null: a
# stack of trident's own, which the hf export writes as the family whose settings it has.
FAMILIES = ("gpt2", "bert", "vit", "llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "clip", "albert",
            "roberta", "electra", "bart", "t5", "mt5")


@dataclass
class TransformerConfig:
    """Shape and architecture of one encoder or decoder stack.

    The defaults are the paper's base model ("Attention Is All You Need", Table 3),
    except ``norm_first``/``activation`` which follow modern practice; the ``model``
    config group overrides them per size.

    ``n_kv_heads``, ``head_dim`` and the three attention/MLP bias flags may be given as None (their
    defaults: follow ``n_heads``, ``d_model // n_heads`` and ``bias``); construction resolves them, so
    afterwards they read as ints and bools. Build a changed config anew rather than with
    ``dataclasses.replace``, which would carry the resolved values over.
    """

    d_model: int = 512
    n_heads: int = 8
    n_layers: int = 6
    d_ff: int = 2048
    dropout: float = 0.1  # on embeddings and on every residual branch
    attn_dropout: float = 0.0  # on the attention weights
    activation: str = "gelu"  # relu (paper) | gelu | gelu_tanh (GPT-2) | swiglu
    norm: str = "layernorm"  # layernorm | rmsnorm
    norm_first: bool = True  # pre-norm; False is the paper's post-norm
    # Normalise token + position embeddings before the first block (BERT's embedding LayerNorm).
    embedding_norm: bool = False
    bias: bool = True  # biases in linear layers and norms
    # Attention shape (issue 40). Grouped-query attention (Ainslie et al. 2023): n_kv_heads key/value
    # heads, each shared by n_heads / n_kv_heads query heads (1 = multi-query); None = n_heads.
    n_kv_heads: int | None = None
    head_dim: int | None = None  # width of one head; None = d_model // n_heads
    qk_norm: bool = False  # a norm over each head's queries and keys, before rope (Qwen3, OLMo 2)
    qkv_bias: bool | None = None  # biases of the q/k/v projections; None = follow bias
    attn_out_bias: bool | None = None  # bias of the attention output projection; None = follow bias
    mlp_bias: bool | None = None  # biases of the feed-forward layers; None = follow bias
    max_seq_len: int = 1024  # longest sequence the positional encoding must serve
    attn_impl: str = "sdpa"  # sdpa (fast, fused) | explicit (also returns weights)
    sdpa_backend: str = "auto"  # auto | no_cudnn | math | flash | efficient | cudnn (attn_impl=sdpa only)
    # Recompute each block's activations in the backward pass instead of storing them: less
    # memory (one block's activations instead of all) for about one more forward pass of compute.
    activation_checkpointing: bool = False
    pos_encoding: str = "sinusoidal"  # a name from trident.backbone.available_pos_encodings()
    pos_encoding_options: dict[str, Any] = field(default_factory=dict)  # e.g. rope base
    norm_eps: float = 1e-5  # LayerNorm/RMSNorm epsilon (timm's ViT uses 1e-6)
    drop_path: float = 0.0  # stochastic depth rate of the last block, rising linearly from 0
    layer_scale_init: float | None = None  # per-channel residual scale (CaiT); None = off
    # Images: positions form a (rows, cols) grid after ``num_prefix_tokens`` (class token) positions.
    grid: tuple[int, int] | None = None
    num_prefix_tokens: int = 0
    # DeiT's distillation token (task=vit only): a second learned prefix token after the class token, read by a second
    # head (trident.models.vit); vit_geometry counts it in num_prefix_tokens.
    distillation_token: bool = False
    # Sliding-window attention (Mistral): a causal query sees its last ``attention_window`` positions,
    # itself included; an encoder's query sees the keys less than ``attention_window`` away. None = all.
    attention_window: int | None = None
    # Segment-level recurrence (Transformer-XL): each layer also attends to its last memory_length inputs of the
    # previous segments, kept without gradient (trident.backbone.memory; a causal LM only). 0 = off.
    memory_length: int = 0
    # Per-layer overrides (trident.backbone.layer_settings.LAYER_KEYS): None, or one entry per layer, null or a mapping
    # of attention_window, rope, pos_encoding_options (Gemma's alternating local and global layers, Qwen2's
    # max_window_layers). Read resolved through :attr:`layer_settings`.
    layers: list[Any] | None = None
    # Attention scores are q.k / sqrt(attn_scale_dim); None = head_dim (Gemma's query_pre_attn_scalar sets another).
    attn_scale_dim: float | None = None
    # Soft-capping (Gemma 2): scores -> cap * tanh(scores / cap) before the mask and softmax; None = off.
    attn_softcap: float | None = None
    # The same on a causal LM's vocabulary logits (CausalLM applies it after its head); None = off.
    final_logit_softcap: float | None = None
    # Gemma's "sandwich" norms: a norm also on each sub-layer's output, before it joins the residual (pre-norm only).
    sandwich_norm: bool = False
    family: str | None = None  # the outside family the stack is declared as (FAMILIES), which export writes
    # How self-attention mixes the positions (trident.backbone.linear_attention.ATTENTIONS): softmax | performer |
    # linformer, with the options of the chosen one (None: their defaults); resolved to full mappings when built.
    attention: str = "softmax"
    performer: dict[str, Any] | None = None  # features (None: head_dim * ln head_dim), redraw_interval (steps)
    linformer: dict[str, Any] | None = None  # k (projected length), sharing (headwise | kv)
    # Cross-layer parameter sharing (ALBERT, Lan et al. 2020): false = every layer its own weights; true = all layers
    # one set; an integer G = G groups of n_layers / G consecutive layers, each group one set (transformers'
    # num_hidden_groups). Read resolved through :attr:`block_of_layer`.
    share_layers: bool | int = False
    # Factorised embedding (ALBERT): tokens (and added positions, the embedding norm) of this width E, projected to
    # d_model before the first block; the MLM head projects back to E. None = d_model, no projection.
    embedding_dim: int | None = None

    def __post_init__(self) -> None:
        for name in ("d_model", "n_heads", "n_layers", "d_ff", "max_seq_len"):
            value = getattr(self, name)
            if not is_int(value) or value <= 0:
                example = TransformerConfig.__dataclass_fields__[name].default
                key = f"data.{name}" if name == "max_seq_len" else f"model.{name}"  # the context comes with the data
                raise ConfigError(f"{key} must be a positive integer, got {value!r}: set e.g. {key}={example}")
        explicit_head_dim = self.head_dim is not None  # then d_model need not divide into the heads
        self._resolve_attention_shape()
        if self.d_model % self.n_heads != 0 and not explicit_head_dim:
            raise ConfigError(
                f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}: "
                f"choose n_heads among the divisors of d_model (e.g. {_divisors_hint(self.d_model)})"
            )
        for name in ("dropout", "attn_dropout"):
            value = getattr(self, name)
            if not is_number(value) or not 0.0 <= value < 1.0:
                raise ConfigError(f"model.{name} must be in [0, 1), got {value!r}: use a probability such as 0.1 (0 = off)")
        if not is_number(self.drop_path) or not 0.0 <= self.drop_path < 1.0:
            raise ConfigError(f"model.drop_path must be in [0, 1), got {self.drop_path!r}: use a rate such as 0.1 (0 = off)")
        if self.layer_scale_init is not None and self.layer_scale_init <= 0:
            raise ConfigError(
                f"model.layer_scale_init must be positive or null, got {self.layer_scale_init!r}: use e.g. 1e-5, or null for off"
            )
        # The tables the layers are built from: a name is checked against the same list that builds it.
        choose(ACTIVATIONS, self.activation, "model.activation")
        choose(NORMS, self.norm, "model.norm")
        choose(ATTENTION_IMPLS, self.attn_impl, "model.attn_impl")
        choose(SDPA_KERNELS, self.sdpa_backend, "model.sdpa_backend")
        if not isinstance(self.embedding_norm, bool):
            raise ConfigError(f"model.embedding_norm must be true or false, got {self.embedding_norm!r}")
        if not isinstance(self.activation_checkpointing, bool):
            raise ConfigError(
                f"model.activation_checkpointing must be true or false, got {self.activation_checkpointing!r}"
            )
        spec = pos_encoding_class(self.pos_encoding)
        rotary_multiple = 4 if self.grid is not None else 2  # 2-D rope rotates rows and columns apart
        if spec.uses_rotary and self.head_dim % rotary_multiple != 0:
            given, fix = (("model.head_dim", "model.head_dim") if explicit_head_dim
                          else ("d_model/n_heads", "model.d_model or model.n_heads"))
            raise ConfigError(
                f"pos_encoding=rope needs a head size divisible by {rotary_multiple}, got {given}="
                f"{self.head_dim}: change {fix}"
            )
        if self.grid is not None:
            if not spec.supports_grid:
                raise ConfigError(
                    f"pos_encoding={self.pos_encoding} measures 1-D distances and does not apply to image patches: "
                    "use learned, sinusoidal, rope or none"
                )
            if self.num_prefix_tokens + self.grid[0] * self.grid[1] > self.max_seq_len:
                raise ConfigError(
                    f"{self.grid[0]}x{self.grid[1]} patches + {self.num_prefix_tokens} prefix tokens exceed "
                    f"max_seq_len={self.max_seq_len}"
                )
        self._check_distillation_token()
        if self.attention_window is not None:
            if not is_int(self.attention_window) or self.attention_window <= 0:
                raise ConfigError(
                    f"model.attention_window must be a positive integer or null, got {self.attention_window!r}: "
                    "set e.g. model.attention_window=256, or null to attend to the whole context"
                )
            if self.attention_window > self.max_seq_len:
                raise ConfigError(
                    f"model.attention_window={self.attention_window} is larger than the context data.max_seq_len="
                    f"{self.max_seq_len}: lower model.attention_window to at most {self.max_seq_len}, or null"
                )

        self._check_family_switches()
        self.performer, self.linformer = check_attention(self, pos_encoding_class(self.pos_encoding))
        check_memory_config(self, spec.absolute)

    @property
    def layer_settings(self) -> list[LayerSettings]:
        """Each layer's window and rope, the stack's settings with ``layers``' overrides applied."""
        return layer_settings(self.layers, self.n_layers, self.attention_window, self.pos_encoding,
                              self.pos_encoding_options)

    def _check_family_switches(self) -> None:
        """The per-layer list, Gemma's switches and the declared family: one line each for a bad value."""
        for i, layer in enumerate(self.layer_settings):
            if layer.attention_window is not None and layer.attention_window > self.max_seq_len:
                raise ConfigError(
                    f"model.layers[{i}].attention_window={layer.attention_window} is larger than the context "
                    f"data.max_seq_len={self.max_seq_len}: lower it to at most {self.max_seq_len}, or null"
                )
        for name in ("attn_scale_dim", "attn_softcap", "final_logit_softcap"):
            value = getattr(self, name)
            if value is not None and (not is_number(value) or value <= 0):
                raise ConfigError(f"model.{name} must be a positive number or null (off), got {value!r}")
        if not isinstance(self.sandwich_norm, bool):
            raise ConfigError(f"model.sandwich_norm must be true or false, got {self.sandwich_norm!r}")
        if self.sandwich_norm and not self.norm_first:
            raise ConfigError("model.sandwich_norm=true needs model.norm_first=true (a post-norm block already ends "
                              "in a norm): set one of them")
        if self.family is not None:
            choose(dict.fromkeys(FAMILIES), self.family, "model.family")
        self._check_sharing()

    def _check_sharing(self) -> None:
        """ALBERT's switches, model.share_layers and model.embedding_dim: one line each for a bad value."""
        groups = self._weight_groups()
        if not is_int(groups) or groups <= 0 or self.n_layers % groups != 0:
            raise ConfigError(
                f"model.share_layers must be true, false or a number of groups dividing model.n_layers={self.n_layers}, "
                f"got {self.share_layers!r}: set e.g. model.share_layers=true (one set of weights for every layer)"
            )
        if self.embedding_dim is not None and (not is_int(self.embedding_dim) or self.embedding_dim <= 0):
            raise ConfigError(f"model.embedding_dim must be a positive integer or null (the width, no projection), got "
                              f"{self.embedding_dim!r}: set e.g. model.embedding_dim=128")
        if self.embedding_dim is not None and self.grid is not None:
            raise ConfigError("model.embedding_dim factorises a token embedding; image patches are projected to the width "
                              "directly: set model.embedding_dim=null")

    def _weight_groups(self) -> Any:
        """How many sets of weights model.share_layers asks for (unchecked): true 1, false (or null) n_layers."""
        if isinstance(self.share_layers, bool) or self.share_layers is None:
            return 1 if self.share_layers else self.n_layers
        return self.share_layers

    @property
    def block_of_layer(self) -> list[int]:
        """Which set of weights (block) each layer runs (model.share_layers): [0, 1, ..., n_layers - 1] without sharing."""
        per_group = self.n_layers // self._weight_groups()
        return [i // per_group for i in range(self.n_layers)]

    @property
    def embedding_width(self) -> int:
        """The width of the token embedding the stack takes (model.embedding_dim, else d_model)."""
        return self.d_model if self.embedding_dim is None else int(self.embedding_dim)

    def _resolve_attention_shape(self) -> None:
        """Check the attention-shape keys and replace their None defaults by what they stand for."""
        for name, example, meaning in (("n_kv_heads", 1, "one per query head"), ("head_dim", 64, "d_model / n_heads")):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value <= 0):
                raise ConfigError(f"model.{name} must be a positive integer or null, got {value!r}: "
                                  f"set e.g. model.{name}={example}, or null for {meaning}")
        if self.n_kv_heads is not None and self.n_heads % self.n_kv_heads != 0:
            raise ConfigError(
                f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads={self.n_kv_heads}: choose "
                f"n_kv_heads among the divisors of n_heads ({_divisors_hint(self.n_heads)}), or null for n_heads"
            )
        if not isinstance(self.qk_norm, bool):
            raise ConfigError(f"model.qk_norm must be true or false, got {self.qk_norm!r}: set model.qk_norm=true to "
                              "normalise each head's queries and keys, or false")
        for name in ("qkv_bias", "attn_out_bias", "mlp_bias"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ConfigError(f"model.{name} must be true, false or null (follow model.bias), got {value!r}: "
                                  f"set model.{name}=true or false, or null")
            setattr(self, name, self.bias if value is None else value)
        self.n_kv_heads = self.n_heads if self.n_kv_heads is None else self.n_kv_heads
        self.head_dim = self.d_model // self.n_heads if self.head_dim is None else self.head_dim

    def _check_distillation_token(self) -> None:
        if not isinstance(self.distillation_token, bool):
            raise ConfigError(f"model.distillation_token must be true or false, got {self.distillation_token!r}")
        if self.distillation_token and self.grid is None:
            raise ConfigError("model.distillation_token=true is DeiT's distillation token, which only a ViT's image "
                              "stack has: use it with task=vit, or set model.distillation_token=false")


def _divisors_hint(n: int) -> str:
    return ", ".join(str(d) for d in range(1, min(n, 64) + 1) if n % d == 0)
