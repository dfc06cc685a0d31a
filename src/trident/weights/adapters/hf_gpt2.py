"""GPT-2 (``GPT2LMHeadModel`` / ``GPT2Model``) <-> trident's ``CausalLM`` (a causal LM).

Both are pre-norm decoders with learned positions and a final LayerNorm. GPT-2's linear layers
are ``Conv1D`` modules whose weight is stored (in, out), the transpose of ``nn.Linear``'s; its
``gelu_new`` is GELU's tanh approximation (trident's ``gelu_tanh``); its head is tied to the
token embedding unless ``tie_word_embeddings`` is false.
"""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer
from torch import Tensor

from trident.data.tokenization import END_OF_TEXT, UNK
from trident.models import CausalLM
from trident.models.properties import MAX_SEQ_LEN, SCALED_EMBEDDING, TIED_HEAD
from trident.weights.adapters.common import (
    activation_from_hf,
    activation_to_hf,
    hf_model_settings,
    require_hf_block,
    require_source,
    strip_prefix,
)
from trident.weights.adapters.outside_network import OutsideNetwork, require_property

FORMAT = "hf-gpt2"
MODEL_TYPE = "gpt2"
FAMILY = "gpt2"  # model.family of the stacks it reads and writes
ARCHITECTURES = ("GPT2LMHeadModel", "GPT2Model")
NETWORK = CausalLM
TARGET = "GPT-2 (hf export)"
# Tokenizer attribute -> token, where the run's vocabulary has it: GPT-2 begins and ends a text with
# <|endoftext|> and has no padding token; trident's character vocabularies have <unk>.
SPECIAL_TOKENS = {"bos_token": END_OF_TEXT, "eos_token": END_OF_TEXT, "unk_token": UNK}

# GPT-2 block module -> trident block module, each with a weight and a bias.
_MODULES = {"ln_1": "self_attn_norm", "attn.c_attn": "self_attn.qkv_proj", "attn.c_proj": "self_attn.out_proj",
            "ln_2": "ffn_norm", "mlp.c_fc": "ffn.fc_in", "mlp.c_proj": "ffn.fc_out"}
_CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")  # their weights are stored (in, out)
# GPT-2 block tensor -> trident block tensor, and whether it is a Conv1D weight (stored transposed).
_BLOCK = {f"{theirs}.{part}": (f"{ours}.{part}", part == "weight" and theirs in _CONV1D)
          for theirs, ours in _MODULES.items() for part in ("weight", "bias")}
_TOP = {"wte.weight": "embed.weight", "wpe.weight": "decoder.pos_encoding.embedding.weight",
        "ln_f.weight": "decoder.final_norm.weight", "ln_f.bias": "decoder.final_norm.bias"}


def _blocks(state: dict[str, Tensor], n_layers: int, *, to_trident: bool) -> dict[str, Tensor]:
    """The blocks' tensors of ``state`` in the other naming: GPT-2's ``h.<i>.*`` (without ``transformer.``)
    -> trident's ``decoder.blocks.<i>.*``, or back; a Conv1D weight is transposed either way."""
    out: dict[str, Tensor] = {}
    for i in range(n_layers):
        for name, (target, transposed) in _BLOCK.items():
            read, write = (f"h.{i}.{name}", f"decoder.blocks.{i}.{target}")[:: 1 if to_trident else -1]
            out[write] = state[read].t().contiguous() if transposed else state[read]
    return out


def to_trident(config: dict[str, Any], state: dict[str, Tensor], tokenizer: Tokenizer | None, source: str) -> OutsideNetwork:
    require_source(not config.get("add_cross_attention", False), source, "cross-attention layers")
    require_source(config.get("scale_attn_weights", True), source, "unscaled attention (scale_attn_weights=false)")
    require_source(not config.get("scale_attn_by_inverse_layer_idx", False), source,
                   "attention scaled by the inverse layer index")
    d_model, n_layers = int(config["n_embd"]), int(config["n_layer"])
    tied = bool(config.get("tie_word_embeddings", True))
    backbone = strip_prefix(state, "transformer.")
    out = {_TOP[name]: backbone[name] for name in _TOP} | _blocks(backbone, n_layers, to_trident=True)
    head = state.get("lm_head.weight")
    out["head.weight"] = out["embed.weight"] if tied or head is None else head
    return OutsideNetwork(
        source=source,
        format=FORMAT,
        network=NETWORK,
        model=hf_model_settings(
            d_model,
            int(config["n_head"]),
            n_layers,
            int(config.get("n_inner") or 4 * d_model),
            activation=activation_from_hf(config.get("activation_function", "gelu_new"), source),
            norm_first=True,
            norm_eps=float(config.get("layer_norm_epsilon", 1e-5)),
            embedding_norm=False,
        ),
        pos_encoding="learned",
        properties={TIED_HEAD: tied, SCALED_EMBEDDING: False, MAX_SEQ_LEN: int(config["n_positions"])},
        state_dict=out,
        tokenizer=tokenizer,
        vocab_size=int(config["vocab_size"]),
    )


def from_trident(net: CausalLM) -> tuple[str, dict[str, Any], dict[str, Tensor]]:
    """The architecture name, ``GPT2Config`` arguments and ``GPT2LMHeadModel`` state dict of ``net``."""
    cfg = net.cfg
    tied = net.head.weight is net.embed.weight
    require_hf_block(cfg, TARGET, norm_first=True, embedding_norm=False)
    require_property(net.embed.scale == 1.0, NETWORK, SCALED_EMBEDDING, True, TARGET, "GPT-2 does not scale its embeddings")
    config = {
        "vocab_size": net.vocab_size,
        "n_positions": cfg.max_seq_len,
        "n_embd": cfg.d_model,
        "n_layer": cfg.n_layers,
        "n_head": cfg.n_heads,
        "n_inner": cfg.d_ff,
        "activation_function": activation_to_hf(cfg.activation, TARGET),
        "layer_norm_epsilon": cfg.norm_eps,
        "tie_word_embeddings": tied,
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.attn_dropout,
    }
    own = net.state_dict()
    state = {f"transformer.{name}": own[target] for name, target in _TOP.items()}
    state |= {f"transformer.{name}": tensor for name, tensor in _blocks(own, cfg.n_layers, to_trident=False).items()}
    state["lm_head.weight"] = own["head.weight"]
    return "GPT2LMHeadModel", config, state


def writes(net: CausalLM) -> bool:
    """GPT-2 takes every decoder but a rope one (its refusals name what else it lacks); rope is Llama's."""
    return net.cfg.pos_encoding != "rope"
