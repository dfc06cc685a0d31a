"""A trident language model as one GGUF file (``trident-export --format gguf``), the format llama.cpp, Ollama and
LM Studio run, written with llama.cpp's own writer (the ``gguf`` package, trident's ``[gguf]`` extra) as llama.cpp's
``convert_hf_to_gguf.py`` writes the Hugging Face model of the same family:

- the family's Hugging Face config and state dict come from its hf adapter (``from_trident``, which refuses what the
  family cannot state), renamed to llama.cpp's tensor names by ``gguf.TensorNameMap``;
- GPT-2's Conv1D weights (``c_attn``, ``c_proj``, ``c_fc``: stored ``(in, out)``) transposed to ``(out, in)``;
  llama.cpp's ``llama`` architecture (Llama, Mistral) rotates interleaved pairs where transformers rotates halves, so
  the rows of ``q_proj`` and ``k_proj`` (weights and biases) are permuted per head (``LlamaModel.permute``); Qwen2's
  and Qwen3's rope rotates halves in llama.cpp too (NEOX): no permutation; Gemma's norm gains are 1 + weight in
  transformers, the gain itself in llama.cpp: written + 1;
- a tied head is not written (llama.cpp and transformers' reader tie ``output`` to ``token_embd`` when it is absent),
  but GPT-2's: llama.cpp builds before 2025 refuse a GPT-2 without ``output`` (its converter wrote a copy until then);
- norms, biases and GPT-2's position table stay float32 whatever the type (llama.cpp keeps them so); the other matrices
  are ``--gguf-type`` (f16, bf16, f32 or q8_0: blocks of 32 along a row, one f16 scale each; a row whose length 32
  does not divide falls back to f16, as in llama.cpp);
- the metadata: the shape (layers, width, feed-forward width, heads, key/value heads, head width), the norm epsilon,
  rope's base, the context length, and the tokenizer (``gguf_vocab``).

Only what transformers' GGUF reader (``from_pretrained(dir, gguf_file=...)``) reads back into the same model is
written: it takes some settings from its config classes' defaults instead of the file (GPT-2's 1,024 positions and
4 x width feed-forward, Qwen3's head width of 128, Gemma's soft-caps and score scale), and no biases or rope scaling
for these architectures, no sliding window but Gemma's (whose pattern llama.cpp fixes); a run that differs is refused
in one line (:func:`require_readable`, :func:`require_gemma`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer
from torch import Tensor

from trident.errors import ConfigError
from trident.models import CausalLM
from trident.weights.adapters.common import require_equivalent
from trident.weights.adapters.gguf_vocab import add_vocabulary
from trident.weights.adapters.registry import adapter_for_network

# The hf adapter's model_type -> llama.cpp's architecture (convert_hf_to_gguf.py writes Mistral as llama).
ARCHITECTURES = {"gpt2": "gpt2", "llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                 "gemma2": "gemma2", "gemma3_text": "gemma3"}
FAMILIES = "GPT-2, Llama, Mistral, Qwen2, Qwen3, Gemma 2 and Gemma 3 causal language models"
# The architectures whose rope llama.cpp applies to interleaved pairs: q and k rows permuted (LlamaModel.permute).
INTERLEAVED_ROPE = ("llama",)
# GPT-2's Conv1D weights, (in, out) in Hugging Face's files and (out, in) in GGUF's.
CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
# Settings transformers' GGUF reader takes from its config classes, not from the file.
GPT2_POSITIONS, QWEN3_HEAD_DIM = 1024, 128
# Gemma's, which llama.cpp also fixes: every n-th layer global, the others sliding (llama.cpp's swa pattern); the
# attention soft-caps (Gemma 2's written, but read by transformers from Gemma2Config); the head width the scores are
# scaled by (query_pre_attn_scalar in transformers, the head width in llama.cpp); Gemma 3's sliding layers' rope base.
GEMMA = {"gemma2": {"every": 2, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
         "gemma3": {"every": 6, "attn_logit_softcapping": None, "final_logit_softcapping": None}}
GEMMA_HEAD_DIM, GEMMA3_LOCAL_BASE = 256, 10000.0
# The file in the --out directory.
GGUF_FILE = "model.gguf"


def architecture_of(net: Any) -> tuple[str, Any]:
    """llama.cpp's architecture name for ``net`` and its hf adapter; one line for a network GGUF does not hold."""
    # The network's adapter says what it is (no switch on network classes outside trident.models): a masked LM's is
    # BERT's, an image network's ViT's, none of them an architecture llama.cpp runs.
    try:
        adapter = adapter_for_network(net)
    except ConfigError:
        adapter = None
    if adapter is None or adapter.MODEL_TYPE not in ARCHITECTURES:
        raise ConfigError(f"a {type(net).__name__} has no GGUF export: it writes {FAMILIES}")
    return ARCHITECTURES[adapter.MODEL_TYPE], adapter


def require_gemma(arch: str, net: CausalLM, settings: Mapping[str, Any]) -> None:
    """One line for each setting of a Gemma that transformers' GGUF reader or llama.cpp would read otherwise."""
    cfg, target, fixed = net.cfg, f"GGUF ({arch})", GEMMA[arch]
    pattern = ["sliding_attention" if (i + 1) % fixed["every"] else "full_attention" for i in range(cfg.n_layers)]
    kinds = settings["layer_types"]
    # A Gemma 2 with no sliding layer reads right: its window is written as the context, which slides nothing.
    require_equivalent(kinds == pattern or (arch == "gemma2" and "sliding_attention" not in kinds), "model.layers",
                       cfg.layers, target, f"llama.cpp and transformers' GGUF reader fix its layers as {pattern}")
    for name, setting in (("attn_logit_softcapping", "model.attn_softcap"),
                          ("final_logit_softcapping", "model.final_logit_softcap")):
        require_equivalent(settings[name] == fixed[name], setting, settings[name], target,
                           f"transformers' GGUF reader takes it as {fixed[name]}, its config default")
    require_equivalent(cfg.head_dim == GEMMA_HEAD_DIM == settings["query_pre_attn_scalar"], "model.head_dim",
                       f"{cfg.head_dim} (attn_scale_dim {settings['query_pre_attn_scalar']})", target,
                       f"transformers' GGUF reader scales scores by {GEMMA_HEAD_DIM}, llama.cpp by the head width")
    require_equivalent(not cfg.qkv_bias, "model.qkv_bias", cfg.qkv_bias, target,
                       "transformers' GGUF reader reads no attention biases")
    ropes = settings["rope_parameters"]
    full, local = (ropes["full_attention"], ropes["sliding_attention"]) if arch == "gemma3" else (ropes, ropes)
    require_equivalent(full["rope_type"] == local["rope_type"] == "default", "pos_encoding.options.scaling",
                       full.get("factor"), target, "transformers' GGUF reader reads no rope scaling for it")
    if arch == "gemma3":
        require_equivalent(local["rope_theta"] == GEMMA3_LOCAL_BASE, "model.layers", cfg.layers, target,
                           f"its sliding layers' rope base is {GEMMA3_LOCAL_BASE:g} in llama.cpp and transformers")


def require_readable(arch: str, net: CausalLM, model_type: str, settings: Mapping[str, Any]) -> None:
    """One line for each setting transformers' GGUF reader of ``arch`` would read otherwise than the run has it."""
    cfg, target = net.cfg, f"GGUF ({arch})"
    if arch in GEMMA:
        require_gemma(arch, net, settings)
        return
    if arch == "gpt2":
        require_equivalent(cfg.d_ff == 4 * cfg.d_model, "model.d_ff", cfg.d_ff, target,
                           "transformers' GGUF reader takes GPT-2's feed-forward width as 4 * model.d_model")
        require_equivalent(cfg.max_seq_len == GPT2_POSITIONS, "data.max_seq_len", cfg.max_seq_len, target,
                           f"transformers' GGUF reader takes GPT-2's position table as {GPT2_POSITIONS} rows")
        require_equivalent(cfg.activation == "gelu_tanh", "model.activation", cfg.activation, target,
                           "llama.cpp's GPT-2 uses the tanh GELU (gelu_tanh)")
        return
    scaling = cfg.pos_encoding_options.get("scaling")
    require_equivalent(scaling is None, "pos_encoding.options.scaling", scaling, target,
                       "transformers' GGUF reader reads no rope scaling for it")
    windows = [layer.attention_window for layer in cfg.layer_settings]
    require_equivalent(windows == [None] * cfg.n_layers, "model.attention_window", cfg.attention_window, target,
                       "llama.cpp's and transformers' GGUF readers of it have no sliding window")
    require_equivalent(not cfg.memory_length, "model.memory_length", cfg.memory_length, target, "it keeps no memory")
    qkv_bias = model_type == "qwen2"  # Qwen2's q, k and v always have biases; the others' none
    require_equivalent(cfg.qkv_bias == qkv_bias and not cfg.attn_out_bias and not cfg.mlp_bias, "model.bias",
                       cfg.bias, target, "transformers' GGUF reader reads biases on Qwen2's q, k and v only")
    if arch == "qwen2":
        require_equivalent(cfg.head_dim * cfg.n_heads == cfg.d_model, "model.head_dim", cfg.head_dim, target,
                           "transformers' GGUF reader takes Qwen2's head width as model.d_model / model.n_heads")
    if arch == "qwen3":
        require_equivalent(cfg.head_dim == QWEN3_HEAD_DIM, "model.head_dim", cfg.head_dim, target,
                           f"transformers' GGUF reader takes Qwen3's head width as {QWEN3_HEAD_DIM}")


def add_settings(writer: Any, arch: str, settings: Mapping[str, Any], net: CausalLM) -> None:
    """The model's shape in ``writer``'s metadata, the keys convert_hf_to_gguf.py writes for ``arch``."""
    cfg = net.cfg
    writer.add_block_count(cfg.n_layers)
    writer.add_context_length(cfg.max_seq_len)
    writer.add_embedding_length(cfg.d_model)
    writer.add_feed_forward_length(cfg.d_ff)
    writer.add_head_count(cfg.n_heads)
    if arch == "gpt2":
        writer.add_layer_norm_eps(cfg.norm_eps)
        return
    writer.add_head_count_kv(cfg.n_kv_heads)
    rope = settings["rope_parameters"]
    writer.add_rope_freq_base(float((rope["full_attention"] if arch == "gemma3" else rope)["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.norm_eps)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    if arch == "llama":
        writer.add_vocab_size(net.vocab_size)
        writer.add_rope_dimension_count(cfg.head_dim)
    if arch in GEMMA:
        writer.add_sliding_window(int(settings["sliding_window"]))
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if settings[name] is not None:
                getattr(writer, f"add_{name}")(float(settings[name]))


def permute(weights: Tensor, n_heads: int) -> Tensor:
    """llama.cpp's ``LlamaModel.permute``: each head's rows from halves (rotate_half) to interleaved pairs.
    (heads * head_dim, ...) -> the same shape."""
    return weights.reshape(n_heads, 2, weights.shape[0] // n_heads // 2, *weights.shape[1:]) \
        .swapaxes(1, 2).reshape(weights.shape)


def gguf_tensors(arch: str, state: Mapping[str, Tensor], net: CausalLM) -> dict[str, Tensor]:
    """The state dict (Hugging Face's names) in llama.cpp's names and layouts, without a tied head (but GPT-2's)."""
    import gguf

    arch_id = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    names = gguf.get_tensor_name_map(arch_id, net.cfg.n_layers)
    # GPT-2's head is written tied or not: older llama.cpp builds require it (transformers then reads it untied).
    skip_head = net.head.weight is net.embed.weight and arch != "gpt2"
    out = {}
    for name, tensor in state.items():
        if skip_head and name == "lm_head.weight":
            continue
        stem, suffix = name.rsplit(".", 1)
        new_name = names.get_name(stem)
        if new_name is None:
            raise RuntimeError(f"gguf {gguf.__version__} has no llama.cpp name for {name} ({arch})")
        if arch == "gpt2" and name.endswith(CONV1D):
            tensor = tensor.T  # (in, out) -> (out, in)
        if arch in GEMMA and name.endswith("norm.weight"):
            tensor = tensor + 1  # Gemma's RMSNorm gain is 1 + weight; llama.cpp's norms multiply by the gain itself
        if arch in INTERLEAVED_ROPE and stem.endswith(("q_proj", "k_proj")):
            tensor = permute(tensor, net.cfg.n_heads if stem.endswith("q_proj") else net.cfg.n_kv_heads)
        out[f"{new_name}.{suffix}"] = tensor
    return out


def stored_type(name: str, data: np.ndarray, chosen: Any) -> Any:
    """The GGML type llama.cpp stores a tensor in: float32 for vectors, norms and the position table, else ``chosen``."""
    import gguf

    if data.ndim <= 1 or name.endswith("_norm.weight") or name.startswith("position_embd."):
        return gguf.GGMLQuantizationType.F32
    return chosen


def add_tensors(writer: Any, tensors: Mapping[str, Tensor], chosen: Any) -> None:
    """Each tensor in its stored type; q8_0 of a row length 32 does not divide falls back to f16 (llama.cpp's rule)."""
    import gguf

    for name, tensor in tensors.items():
        data = tensor.detach().float().contiguous().numpy()
        kind = stored_type(name, data, chosen)
        try:
            packed = gguf.quants.quantize(data, kind)
        except gguf.QuantError:
            kind = gguf.GGMLQuantizationType.F16
            packed = gguf.quants.quantize(data, kind)
        writer.add_tensor(name, packed, raw_dtype=kind)


def file_type(gguf_type: str) -> Any:
    """``general.file_type`` of a ``--gguf-type``: llama.cpp's LlamaFileType (ALL_F32, MOSTLY_F16...)."""
    import gguf

    return gguf.LlamaFileType["ALL_F32" if gguf_type == "f32" else f"MOSTLY_{gguf_type.upper()}"]


def write_gguf(net: Any, tokenizer: Tokenizer | None, tokenizer_settings: Mapping[str, str], directory: Path,
               gguf_type: str) -> None:
    """``net`` (a task=lm network) and its tokenizer as ``directory/model.gguf`` in ``gguf_type``."""
    arch, adapter = architecture_of(net)
    _, settings, state = adapter.from_trident(net)  # refuses what the family's config cannot state
    require_readable(arch, net, adapter.MODEL_TYPE, settings)
    if tokenizer is None:
        raise ConfigError("the run has no tokenizer (it trained on token ids) to write into the GGUF file, which "
                          "llama.cpp tokenizes with: export a run trained with a tokenizer")
    import gguf

    path = directory / GGUF_FILE
    writer = gguf.GGUFWriter(path, arch)
    writer.add_type(gguf.GGUFType.MODEL)
    # transformers' reader reads a llama file whose name holds "mistral" as Mistral (a 4,096-token window by default):
    # the name is the architecture's, never a run's.
    writer.add_name(f"trident {arch}")
    add_settings(writer, arch, settings, net)
    writer.add_file_type(file_type(gguf_type))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_vocabulary(writer, net, tokenizer, tokenizer_settings, net.vocab_size)
    add_tensors(writer, gguf_tensors(arch, state, net), gguf.GGMLQuantizationType[gguf_type.upper()])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()
