"""What every source of weights gives (a trident run or checkpoint, a Hugging Face or timm file, the copy
in a run's ``init/``): weights and settings in trident's terms."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenizers import Tokenizer
from torch import Tensor


@dataclass(frozen=True)
class PretrainedWeights:
    """Weights from a trident run or from outside trident, expressed in trident's terms."""

    source: str  # the path or name it was read from
    format: str  # "trident" | "hf-gpt2" | "hf-bert" | "hf-vit" | "timm-vit"
    task: str  # the trident task whose `net` these weights fit: "lm" | "mlm" | "vit" | "translation" | "classify"
    model: dict[str, Any]  # `model` group values the source fixes (TransformerConfig field names)
    pos_encoding: str  # `pos_encoding` group choice (e.g. "learned")
    task_options: dict[str, Any]  # `task` group values the source fixes (e.g. tie_embeddings, scale_embeddings)
    data_options: dict[str, Any]  # `data` group values the source fixes (e.g. max_seq_len, image_size, patch_size)
    state_dict: dict[str, Tensor]  # keys exactly as the trident task's `net.state_dict()` names them
    tokenizer: Tokenizer | None  # tokenizers.Tokenizer for text sources (from tokenizer.json, or vocab files)
    classes: int | None = None  # rows of the source's classification head, if it has one (outside sources)
    vocab_size: int | None = None  # rows of the source's token embedding (outside text sources)
    pos_encoding_options: dict[str, Any] = field(default_factory=dict)  # `pos_encoding.options` (trident sources)
    # tokenizer_config.json's chat_template and special tokens (bos_token -> "<s>"), carried into the run and its export.
    tokenizer_settings: dict[str, str] = field(default_factory=dict)
    # What the weights table says beside a parameter group ("encoder.blocks"): a setting the file does not record.
    notes: dict[str, str] = field(default_factory=dict)
