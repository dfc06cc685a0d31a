"""What BERT, ALBERT, RoBERTa and ELECTRA share, both ways: a post-norm encoder whose embeddings (token + position + token type)
pass a LayerNorm, and an MLM head (dense -> activation -> LayerNorm -> decoder tied to the embedding, its own bias:
trident's ``transform`` and ``head``).

trident has no token types: type 0's vector is folded into the position table when reading, and zero type vectors
are written back. Each family's module (``hf_bert``, ``hf_albert``, ``hf_roberta``, ``hf_electra``) keeps its names (:class:`MlmHead`,
its embedding table) and its own backbone (``backbone_from_hf`` / ``backbone_to_hf`` / ``config_from_trident``, which
its sequence classifier shares), declared once as an :class:`EncoderFamily` (its ``ADAPTER``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar

import torch
from tokenizers import Tokenizer
from torch import Tensor, nn

from trident.data.special_tokens import CLS_TOKEN, MASK_TOKEN, PAD_TOKEN, SEP_TOKEN, UNK_TOKEN
from trident.models import MaskedLM
from trident.models.properties import MAX_SEQ_LEN, SCALED_EMBEDDING
from trident.weights.adapters.base import ModelTypeNames
from trident.weights.adapters.common import (
    encoder_settings,
    layer_from_hf,
    layer_to_hf,
    require_equivalent,
    require_hf_block,
    require_source,
    strip_prefix,
)
from trident.weights.adapters.hf_classifier import ClassifierAdapter
from trident.weights.adapters.outside_network import OutsideNetwork, require_property

# Tokenizer attribute -> token, where the run's vocabulary has it: trident's MLM tokens (a run read from one of these
# families names its own in tokenizer_settings, which take precedence).
SPECIAL_TOKENS = {"unk_token": UNK_TOKEN, "pad_token": PAD_TOKEN, "cls_token": CLS_TOKEN, "sep_token": SEP_TOKEN,
                  "mask_token": MASK_TOKEN}
# The embedding tensors every family has one-to-one (ALBERT adds its projection).
EMBEDDINGS = {
    "embeddings.word_embeddings.weight": "embed.weight",
    "embeddings.LayerNorm.weight": "encoder.embedding_norm.weight",
    "embeddings.LayerNorm.bias": "encoder.embedding_norm.bias",
}
POSITIONS, TYPES = "embeddings.position_embeddings.weight", "embeddings.token_type_embeddings.weight"
POSITIONS_KEY = "encoder.pos_encoding.embedding.weight"  # trident's learned position table (T, D)
# Inside ``encoder.layer.<i>.`` (BERT, RoBERTa) -> inside ``encoder.blocks.<i>.``; q/k/v under ``attention.self``.
LAYER = {
    "attention.output.dense.weight": "self_attn.out_proj.weight",
    "attention.output.dense.bias": "self_attn.out_proj.bias",
    "attention.output.LayerNorm.weight": "self_attn_norm.weight",
    "attention.output.LayerNorm.bias": "self_attn_norm.bias",
    "intermediate.dense.weight": "ffn.fc_in.weight",
    "intermediate.dense.bias": "ffn.fc_in.bias",
    "output.dense.weight": "ffn.fc_out.weight",
    "output.dense.bias": "ffn.fc_out.bias",
    "output.LayerNorm.weight": "ffn_norm.weight",
    "output.LayerNorm.bias": "ffn_norm.bias",
}


@dataclass(frozen=True)
class MlmHead:
    """A family's names of the MLM head's modules (without ``.weight`` / ``.bias``)."""

    dense: str  # "cls.predictions.transform.dense"
    norm: str  # "cls.predictions.transform.LayerNorm"
    bias: str  # the decoder's own bias, beside it: "cls.predictions.bias"
    decoder: str  # "cls.predictions.decoder"

    @property
    def names(self) -> dict[str, str]:
        """Hugging Face name -> trident name of the head's own tensors (the decoder is the embedding)."""
        return {f"{self.dense}.weight": "transform.0.weight", f"{self.dense}.bias": "transform.0.bias",
                f"{self.norm}.weight": "transform.2.weight", f"{self.norm}.bias": "transform.2.bias",
                self.bias: "head.bias"}

    def from_hf(self, state: dict[str, Tensor], embedding: Tensor, source: str) -> dict[str, Tensor]:
        """The head's tensors of ``state`` in trident's names (none for a headless model); an untied decoder is one
        line."""
        if self.bias not in state:
            return {}
        decoder = state.get(f"{self.decoder}.weight", embedding)
        require_source(torch.equal(decoder, embedding), source, "an MLM decoder not tied to the embedding")
        return {target: state[name] for name, target in self.names.items()} | {"head.weight": embedding}

    def to_hf(self, own: dict[str, Tensor]) -> dict[str, Tensor]:
        """The head's tensors of ``own`` (a trident state dict) in the family's names, the decoder written out."""
        state = {name: own[target] for name, target in self.names.items()}
        return state | {f"{self.decoder}.weight": own["head.weight"], f"{self.decoder}.bias": own["head.bias"]}


BackboneFromHf = Callable[[dict[str, Any], dict[str, Tensor], str], tuple[dict[str, Any], dict[str, Tensor], int]]
BackboneToHf = Callable[[dict[str, Tensor], Any, str], dict[str, Tensor]]
ConfigFromTrident = Callable[[Any, int, str], dict[str, Any]]
WithRun = Callable[[dict[str, Any], dict[str, Tensor]], tuple[dict[str, Any], dict[str, Tensor]]]


@dataclass(frozen=True)
class Classifier:
    """A family's ``For SequenceClassification``: its class and the Hugging Face names of its dense layer and class
    projection (without ``.weight``)."""

    architecture: str
    dense: str
    out: str
    activation: str = "tanh"  # between them (ELECTRA's: gelu)


@dataclass(frozen=True)
class EncoderFamily(ModelTypeNames):
    """One of the BERT-like families (the Adapter interface of base.py, registered as it is in registry.ADAPTERS): its
    names, its MLM head and its module's backbone, which its sequence classifier (:attr:`CLASSIFIER`) shares."""

    model_type: str  # config.json's "model_type", model.family and the backbone's prefix in the headed models: "bert"
    name: str  # how refusals name it: "BERT"
    architectures: tuple[str, ...]  # the transformers classes it reads, the masked LM (which export writes) first
    head: MlmHead
    backbone_from_hf: BackboneFromHf
    backbone_to_hf: BackboneToHf
    config_from_trident: ConfigFromTrident
    writes: Callable[[MaskedLM], bool]  # whether it writes a MaskedLM that declares no family
    classifier: Classifier | None = None
    with_run: WithRun | None = None  # what follows from the run's entries in the weights (RoBERTa's positions)

    NETWORK: ClassVar[type[MaskedLM]] = MaskedLM
    SPECIAL_TOKENS: ClassVar[dict[str, str]] = SPECIAL_TOKENS

    @property
    def ARCHITECTURES(self) -> tuple[str, ...]:
        return self.architectures

    @property
    def TARGET(self) -> str:
        return f"{self.name} (hf export)"

    @cached_property
    def CLASSIFIER(self) -> ClassifierAdapter:
        """The family's sequence classifier both ways (the registry's for a ``SequenceClassifier`` of the family)."""
        if self.classifier is None:
            raise AttributeError(f"{self.name} has no sequence classifier here")
        return ClassifierAdapter(self, self.classifier.architecture, self.classifier.dense, self.classifier.out,
                                 self.classifier.activation)

    @property
    def VARIANTS(self) -> tuple[Any, ...]:
        """The family's adapters of its other networks (its sequence classifier), which the registry finds on it for
        a network of their kind."""
        return (self.CLASSIFIER,) if self.classifier is not None else ()

    def to_trident(self, config: dict[str, Any], state: dict[str, Tensor], tokenizer: Tokenizer | None,
                   source: str) -> OutsideNetwork:
        """The family's masked LM, bare model or (with its class projection) sequence classifier as trident's."""
        if self.classifier is not None and f"{self.classifier.out}.weight" in state:
            return self.CLASSIFIER.to_trident(config, state, tokenizer, source)
        model, out, context = self.backbone_from_hf(config, strip_prefix(state, f"{self.model_type}."), source)
        out |= self.head.from_hf(state, out["embed.weight"], source)
        return self.network(config, model, out, context, tokenizer, source)

    def network(self, config: dict[str, Any], model: dict[str, Any], state: dict[str, Tensor], context: int,
                tokenizer: Tokenizer | None, source: str, network: type[nn.Module] = MaskedLM,
                properties: dict[str, Any] | None = None) -> OutsideNetwork:
        """The family's ``network`` of backbone settings ``model`` and ``state`` (trident's names), ``context`` positions
        long, ``properties`` beside the family's own."""
        return OutsideNetwork(
            source=source,
            format=self.FORMAT,
            network=network,
            model=model,
            pos_encoding="learned",
            properties={SCALED_EMBEDDING: False, MAX_SEQ_LEN: context} | (properties or {}),
            state_dict=state,
            tokenizer=tokenizer,
            vocab_size=int(config["vocab_size"]),
        )

    def from_trident(self, net: MaskedLM) -> tuple[str, dict[str, Any], dict[str, Tensor]]:
        """The architecture name, config arguments and masked-LM state dict of ``net``."""
        config = self.config_from_trident(net.cfg, net.vocab_size, self.TARGET) | {"tie_word_embeddings": True}
        require_property(net.embed.scale == 1.0, MaskedLM, SCALED_EMBEDDING, True, self.TARGET,
                         f"{self.name} does not scale its embeddings")
        own = net.state_dict()
        state = self.backbone_to_hf(own, net.cfg, f"{self.model_type}.") | self.head.to_hf(own)
        return self.architectures[0], config, state


def embeddings_from_hf(backbone: dict[str, Tensor], table: dict[str, str], first: int = 0) -> dict[str, Tensor]:
    """The embedding tensors of ``backbone`` in trident's names, type 0 folded into the positions from row ``first``
    on (RoBERTa's past its padding id)."""
    out = {target: backbone[name] for name, target in table.items()}
    out[POSITIONS_KEY] = backbone[POSITIONS][first:] + backbone[TYPES][0]  # (T, E) + (E,)
    return out


def embeddings_to_hf(own: dict[str, Tensor], table: dict[str, str], prefix: str, positions: Tensor,
                     types: int) -> dict[str, Tensor]:
    """The embedding tensors of ``own`` under ``prefix``: ``positions`` as the family's table, ``types`` zero type
    vectors."""
    state = {f"{prefix}{name}": own[target] for name, target in table.items()}
    state[f"{prefix}{POSITIONS}"] = positions
    state[f"{prefix}{TYPES}"] = torch.zeros(types, positions.size(1))  # (types, E)
    return state


def require_absolute(config: dict[str, Any], source: str) -> None:
    require_source(config.get("position_embedding_type", "absolute") == "absolute", source,
                   f"position_embedding_type={config.get('position_embedding_type')}")


def bert_backbone_from_hf(config: dict[str, Any], backbone: dict[str, Tensor], source: str, *, name: str,
                          first: int = 0) -> tuple[dict[str, Any], dict[str, Tensor], int]:
    """The ``model`` settings, embedding and encoder tensors (trident's names) of a BERT-layout model (BERT, RoBERTa:
    ``name``), its positions read from row ``first`` on, and its context (the position rows from ``first``)."""
    require_absolute(config, source)
    require_source(not config.get("is_decoder", False), source, f"a causal {name} (is_decoder=true)")
    # The MLM head is GELU whatever the blocks use, so only GELU blocks are this model.
    require_source(config.get("hidden_act", "gelu") == "gelu", source, f"activation {config.get('hidden_act')!r}")
    out = embeddings_from_hf(backbone, EMBEDDINGS, first)
    for i in range(int(config["num_hidden_layers"])):
        out |= layer_from_hf(backbone, f"encoder.layer.{i}", f"encoder.blocks.{i}", LAYER, "attention.self")
    model = encoder_settings(config, activation="gelu", norm_first=False, embedding_norm=True)
    return model, out, int(config["max_position_embeddings"]) - first


def bert_backbone_to_hf(own: dict[str, Tensor], cfg: Any, prefix: str, positions: Tensor,
                        types: int) -> dict[str, Tensor]:
    """The inverse of :func:`bert_backbone_from_hf` under ``prefix``, ``positions`` as the family's table."""
    state = embeddings_to_hf(own, EMBEDDINGS, prefix, positions, types)
    for i in range(cfg.n_layers):
        state |= layer_to_hf(own, f"encoder.blocks.{i}", f"{prefix}encoder.layer.{i}", LAYER, "attention.self")
    return state


def encoder_config(cfg: Any, vocab_size: int, *, activation: str, positions: int, types: int) -> dict[str, Any]:
    """The config arguments the three families' config classes name alike."""
    return {
        "vocab_size": vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "intermediate_size": cfg.d_ff,
        "hidden_act": activation,
        "hidden_dropout_prob": cfg.dropout,
        "attention_probs_dropout_prob": cfg.attn_dropout,
        "max_position_embeddings": positions,
        "type_vocab_size": types,
        "layer_norm_eps": cfg.norm_eps,
    }


def bert_config(cfg: Any, vocab_size: int, target: str, *, name: str, positions: int, types: int) -> dict[str, Any]:
    """The config arguments of a BERT-layout stack (BERT, RoBERTa: ``name``), its refusals named for ``target``."""
    require_hf_block(cfg, target, norm_first=False, embedding_norm=True)
    require_equivalent(cfg.activation == "gelu", "model.activation", cfg.activation, target,
                       f"{name}'s blocks and MLM head share one activation, and trident's head is GELU")
    return encoder_config(cfg, vocab_size, activation="gelu", positions=positions, types=types)
