"""What an outside family's files hold, in the words of networks and formats (:class:`OutsideNetwork`: the trident
network class they fill, its backbone settings, its properties), and what that is as an ``init_from`` source: the
task that holds such a network says (``TridentTask.OUTSIDE_NETWORK``, ``FROM_NETWORK``), so no adapter names a task,
a task's setting or its data's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer
from torch import Tensor, nn

from trident.models.properties import CLASSES
from trident.weights.adapters.common import require_equivalent
from trident.weights.pretrained import PretrainedWeights

if TYPE_CHECKING:  # the tasks load only where a source is read or refused
    from trident.tasks.base import TridentTask


@dataclass(frozen=True)
class OutsideNetwork:
    """An outside family's weights and settings, read into trident's names (a :class:`PretrainedWeights` but for what
    the task that holds such a network says of them)."""

    source: str  # the path or name it was read from
    format: str  # "hf-gpt2" | "hf-bert" | "hf-vit" | "timm-vit"...
    network: type[nn.Module]  # the trident network the weights fill (CausalLM, MaskedLM, VisionTransformer)
    model: dict[str, Any]  # `model` group values (TransformerConfig field names)
    pos_encoding: str  # `pos_encoding` group choice (e.g. "learned")
    properties: dict[str, Any]  # what the files say of the network beside its backbone (trident.models.properties)
    state_dict: dict[str, Tensor]  # keys exactly as the network's `state_dict()` names them
    tokenizer: Tokenizer | None  # from tokenizer.json, or vocab files (text families)
    vocab_size: int | None = None  # rows of the token embedding (text families)
    pos_encoding_options: dict[str, Any] = field(default_factory=dict)
    # tokenizer_config.json's chat_template and special tokens (bos_token -> "<s>"), carried into the run and its export.
    tokenizer_settings: dict[str, str] = field(default_factory=dict)
    # What the weights table says beside a parameter group ("encoder.blocks"): a setting the file does not record.
    notes: dict[str, str] = field(default_factory=dict)


def holder(network: type[nn.Module]) -> type[TridentTask]:
    """The task class whose network is ``network`` (``TridentTask.OUTSIDE_NETWORK``): whose weights such files are."""
    from trident.tasks.registry import TASKS  # here: every task's imports load only for a source or a refusal

    return next(task for task in TASKS.values() if task.OUTSIDE_NETWORK is network)


def as_source(read: OutsideNetwork) -> PretrainedWeights:
    """``read`` as an ``init_from`` source: its properties as the settings of the task that holds its network."""
    task = holder(read.network)
    task_options, data_options = task.stated_by_network(read.properties)
    return PretrainedWeights(
        source=read.source, format=read.format, task=task.NAME, model=read.model, pos_encoding=read.pos_encoding,
        task_options=task_options, data_options=data_options, state_dict=read.state_dict, tokenizer=read.tokenizer,
        classes=read.properties.get(CLASSES), vocab_size=read.vocab_size, pos_encoding_options=read.pos_encoding_options,
        tokenizer_settings=read.tokenizer_settings, notes=read.notes,
    )


def require_property(ok: bool, network: type[nn.Module], prop: str, value: Any, target: str, fix: str) -> None:
    """One error line, as :func:`require_equivalent`'s, when a property (trident.models.properties) of ``network`` has
    no counterpart in ``target`` (an export format), naming the setting that chose it in the task that holds it."""
    if not ok:
        require_equivalent(False, holder(network).FROM_NETWORK[prop], value, target, fix)
