"""The interfaces outside formats implement: their names and settings to trident's and back (in the
spirit of torchtitan's state-dict adapters).

- :class:`Adapter`: a Hugging Face family, recognised by ``config.json``'s ``model_type``. A module
  (``hf_gpt2.py``, ``hf_bert.py``, ``hf_vit.py``) whose constants and functions match it, or an object that
  does (``llama_style.Family``: ``hf_llama.ADAPTER``...), registered once, in ``registry.ADAPTERS``, for reading
  and for export.
- :class:`FileAdapter`: a format recognised by its files instead (timm's ViT: a bare state-dict file, or
  timm's directory, whose ``config.json`` has no ``model_type``), registered once, in ``registry.FILE_ADAPTERS``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from tokenizers import Tokenizer
from torch import Tensor, nn

from trident.weights.adapters.outside_network import OutsideNetwork


@runtime_checkable
class Adapter(Protocol):
    """One outside model family both ways (a module implements it with module-level names)."""

    FORMAT: str  # PretrainedWeights.format: "hf-gpt2"
    MODEL_TYPE: str  # config.json's "model_type" the adapter reads: "gpt2"
    FAMILY: str  # the model.family it reads as and writes (trident.backbone.config.FAMILIES): "gpt2"
    ARCHITECTURES: tuple[str, ...]  # the transformers classes it reads; the first is the one export writes
    NETWORK: type[nn.Module]  # the trident network it reads into and writes out (CausalLM)
    TARGET: str  # how export error lines name the format: "GPT-2 (hf export)"
    # Tokenizer attribute -> token (``bos_token`` -> ``<|endoftext|>``), where the run's vocabulary has it.
    SPECIAL_TOKENS: Mapping[str, str]

    def to_trident(
        self, config: dict[str, Any], state: dict[str, Tensor], tokenizer: Tokenizer | None, source: str
    ) -> OutsideNetwork:
        """``config.json``, the state dict and the tokenizer of ``source`` in trident's names, and what they say of
        the network (trident.models.properties)."""
        ...

    def from_trident(self, net: Any) -> tuple[str, dict[str, Any], dict[str, Tensor]]:
        """The architecture name, config arguments and state dict (the family's names) of ``net`` (a NETWORK)."""
        ...

    def writes(self, net: Any) -> bool:
        """Whether the hf export writes ``net`` (a NETWORK) whose stack declares no family (model.family null: trident's
        own, or a run from before families were declared) as this family: several families share CausalLM (GPT-2 takes
        learned positions, Llama and its cousins rope, ``llama_style.family_name``). A declared family is written as
        itself."""
        ...


class ModelTypeNames:
    """The names an object adapter (``llama_style.Family``, ``bert_like.EncoderFamily``) derives from its family's
    ``model_type`` (a field of the dataclass that subclasses this): ``config.json``'s ``model_type``, its ``model.family`` and
    its format (``hf-`` and the family)."""

    model_type: str  # "llama"

    @property
    def FORMAT(self) -> str:
        return f"hf-{self.FAMILY}"  # a subclass may name its family otherwise (Gemma 3's "gemma3_text" is "gemma3")

    @property
    def MODEL_TYPE(self) -> str:
        return self.model_type

    @property
    def FAMILY(self) -> str:
        return self.model_type


@runtime_checkable
class FileAdapter(Protocol):
    """One outside format that its files name, read into trident (a module implements it with module-level names)."""

    FORMAT: str  # PretrainedWeights.format: "timm-vit"
    NETWORK: type[nn.Module]  # the trident network it reads into (VisionTransformer)
    SUFFIXES: tuple[str, ...]  # the state-dict files it reads: ".pth", ".safetensors"...
    DESCRIPTION: str  # how error lines name what it reads: "a timm ViT state-dict file (...) or directory (...)"

    def recognises(self, path: Path) -> bool:
        """Whether ``path`` (an existing file or directory) is in this format."""
        ...

    def read(self, path: Path, source: str, n_heads: int | None) -> OutsideNetwork:
        """The weights at ``path`` (named ``source``) in trident's names, and what they say of the network; ``n_heads``: the head
        count the caller states (``model.n_heads=``), for a file that does not record it."""
        ...
