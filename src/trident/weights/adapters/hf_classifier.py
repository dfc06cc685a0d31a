"""The sequence classifiers of the encoder families (``AlbertForSequenceClassification``,
``RobertaForSequenceClassification``, ``ElectraForSequenceClassification``) <-> trident's ``SequenceClassifier``
with a pooler.

Each reads the output at the first position (the text's own class token: ALBERT's ``[CLS]``, RoBERTa's ``<s>``),
passes it through a dense layer and tanh (ALBERT's ``pooler``, RoBERTa's ``classifier.dense``) or GELU (ELECTRA's
``classifier.dense``) and projects it to the classes: trident's ``head`` as ``Sequential(Linear, Tanh or GELU,
Linear)``. The backbone is the family's own (its :class:`~trident.weights.adapters.bert_like.EncoderFamily`'s
``backbone_from_hf`` / ``backbone_to_hf`` / ``config_from_trident``); the classifier adapter is the family's
``CLASSIFIER``, which the registry finds on it for a ``SequenceClassifier`` of that family.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenizers import Tokenizer
from torch import Tensor, nn

from trident.models import SequenceClassifier
from trident.models.properties import CLASSES, POOLER, READOUT, SCALED_EMBEDDING
from trident.models.sequence_classifier import POOLER_ACTIVATIONS
from trident.weights.adapters.common import require_equivalent, strip_prefix
from trident.weights.adapters.outside_network import OutsideNetwork, require_property

# trident's pooled head: the dense layer, then (after tanh) the class projection.
DENSE, OUT = "head.0", "head.2"


class ClassifierAdapter:
    """One family's ``For SequenceClassification`` both ways (an :class:`~trident.weights.adapters.base.Adapter`)."""

    NETWORK = SequenceClassifier

    def __init__(self, family: Any, architecture: str, dense: str, out: str, activation: str = "tanh") -> None:
        """``family``: the family's ``bert_like.EncoderFamily`` (its names and backbone; ``Any``: bert_like builds its
        classifier, so this module does not import it); ``dense`` / ``out``: the Hugging Face names of
        the dense layer and of the class projection (without ``.weight``); ``activation``: between them (tanh;
        ELECTRA's gelu), one of trident's pooler activations (``task.pooler``)."""
        self.family = family
        self.activation = activation
        self.pooler: bool | str = True if activation == "tanh" else activation  # task.pooler's value for it
        self.FORMAT, self.MODEL_TYPE, self.FAMILY = family.FORMAT, family.MODEL_TYPE, family.FAMILY
        self.ARCHITECTURES = (architecture,)
        self.TARGET = f"{family.name} sequence classifier (hf export)"
        self.SPECIAL_TOKENS: Mapping[str, str] = family.SPECIAL_TOKENS
        self.prefix = f"{family.MODEL_TYPE}."  # the backbone's, as the headed models name it
        self.head = {f"{part}.{kind}": f"{target}.{kind}" for part, target in ((dense, DENSE), (out, OUT))
                     for kind in ("weight", "bias")}
        # What follows from the run's entries in the weights, as for the family's other networks (RoBERTa's positions).
        self.with_run = family.with_run

    def to_trident(self, config: dict[str, Any], state: dict[str, Tensor], tokenizer: Tokenizer | None,
                   source: str) -> OutsideNetwork:
        model, out, context = self.family.backbone_from_hf(config, strip_prefix(state, self.prefix), source)
        out |= {target: state[name] for name, target in self.head.items()}
        properties = {POOLER: self.pooler, READOUT: "cls", CLASSES: int(out[f"{OUT}.weight"].shape[0])}
        return self.family.network(config, model, out, context, tokenizer, source, SequenceClassifier, properties)

    def from_trident(self, net: SequenceClassifier) -> tuple[str, dict[str, Any], dict[str, Tensor]]:
        """The architecture name, config arguments and state dict of ``net``."""
        require_equivalent(net.stack_kind == "encoder", "the classifier's stack", net.stack_kind, self.TARGET,
                           "it classifies with a bidirectional encoder")
        require_property(net.pool == "cls", SequenceClassifier, READOUT, net.pool, self.TARGET,
                         "it classifies from the first position's output")
        require_equivalent(not net.prepends_cls, "a learned class vector", "before the text", self.TARGET,
                           "it reads the text's own first token: use a tokenizer that starts every text with one "
                           f"({self.SPECIAL_TOKENS.get('cls_token')})")
        pooled_by = (next((name for name, kind in POOLER_ACTIVATIONS.items() if isinstance(net.head[1], kind)))
                     if isinstance(net.head, nn.Sequential) else None)
        require_property(pooled_by == self.activation, SequenceClassifier, POOLER,
                         {None: False, "tanh": True}.get(pooled_by, pooled_by), self.TARGET,
                         f"it reads the pooled vector through a dense layer and {self.activation}")
        require_property(net.embed.scale == 1.0, SequenceClassifier, SCALED_EMBEDDING, True, self.TARGET,
                         "it does not scale its embeddings")
        cfg = net.cfg
        classes = int(net.head[-1].out_features)
        config = self.family.config_from_trident(cfg, net.embed.num_embeddings, self.TARGET) | {"num_labels": classes}
        own = net.state_dict()
        state = self.family.backbone_to_hf(own, cfg, self.prefix)
        state |= {name: own[target] for name, target in self.head.items()}
        return self.ARCHITECTURES[0], config, state

    def writes(self, net: SequenceClassifier) -> bool:
        """A classifier is written as this family where it declares it only."""
        return False
