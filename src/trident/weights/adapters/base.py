"""The one interface every Hugging Face adapter implements: its family's names and settings to
trident's and back (in the spirit of torchtitan's state-dict adapters).

An adapter is a module (``hf_gpt2.py``, ``hf_llama.py``, ``hf_bert.py``...) whose constants and two functions
match :class:`Adapter`; it is registered once, in ``registry.ADAPTERS``, for reading and for export.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from tokenizers import Tokenizer
from torch import Tensor, nn

from trident.weights.pretrained import PretrainedWeights


@runtime_checkable
class Adapter(Protocol):
    """One outside model family both ways (a module implements it with module-level names)."""

    FORMAT: str  # PretrainedWeights.format: "hf-gpt2"
    MODEL_TYPE: str  # config.json's "model_type" the adapter reads: "gpt2"
    ARCHITECTURES: tuple[str, ...]  # the transformers classes it reads; the first is the one export writes
    NETWORK: type[nn.Module]  # the trident network it reads into and writes out (CausalLM)
    TARGET: str  # how export error lines name the format: "GPT-2 (hf export)"
    # Tokenizer attribute -> token (``bos_token`` -> ``<|endoftext|>``), where the run's vocabulary has it.
    SPECIAL_TOKENS: Mapping[str, str]

    def to_trident(
        self, config: dict[str, Any], state: dict[str, Tensor], tokenizer: Tokenizer | None, source: str
    ) -> PretrainedWeights:
        """``config.json``, the state dict and the tokenizer of ``source`` in trident's settings and names."""
        ...

    def from_trident(self, net: Any) -> tuple[str, dict[str, Any], dict[str, Tensor]]:
        """The architecture name, config arguments and state dict (the family's names) of ``net`` (a NETWORK)."""
        ...

    def writes(self, net: Any) -> bool:
        """Whether the hf export writes ``net`` (a NETWORK) as this family: several families share CausalLM
        (GPT-2 takes learned positions, Llama and its cousins rope, ``llama_style.family_name``)."""
        ...
