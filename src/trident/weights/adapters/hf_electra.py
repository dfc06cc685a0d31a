"""ELECTRA (Clark et al. 2020) <-> trident: ``ElectraForMaskedLM`` (a generator checkpoint) / ``ElectraModel`` as a
``MaskedLM``, ``ElectraForPreTraining`` (the discriminator) as a ``ReplacedTokenDetector``, and
``ElectraForSequenceClassification`` as a ``SequenceClassifier``.

ELECTRA is BERT's encoder (the same layer names, post-norm, the embedding LayerNorm, GELU) with one of ALBERT's
switches: an embedding of width E (``embedding_size``) other than the width is normalised at E and projected
(``embeddings_project``, present only where E differs): ``model.embedding_dim`` and the stack's
``embedding_projection``. Its heads:
- the generator's MLM head (``generator_predictions``: dense to E -> GELU -> LayerNorm, then ``generator_lm_head``
  tied to the embedding, its own bias): trident's ``transform`` and ``head``;
- the discriminator's (``discriminator_predictions``: dense -> the blocks' activation -> ``dense_prediction``, one
  logit per token): the detector's ``detector``;
- the classifier's (``classifier``: dense -> GELU -> ``out_proj`` on the first token, not BERT's tanh pooler):
  the head of ``task.pooler=gelu``.
As for BERT, trident has no token types: type 0's vector is folded into the position table when reading, and zero
type vectors are written back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from tokenizers import Tokenizer
from torch import Tensor

from trident.models import MaskedLM, ReplacedTokenDetector
from trident.models.properties import SCALED_EMBEDDING
from trident.weights.adapters import bert_like
from trident.weights.adapters.bert_like import POSITIONS_KEY, Classifier, EncoderFamily, MlmHead
from trident.weights.adapters.common import require_equivalent, require_hf_block, require_source, strip_prefix
from trident.weights.adapters.outside_network import OutsideNetwork, require_property

NAME = "ELECTRA"
TOKEN_TYPES = 2  # ELECTRA's sentence A / sentence B
EMBEDDING_SIZE = 128  # ElectraConfig's embedding_size where config.json has none (not hidden_size: transformers reads 128)
HEAD = MlmHead("generator_predictions.dense", "generator_predictions.LayerNorm", "generator_lm_head.bias",
               "generator_lm_head")
PROJECTION = {"embeddings_project.weight": "encoder.embedding_projection.weight",
              "embeddings_project.bias": "encoder.embedding_projection.bias"}
# ElectraForPreTraining's discriminator head -> the detector's (dense, activation, one logit).
DETECTOR = {f"discriminator_predictions.{name}.{kind}": f"detector.{index}.{kind}"
            for name, index in (("dense", 0), ("dense_prediction", 2)) for kind in ("weight", "bias")}


def backbone_from_hf(config: dict[str, Any], backbone: dict[str, Tensor], source: str) -> tuple[dict[str, Any], dict[str, Tensor], int]:
    """The ``model`` settings, the embedding and encoder tensors (trident's names) of an ``ElectraModel`` state, and
    its context."""
    model, out, context = bert_like.bert_backbone_from_hf(config, backbone, source, name=NAME)
    width, hidden = int(config.get("embedding_size", EMBEDDING_SIZE)), int(config["hidden_size"])
    projected = "embeddings_project.weight" in backbone
    require_source(projected == (width != hidden), source,
                   f"embedding_size={width} and hidden_size={hidden} {'with' if projected else 'without'} an embeddings_project")
    if projected:
        out |= {target: backbone[name] for name, target in PROJECTION.items()}
    return model | {"embedding_dim": width if projected else None}, out, context


def config_from_trident(cfg: Any, vocab_size: int, target: str) -> dict[str, Any]:
    """The ``ElectraConfig`` arguments of a stack (ELECTRA's refusals named for ``target``)."""
    require_hf_block(cfg, target, norm_first=False, embedding_norm=True, shared=True)
    require_equivalent(cfg.share_layers in (False, None), "model.share_layers", cfg.share_layers, target,
                       "each of its layers has weights of its own (train with model.share_layers=false)")
    require_equivalent(cfg.embedding_dim != cfg.d_model, "model.embedding_dim", cfg.embedding_dim, target,
                       "it projects only an embedding narrower or wider than the width (model.embedding_dim=null)")
    require_equivalent(cfg.activation == "gelu", "model.activation", cfg.activation, target,
                       "its generator head is GELU whatever its blocks use (train with model.activation=gelu)")
    config = bert_like.encoder_config(cfg, vocab_size, activation="gelu", positions=cfg.max_seq_len, types=TOKEN_TYPES)
    return config | {"embedding_size": cfg.embedding_width}


def backbone_to_hf(own: dict[str, Tensor], cfg: Any, prefix: str) -> dict[str, Tensor]:
    """The embedding and encoder tensors of ``own`` (a trident state dict) in ``ElectraModel``'s names under ``prefix``."""
    state = bert_like.bert_backbone_to_hf(own, cfg, prefix, own[POSITIONS_KEY], TOKEN_TYPES)
    if cfg.embedding_dim is not None:
        state |= {f"{prefix}{name}": own[target] for name, target in PROJECTION.items()}
    return state


def writes(net: MaskedLM) -> bool:
    """A MaskedLM that declares no family is BERT's or ALBERT's: ELECTRA's generator is written where declared only."""
    return False


@dataclass(frozen=True)
class Discriminator:
    """``ElectraForPreTraining`` both ways (an :class:`~trident.weights.adapters.base.Adapter`, the family's variant
    for a ``ReplacedTokenDetector``, which only ELECTRA writes)."""

    family: EncoderFamily
    NETWORK = ReplacedTokenDetector
    ARCHITECTURES = ("ElectraForPreTraining",)

    @property
    def FORMAT(self) -> str:
        return self.family.FORMAT

    @property
    def MODEL_TYPE(self) -> str:
        return self.family.MODEL_TYPE

    @property
    def FAMILY(self) -> str:
        return self.family.FAMILY

    @property
    def SPECIAL_TOKENS(self) -> Mapping[str, str]:
        return self.family.SPECIAL_TOKENS

    @property
    def TARGET(self) -> str:
        return f"{NAME} discriminator (hf export)"

    def to_trident(self, config: dict[str, Any], state: dict[str, Tensor], tokenizer: Tokenizer | None,
                   source: str) -> OutsideNetwork:
        model, out, context = backbone_from_hf(config, strip_prefix(state, "electra."), source)
        out |= {target: state[name] for name, target in DETECTOR.items()}
        return self.family.network(config, model, out, context, tokenizer, source, ReplacedTokenDetector)

    def from_trident(self, net: ReplacedTokenDetector) -> tuple[str, dict[str, Any], dict[str, Tensor]]:
        """The architecture name, config arguments and state dict of ``net``."""
        # ElectraConfig's default, written by save_pretrained whatever the head (the discriminator's ties nothing).
        config = config_from_trident(net.cfg, net.vocab_size, self.TARGET) | {"tie_word_embeddings": True}
        require_property(net.embed.scale == 1.0, ReplacedTokenDetector, SCALED_EMBEDDING, True, self.TARGET,
                         f"{NAME} does not scale its embeddings")
        own = net.state_dict()
        state = backbone_to_hf(own, net.cfg, "electra.") | {name: own[target] for name, target in DETECTOR.items()}
        return self.ARCHITECTURES[0], config, state

    def writes(self, net: ReplacedTokenDetector) -> bool:
        return True


@dataclass(frozen=True)
class ElectraFamily(EncoderFamily):
    """The encoder family with ELECTRA's discriminator beside its masked LM and sequence classifier."""

    @cached_property
    def DISCRIMINATOR(self) -> Discriminator:
        return Discriminator(self)

    @property
    def VARIANTS(self) -> tuple[Any, ...]:
        return (*super().VARIANTS, self.DISCRIMINATOR)

    def to_trident(self, config: dict[str, Any], state: dict[str, Tensor], tokenizer: Tokenizer | None,
                   source: str) -> OutsideNetwork:
        """The discriminator where the state holds its head, else the masked LM, bare model or classifier."""
        if next(iter(DETECTOR)) in state:
            return self.DISCRIMINATOR.to_trident(config, state, tokenizer, source)
        return super().to_trident(config, state, tokenizer, source)


ADAPTER = ElectraFamily(
    model_type="electra", name=NAME,
    architectures=("ElectraForMaskedLM", "ElectraModel", "ElectraForPreTraining", "ElectraForSequenceClassification"),
    head=HEAD, backbone_from_hf=backbone_from_hf, backbone_to_hf=backbone_to_hf,
    config_from_trident=config_from_trident, writes=writes,
    # Its sequence classifier: dense + GELU on the first token, then out_proj.
    classifier=Classifier("ElectraForSequenceClassification", "classifier.dense", "classifier.out_proj", "gelu"),
)
