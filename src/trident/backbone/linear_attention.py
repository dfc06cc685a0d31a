"""Attention in time linear in the sequence length (``model.attention``): Performer's FAVOR+ and Linformer.

* **Performer** (Choromanski et al. 2021): softmax(q.k / sqrt(d)) is estimated by phi(q).phi(k) with positive random
  features phi(x) = exp(w.x - |x|^2 / 2) over ``features`` orthogonal Gaussian directions w (one draw shared by the
  heads of a layer, as performer-pytorch and google-research's fast_attention), so attention becomes
  phi(Q) (phi(K)^T V) / phi(Q) (phi(K)^T 1). The causal form runs the prefix sums of phi(k) v^T chunk by chunk
  (quadratic inside a chunk of :data:`CHUNK` positions, a carried state across chunks). Everything runs in fp32.
* **Linformer** (Wang et al. 2020): keys and values are projected along the sequence to ``k`` rows by learned E and F
  (k, max_seq_len), shared by the heads of a layer; softmax attention then runs over those ``k`` rows. Encoders only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from trident.backbone.positional import PositionalEncoding
from trident.errors import ConfigError, choose, did_you_mean, is_int

# model.attention: name -> what a layer's self-attention computes. Cross-attention stays softmax (docs/architecture.md).
ATTENTIONS = {
    "softmax": "exact softmax attention (SDPA or the explicit path)",
    "performer": "FAVOR+ positive orthogonal random features (model.performer)",
    "linformer": "keys and values projected along the sequence (model.linformer; encoders only)",
}
# model.performer / model.linformer: the options each takes, and their defaults.
PERFORMER_DEFAULTS: dict[str, Any] = {"features": None, "redraw_interval": 1000}
LINFORMER_DEFAULTS: dict[str, Any] = {"k": None, "sharing": "headwise"}
# model.linformer.sharing: Wang et al.'s section 4 sharings that stay inside one layer (layerwise sharing, one E for
# the whole stack, would tie the blocks' parameters together, which FSDP's per-block wrapping cannot shard).
LINFORMER_SHARINGS = {
    "headwise": "E for the keys and F for the values, each shared by the heads of the layer",
    "kv": "one projection for the keys and the values of all the heads of the layer (E = F)",
}
# Positions per chunk of the causal Performer: a (CHUNK, CHUNK) score block per chunk, one carried state between them.
CHUNK = 128


def attention_options(name: str, given: Mapping[str, Any] | None, defaults: dict[str, Any]) -> dict[str, Any]:
    """``model.<name>`` (a mapping of ``defaults``' keys, or None) with the defaults filled in; an unknown key: one line."""
    given = dict(given or {})
    for key in given:
        if key not in defaults:
            raise ConfigError(f"model.{name}.{key} is not a {name} option{did_you_mean(str(key), list(defaults))}: "
                              f"model.{name} takes {', '.join(defaults)}")
    return {**defaults, **given}


class AttentionSettings(Protocol):
    """What :func:`check_attention` reads of a :class:`trident.backbone.TransformerConfig` (which imports this module)."""

    attention: str
    performer: Mapping[str, Any] | None
    linformer: Mapping[str, Any] | None
    head_dim: int
    max_seq_len: int
    attention_window: int | None
    attn_dropout: float
    attn_impl: str
    sdpa_backend: str
    attn_softcap: float | None
    pos_encoding: str

    @property
    def layer_settings(self) -> list[Any]: ...


def check_attention(cfg: AttentionSettings, encoding: type[PositionalEncoding]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Check ``model.attention`` and its options against the other switches (one line for what does not compose) ->
    the Performer and Linformer options, defaults filled in."""
    choose(ATTENTIONS, cfg.attention, "model.attention")
    performer = attention_options("performer", cfg.performer, PERFORMER_DEFAULTS)
    linformer = attention_options("linformer", cfg.linformer, LINFORMER_DEFAULTS)
    if cfg.attention == "softmax":
        return performer, linformer
    name = f"model.attention={cfg.attention}"
    if encoding.attention_bias is not PositionalEncoding.attention_bias:
        raise ConfigError(f"{name} forms no attention scores for pos_encoding={cfg.pos_encoding} to bias: use "
                          "pos_encoding=rope, sinusoidal, learned or none, or model.attention=softmax")
    if cfg.attention_window is not None or any(layer.attention_window is not None for layer in cfg.layer_settings):
        raise ConfigError(f"{name} attends to the whole sequence and takes no sliding window: set "
                          "model.attention_window=null (and no model.layers[i].attention_window), or model.attention=softmax")
    if cfg.attn_softcap is not None:
        raise ConfigError(f"{name} forms no attention scores to soft-cap: set model.attn_softcap=null, or "
                          "model.attention=softmax")
    if cfg.attention == "performer":
        check_performer(performer)
        # no_cudnn (task=translation's) names no kernel either: PyTorch's choice among those that plan nothing.
        for key, value, default in (("attn_impl", cfg.attn_impl, "sdpa"), ("sdpa_backend", cfg.sdpa_backend, "auto")):
            if value != default and (key, value) != ("sdpa_backend", "no_cudnn"):
                raise ConfigError(f"{name} computes its attention itself, without SDPA kernels or attention weights: "
                                  f"drop model.{key}={value} (keep {default}), or use model.attention=softmax")
        if cfg.attn_dropout:
            raise ConfigError(f"{name} forms no attention weights to drop out: set model.attn_dropout=0, or "
                              "model.attention=softmax or linformer")
    else:
        check_linformer(linformer, cfg.max_seq_len)
    return performer, linformer


def check_performer(options: dict[str, Any]) -> None:
    for key, meaning in (("features", "null for head_dim * ln(head_dim)"), ("redraw_interval", "null to never redraw")):
        value = options[key]
        if value is not None and (not is_int(value) or value <= 0):
            raise ConfigError(f"model.performer.{key} must be a positive integer or null, got {value!r}: "
                              f"set e.g. model.performer.{key}=256, or {meaning}")


def check_linformer(options: dict[str, Any], max_seq_len: int) -> None:
    """Fill in ``k``'s default, max_seq_len / 4 (the smaller of the paper's k = 128, 256 at n = 512), and check."""
    if options["k"] is None:
        options["k"] = max(1, max_seq_len // 4)
    k = options["k"]
    if not is_int(k) or k <= 0 or k >= max_seq_len:
        raise ConfigError(f"model.linformer.k must be a positive integer below the context data.max_seq_len="
                          f"{max_seq_len} (the keys are projected from max_seq_len rows to k), got {k!r}: set e.g. "
                          f"model.linformer.k={max(1, max_seq_len // 4)}, or null for max_seq_len / 4")
    choose(LINFORMER_SHARINGS, options["sharing"], "model.linformer.sharing")


def default_features(head_dim: int) -> int:
    """Performer's m = d ln d random features for heads of width d (the paper's theory; performer-pytorch's default)."""
    return max(1, round(head_dim * math.log(head_dim))) if head_dim > 1 else 1


def orthogonal_gaussian(rows: int, dim: int, generator: torch.Generator) -> Tensor:
    """(rows, dim) directions, orthogonal within each block of ``dim`` rows, each row's norm that of a Gaussian vector
    (chi with ``dim`` degrees of freedom): Performer's positive orthogonal random features (ORF)."""
    blocks = []
    for _ in range(math.ceil(rows / dim)):
        q, r = torch.linalg.qr(torch.randn(dim, dim, generator=generator, dtype=torch.float64))
        # QR fixes the signs of R's diagonal, which biases Q's columns towards its conventions; the signs put back
        # make Q uniform over rotations (Mezzadri 2007), so no direction is favoured and the estimator stays unbiased.
        blocks.append((q * torch.sign(torch.diagonal(r))).T)  # (dim, dim) orthonormal rows
    directions = torch.cat(blocks)[:rows]  # (rows, dim)
    norms = torch.randn(rows, dim, generator=generator, dtype=torch.float64).norm(dim=1, keepdim=True)  # (rows, 1)
    return (directions * norms).float()


class PerformerFeatures(nn.Module):
    """One layer's random directions, redrawn every ``redraw_interval`` training steps (:meth:`redraw`).

    The directions of draw n come from a generator seeded by (``seed``, n): ``seed`` is drawn from the global RNG when
    the layer is built (so ``seed=`` sets it) and kept with the directions and the draw number in the state dict. A run
    resumed from a checkpoint draws at each step what the uninterrupted run drew."""

    def __init__(self, head_dim: int, features: int | None, redraw_interval: int | None, *, causal: bool,
                 scale_dim: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.features = default_features(head_dim) if features is None else features
        self.redraw_interval = redraw_interval
        self.causal = causal
        self.scale_dim = scale_dim
        self.register_buffer("seed", torch.randint(2**62, ()))
        self.register_buffer("draw", torch.zeros((), dtype=torch.long))
        self.register_buffer("projection", self._directions(0))  # (features, head_dim)

    def _directions(self, draw: int) -> Tensor:
        # One integer per (seed, draw): a large odd multiplier keeps nearby draws' seeds apart.
        generator = torch.Generator().manual_seed((int(self.seed) + draw * 0x9E3779B97F4A7C15) % 2**63)
        return orthogonal_gaussian(self.features, self.head_dim, generator)

    def redraw(self, step: int) -> None:
        """The directions of training step ``step``: draw ``step // redraw_interval`` (None: never redrawn)."""
        if self.redraw_interval is None:
            return
        draw = step // self.redraw_interval
        if draw != int(self.draw):
            self.projection.copy_(self._directions(draw).to(self.projection.device))
            self.draw.fill_(draw)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None) -> Tensor:
        """``q``: (B, nh, Tq, hs); ``k``, ``v``: (B, nh, Tk, hs), Tq <= Tk (a KV cache: the queries are the last Tq
        positions); ``keep``: (B or 1, 1, Tk) True at the keys that may be seen (not padding), or None. -> (B, nh, Tq, hs)
        in q's dtype. Under autocast too the features and the sums are fp32: exp of the logits is no bf16 business."""
        with torch.autocast(q.device.type, enabled=False):
            # .float(): a network cast to bf16 as a whole (precision=bf16-true) casts the directions too.
            y = favor(q.float(), k.float(), v.float(), self.projection.float(), keep, causal=self.causal,
                      scale_dim=self.scale_dim)
        return y.to(q.dtype)


def _logits(x: Tensor, projection: Tensor, scale_dim: float) -> Tensor:
    """w.x - |x|^2 / 2 for every direction w, x scaled by scale_dim^(-1/4) so that phi(q).phi(k) estimates
    exp(q.k / sqrt(scale_dim)): (B, nh, T, hs) -> (B, nh, T, features)."""
    x = x * scale_dim**-0.25
    return x @ projection.T - (x * x).sum(dim=-1, keepdim=True) / 2


def favor(q: Tensor, k: Tensor, v: Tensor, projection: Tensor, keep: Tensor | None, *, causal: bool,
          scale_dim: float) -> Tensor:
    """FAVOR+ attention (fp32 inputs): see :meth:`PerformerFeatures.forward`.

    Stabilisers, which cancel between numerator and denominator: each query's features are divided by their largest
    (its own constant); the keys' by the largest key logit over all the keys of the head (bidirectional) or over the
    keys up to the query (causal: a running maximum, so no query's arithmetic touches a later key)."""
    a_q = _logits(q, projection, scale_dim)  # (B, nh, Tq, m)
    phi_q = torch.exp(a_q - a_q.amax(dim=-1, keepdim=True).detach())  # (B, nh, Tq, m), largest 1
    a_k = _logits(k, projection, scale_dim)  # (B, nh, Tk, m)
    ones = torch.ones_like(v[..., :1])
    values = torch.cat((v, ones), dim=-1)  # (B, nh, Tk, hs + 1): the last column sums the denominator
    keep_k = None if keep is None else keep[..., None]  # (B or 1, 1, Tk, 1)
    if keep_k is not None:
        # A floor instead of -inf: a stack of padding then has finite running maxima (differences stay finite).
        a_k = a_k.masked_fill(~keep_k, torch.finfo(a_k.dtype).min / 2)
    if causal:
        out = _causal_favor(phi_q, a_k, values, keep_k)
    else:
        phi_k = torch.exp(a_k - a_k.amax(dim=(-2, -1), keepdim=True).detach())  # (B, nh, Tk, m)
        if keep_k is not None:
            phi_k = phi_k * keep_k
        out = phi_q @ (phi_k.transpose(-2, -1) @ values)  # (B, nh, Tq, hs + 1)
    numerator, denominator = out[..., :-1], out[..., -1:]
    # A query that sees no key (all padding) gets zero, as SDPA gives it, not 0 / 0.
    seen = denominator > 0
    return torch.where(seen, numerator / torch.where(seen, denominator, 1.0), 0.0)


def _causal_favor(phi_q: Tensor, a_k: Tensor, values: Tensor, keep_k: Tensor | None) -> Tensor:
    """Causal FAVOR+ by prefix sums, chunk by chunk. ``phi_q``: (B, nh, Tq, m) for the last Tq of the Tk keys;
    ``a_k``: (B, nh, Tk, m) key logits; ``values``: (B, nh, Tk, e) (e = hs + 1). -> (B, nh, Tq, e).

    With r_j the running maximum of the key logits up to j, key j enters query t (j <= t) as
    exp(a_j - r_j) exp(r_j - r_t): both factors at most 1, and r_t depends on keys up to t only. Inside a chunk the
    masked (C, C) block; across chunks the state sum_j exp(a_j - r) v_j^T of the chunks before, kept relative to the
    running maximum r at its last key. Every chunk's block and state contribution in one batched product; only the
    states' rescaled sum runs chunk after chunk."""
    length, keys, width = phi_q.size(-2), a_k.size(-2), values.size(-1)
    running = torch.cummax(a_k.amax(dim=-1), dim=-1).values.detach()  # (B, nh, Tk)
    phi_k = torch.exp(a_k - running[..., None])  # (B, nh, Tk, m), each at most 1
    if keep_k is not None:
        phi_k = phi_k * keep_k
    past = keys - length  # cached keys before the first query
    # The state of the keys before the first query, relative to the running maximum at the last of them.
    reference = running[..., max(past - 1, 0)]  # (B, nh)
    state = (phi_k[..., :past, :] * torch.exp(running[..., :past] - reference[..., None])[..., None]).transpose(-2, -1) \
        @ values[..., :past, :]  # (B, nh, m, e)
    phi_k, values, running = phi_k[..., past:, :], values[..., past:, :], running[..., past:]
    chunks = -(-length // CHUNK)
    pad = chunks * CHUNK - length  # after the last query: no query before it sees the padding
    if pad:
        phi_q, phi_k, values = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (phi_q, phi_k, values))
        running = torch.cat((running, running[..., -1:].expand(*running.shape[:-1], pad)), dim=-1)
    lead = phi_q.shape[:-2]
    q, k = phi_q.reshape(*lead, chunks, CHUNK, -1), phi_k.reshape(*lead, chunks, CHUNK, -1)  # (B, nh, n, C, m)
    v, r = values.reshape(*lead, chunks, CHUNK, width), running.reshape(*lead, chunks, CHUNK)
    lower = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()  # (C, C): key j <= query t
    decay = (r[..., None, :] - r[..., :, None]).masked_fill(~lower, 0.0)  # (B, nh, n, C, C): r_j - r_t <= 0
    scores = torch.where(lower, (q @ k.transpose(-2, -1)) * torch.exp(decay), 0.0)  # (B, nh, n, C, C)
    last = r[..., -1]  # (B, nh, n): each chunk's running maximum at its last key
    own = (k * torch.exp(r - last[..., None])[..., None]).transpose(-2, -1) @ v  # (B, nh, n, m, e)
    before, references = [], []
    for chunk in range(chunks):
        before.append(state)
        references.append(reference)
        state = torch.exp(reference - last[..., chunk])[..., None, None] * state + own[..., chunk, :, :]
        reference = last[..., chunk]
    carried = torch.exp(torch.stack(references, dim=-1)[..., None] - r)[..., None] \
        * (q @ torch.stack(before, dim=-3))  # (B, nh, n, C, e)
    return (scores @ v + carried).reshape(*lead, chunks * CHUNK, width)[..., :length, :]


class LinformerProjection(nn.Module):
    """Wang et al.'s E and F (k, max_seq_len) of one layer, shared by its heads (``sharing``: headwise, or kv: E = F).

    A shorter sequence uses the first T columns (as a sequence zero-padded to max_seq_len would); padded keys and values
    are zeroed before the projection, so padding adds nothing to the k projected rows."""

    def __init__(self, k: int, max_seq_len: int, sharing: str) -> None:
        super().__init__()
        choose(LINFORMER_SHARINGS, sharing, "model.linformer.sharing")
        bound = k**-0.5  # linformer's (lucidrains) initialisation: uniform within 1/sqrt(k)
        self.key_projection = nn.Parameter(torch.empty(k, max_seq_len).uniform_(-bound, bound))
        self.value_projection = (None if sharing == "kv"
                                 else nn.Parameter(torch.empty(k, max_seq_len).uniform_(-bound, bound)))

    def forward(self, k: Tensor, v: Tensor, keep: Tensor | None) -> tuple[Tensor, Tensor]:
        """``k``, ``v``: (B, n_kv_heads, T, hs); ``keep``: (B or 1, 1, T) True at real tokens, or None ->
        the projected keys and values (B, n_kv_heads, k, hs)."""
        length = k.size(-2)
        if length > self.key_projection.size(1):
            raise ConfigError(f"model.attention=linformer projects at most data.max_seq_len={self.key_projection.size(1)} "
                              f"positions, got a sequence of {length}: raise data.max_seq_len or shorten the sequence")
        if keep is not None:
            k, v = k * keep[..., None].to(k.dtype), v * keep[..., None].to(v.dtype)
        e = self.key_projection[:, :length].to(k.dtype)  # (k, T)
        f = e if self.value_projection is None else self.value_projection[:, :length].to(v.dtype)
        return e @ k, f @ v


def build_mixer(attention: str, options: dict[str, Any], *, head_dim: int, scale_dim: float, max_seq_len: int,
                causal: bool) -> nn.Module | None:
    """The module that replaces softmax attention's scores in one layer (None: softmax)."""
    if attention == "performer":
        return PerformerFeatures(head_dim, options["features"], options["redraw_interval"], causal=causal,
                                 scale_dim=scale_dim)
    if attention == "linformer":
        return LinformerProjection(options["k"], max_seq_len, options["sharing"])
    return None


def redraw_features(module: nn.Module, step: int) -> None:
    """Every Performer layer of ``module`` takes the random directions of training step ``step``."""
    for layer in module.modules():
        if isinstance(layer, PerformerFeatures):
            layer.redraw(step)
