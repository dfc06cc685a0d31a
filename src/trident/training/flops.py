"""Model FLOPs per training step, and the peak FLOP/s of the device, for model FLOPs utilisation.

MFU = (model FLOPs per step x steps per second) / peak FLOP/s (PaLM, Chowdhery et al. 2022,
appendix B; nanoGPT's ``estimate_mfu``). Model FLOPs count the matrix multiplications of one
forward and backward pass; the backward pass costs twice the forward (gradients with respect to
inputs and to weights), so a weight matrix with ``n`` entries costs ``6 n`` FLOPs per token it is
applied to. Attention adds its two score matmuls, QK^T and AV: ``4 d T_k`` forward FLOPs per
query token and layer, ``12 d T_k`` with backward, where ``T_k`` is the number of keys and ``d`` the width
of the query heads (d_model unless ``model.head_dim`` sets another; grouped-query attention shrinks the K
and V projections, not the score matmuls). Causal
attention is counted in full, as in PaLM; recomputation (activation checkpointing), biases,
norms, softmax and embedding lookups are not counted: MFU measures useful work. Counts use the
padded tensor shapes, since padded positions are computed too.

Self-attention counts the matmuls of its ``model.attention`` (:func:`self_attention_flops`): Performer has no
(T_q, T_k) scores but its features and sums (linear in T), Linformer projects the keys and values to ``k`` rows
before attending to them; cross-attention is softmax's always. A segment-recurrence memory (``model.memory_length``)
adds its projections and keys (:func:`memory_flops`).

A frozen network that only runs forward in the step (a distillation teacher, ``distill=kd``) costs its forward
alone: every count takes ``training=False`` for it (:func:`passes`), and the task adds it to the student's
(trident.tasks.teacher.teacher_flops): the step does that work, and MFU says how well the device is used.
"""

from __future__ import annotations

import functools
import logging
import re
import time

import torch

from trident.backbone import CHUNK, GATED_ACTIVATIONS, TransformerConfig, default_features

log = logging.getLogger(__name__)

FORWARD_AND_BACKWARD = 3  # the backward pass costs two forward passes


def passes(training: bool) -> int:
    """Forward passes' worth of FLOPs a trained matmul costs (3: forward and backward), or a frozen network's (1)."""
    return FORWARD_AND_BACKWARD if training else 1


def query_width(cfg: TransformerConfig) -> int:
    """Width of all query heads together (and of the attention output): d_model unless model.head_dim says otherwise."""
    return cfg.n_heads * cfg.head_dim


def key_value_width(cfg: TransformerConfig) -> int:
    """Width of the keys (and of the values): fewer heads than the queries under grouped-query attention."""
    return cfg.n_kv_heads * cfg.head_dim


def block_matmul_params(cfg: TransformerConfig) -> int:
    """Weights applied to every token of a self-attention block: Q, K, V, output, feed-forward."""
    ffn_in = 2 * cfg.d_ff if cfg.activation in GATED_ACTIVATIONS else cfg.d_ff  # swiglu, geglu_tanh: gate and value
    attention = (2 * query_width(cfg) + 2 * key_value_width(cfg)) * cfg.d_model
    return attention + (ffn_in + cfg.d_ff) * cfg.d_model


def attention_flops(cfg: TransformerConfig, queries: int, keys: int, *, training: bool = True) -> int:
    """Forward + backward FLOPs (forward alone unless ``training``) of the score matmuls of one layer: QK^T and AV,
    2 FLOPs per pair and query channel each (every query head scores its keys, however many query heads share them)."""
    return passes(training) * 2 * 2 * query_width(cfg) * queries * keys


def self_attention_flops(cfg: TransformerConfig, queries: int, keys: int, *, causal: bool, training: bool = True) -> int:
    """Forward + backward FLOPs (forward alone unless ``training``) of one layer's self-attention after its
    projections, as ``model.attention`` computes it.

    * softmax: :func:`attention_flops` (the (T_q, T_k) scores).
    * performer (m features, e = head_dim + 1: the values and the denominator's column of ones): the features of the
      queries and keys (2 m head_dim each per head and token; forward and the input gradient only, the directions
      being buffers), then bidirectionally phi(K)^T [V 1] and phi(Q) of it (2 m e per head and key, and query);
      causally, per chunk of CHUNK positions (the queries padded to a whole chunk), the chunk's (C, C) block (2 C m
      and 2 C e per head and position) and its state in and out (2 m e each; a single chunk's state out has no backward).
      The causal count grows linearly in T too, but CHUNK times (m + e) / (2 m e) above the bidirectional one.
    * linformer (k rows): E K and F V (2 k head_dim per key-value head and key each), then softmax over the k rows."""
    times = passes(training)
    if cfg.attention == "performer":
        m, e = cfg.performer["features"] or default_features(cfg.head_dim), cfg.head_dim + 1
        features = (2 if training else 1) * 2 * m * query_width(cfg) * (queries + keys)  # forward + input gradient
        if not causal:
            return features + times * 2 * cfg.n_heads * m * e * (queries + keys)
        chunks = -(-queries // CHUNK)
        block = 2 * cfg.n_heads * CHUNK * (CHUNK * m + CHUNK * e + m * e)  # the (C, C) block and the state in
        state_out = 2 * cfg.n_heads * CHUNK * m * e
        if chunks == 1:  # its state out is computed, but read by nothing: no backward
            return features + times * block + state_out
        # The chunks' states out are one batched product: its backward covers the last (unread) one too.
        return features + times * chunks * (block + state_out)
    if cfg.attention == "linformer":
        rows = cfg.linformer["k"]
        return (times * 2 * 2 * rows * key_value_width(cfg) * keys
                + attention_flops(cfg, queries, rows, training=training))
    return attention_flops(cfg, queries, keys, training=training)


def stack_flops(cfg: TransformerConfig, batch: int, length: int, *, causal: bool, training: bool = True) -> int:
    """One training step (one forward unless ``training``) of a self-attention stack (encoder, or ``causal``
    decoder) on (batch, length) tokens."""
    matmuls = passes(training) * 2 * cfg.n_layers * block_matmul_params(cfg) * batch * length
    return matmuls + cfg.n_layers * batch * self_attention_flops(cfg, length, length, causal=causal, training=training)


def causal_lm_flops(cfg: TransformerConfig, vocab_size: int, batch: int, length: int, *, training: bool = True,
                    memory: bool = True) -> int:
    """One training step (one forward unless ``training``) of a decoder-only LM on (batch, length) tokens, the output
    head included; with ``model.memory_length`` M, the memory's too (:func:`memory_flops`) where the network reads it
    (``memory``: a teacher's memory stays unread beside a student without one)."""
    head = passes(training) * 2 * cfg.d_model * vocab_size * batch * length
    recurrence = memory_flops(cfg, batch, length, training=training) if memory else 0
    return stack_flops(cfg, batch, length, causal=True, training=training) + head + recurrence


def memory_flops(cfg: TransformerConfig, batch: int, length: int, *, training: bool = True) -> int:
    """What a full memory of ``model.memory_length`` M states per layer (trident.backbone.memory) adds to a stack's
    step on (batch, length) tokens: each layer projects Q, K and V over [memory; segment] in one matmul (the memory's
    queries dropped after it) and its queries score M more keys. The backward of that projection runs over the
    memory's rows too (the weight gradient needs them; the input gradient is one matmul over the whole). Counted at
    a full memory: the first ceil(M / length) segments of an epoch read fewer states, as the budget's first batch."""
    states = cfg.memory_length
    if not states:
        return 0
    projection = passes(training) * 2 * (query_width(cfg) + 2 * key_value_width(cfg)) * cfg.d_model * states
    return cfg.n_layers * batch * (projection + attention_flops(cfg, length, states, training=training))


def masked_lm_flops(cfg: TransformerConfig, vocab_size: int, batch: int, length: int, predicted: int) -> int:
    """One training step of an encoder-only masked LM: the bidirectional stack on every token (its
    attention is full, not causal), the head (transform and vocabulary projection) on the
    ``predicted`` selected positions only, as the model computes it."""
    head = FORWARD_AND_BACKWARD * 2 * (cfg.d_model + vocab_size) * cfg.d_model * predicted
    return stack_flops(cfg, batch, length, causal=False) + head


def encoder_decoder_flops(cfg: TransformerConfig, vocab_size: int, batch: int, src_len: int, tgt_len: int, *,
                          training: bool = True) -> int:
    """One training step (one forward unless ``training``) of the translation model: encoder on the source, decoder
    with cross-attention on the target (its keys/values projected from the source), output head."""
    d, layers = cfg.d_model, cfg.n_layers
    per_token = passes(training) * 2
    encoder = per_token * layers * block_matmul_params(cfg) * batch * src_len
    encoder += layers * batch * self_attention_flops(cfg, src_len, src_len, causal=False, training=training)
    # Decoder: self-attention and feed-forward, plus the cross-attention query and output
    # projections on target tokens; the cross-attention key/value projection on source tokens.
    decoder = per_token * layers * (block_matmul_params(cfg) + 2 * d * query_width(cfg)) * batch * tgt_len
    decoder += per_token * layers * 2 * d * key_value_width(cfg) * batch * src_len
    decoder += layers * batch * (self_attention_flops(cfg, tgt_len, tgt_len, causal=True, training=training)
                                 + attention_flops(cfg, tgt_len, src_len, training=training))
    head = per_token * d * vocab_size * batch * tgt_len
    return encoder + decoder + head


def vit_flops(cfg: TransformerConfig, *, batch: int, patch_size: int, in_channels: int, num_classes: int,
              training: bool = True) -> int:
    """One training step (one forward unless ``training``) of a ViT: patch projection, encoder over prefix + patch
    tokens, class head (and DeiT's distillation head, which every step runs: its logits are averaged in or taught)."""
    if cfg.grid is None:
        raise ValueError("vit_flops needs a TransformerConfig with a patch grid")
    patches = cfg.grid[0] * cfg.grid[1]
    tokens = cfg.num_prefix_tokens + patches
    per_token = passes(training) * 2
    # The pixels need no gradient: the patch projection costs its forward and weight gradient only.
    patch_embed = (2 if training else 1) * 2 * in_channels * patch_size**2 * cfg.d_model * patches
    encoder = per_token * cfg.n_layers * block_matmul_params(cfg) * tokens
    encoder += cfg.n_layers * self_attention_flops(cfg, tokens, tokens, causal=False, training=training)
    heads = 1 + int(cfg.distillation_token)
    head = heads * per_token * cfg.d_model * num_classes  # one pooled vector per image and head
    return batch * (patch_embed + encoder + head)


# Dense (no structured sparsity) peak FLOP/s from NVIDIA's data sheets, per compute dtype;
# "tf32" is float32 matmuls on tensor cores (torch.set_float32_matmul_precision("high")).
# Keys are matched as whole words of the lower-cased torch.cuda.get_device_name(), in order
# (so "l4" does not match an L40S).
# (Lightning's table lists sparse peaks for the H200 and does not match the name "NVIDIA H200".)
GPU_PEAK_FLOPS: dict[str, dict[str, float]] = {
    "h200 nvl": {"bf16": 835e12, "fp16": 835e12, "tf32": 417.5e12, "fp32": 60e12},
    "h200": {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12},
    "h100 pcie": {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51.2e12},
    "h100": {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12},  # SXM (HBM3)
    "a100": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
    "l4": {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "fp32": 30.3e12},
    "a10g": {"bf16": 125e12, "fp16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12},  # A10 data sheet
    "v100-pcie": {"fp16": 112e12, "fp32": 14e12},
    "v100": {"fp16": 125e12, "fp32": 15.7e12},  # SXM2
    "t4": {"fp16": 65e12, "fp32": 8.1e12},
}


def compute_dtype(precision: str) -> str:
    """Lightning's precision setting ("bf16-mixed", "16-mixed", "32-true", ...) -> the dtype matmuls run in."""
    if precision.startswith("bf16"):
        return "bf16"
    if precision.startswith("16"):
        return "fp16"
    if precision.startswith("64"):
        return "fp64"
    return "tf32" if torch.get_float32_matmul_precision() != "highest" else "fp32"


def gpu_peak_flops(device_name: str, dtype: str) -> float | None:
    """Table peak of a known GPU in ``dtype``, or None when the GPU or dtype is not listed."""
    name = device_name.lower()
    for key, peaks in GPU_PEAK_FLOPS.items():
        if re.search(rf"\b{re.escape(key)}\b", name):
            if dtype == "tf32" and "tf32" not in peaks:
                dtype = "fp32"  # pre-Ampere GPUs run float32 matmuls without tensor cores
            return peaks.get(dtype)
    return None


_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "tf32": torch.float32,
                 "fp64": torch.float64}


@functools.cache
def measured_peak_flops(device_type: str, dtype: str, size: int = 1024, repeats: int = 5) -> float:
    """Best FLOP/s of a square matmul: an achievable peak for devices without a data-sheet value
    (CPUs), measured once per process and device type. Uses the threads torch is set to use."""
    a = torch.randn(size, size, device=device_type, dtype=_TORCH_DTYPES[dtype])
    b = torch.randn(size, size, device=device_type, dtype=_TORCH_DTYPES[dtype])
    best = float("inf")
    for _ in range(repeats + 1):  # the first run warms up the kernels
        start = time.perf_counter()
        (a @ b).sum().item()  # .item() waits for asynchronous devices
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def device_peak_flops(device: torch.device, dtype: str) -> float | None:
    """Peak FLOP/s of one device in ``dtype``: the data-sheet table for GPUs, a measurement otherwise."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak_flops(name, dtype)
        if peak is None:
            log.warning("no peak FLOP/s known for %r in %s: set callbacks.throughput.peak_flops to log MFU",
                        name, dtype)
        return peak
    peak = measured_peak_flops(device.type, dtype)
    log.info("measured %s peak: %.3g FLOP/s in %s (matmul benchmark)", device.type, peak, dtype)
    return peak
