"""Data modules, one per kind of data (``data`` config group), and the pieces they share: corpora,
tokenizers, resumable sample order, token-budget batches, masking, prepared-data caches."""

from __future__ import annotations

import importlib
from typing import Any

# Public name -> its module, imported on first use: the image and translation modules bring timm,
# torchvision and `datasets` (seconds of start-up), which a language-model run never needs.
_MODULES = {
    "EpochShuffleSampler": "order",
    "ImageDataModule": "images",
    "LMDataModule": "lm",
    "MLMDataModule": "mlm",
    "Masking": "masking",
    "ResumableOrder": "order",
    "TokenBudgetBatchSampler": "batching",
    "TranslationBatch": "batching",
    "TranslationDataModule": "translation",
    "TridentDataModule": "base",
    "mask_tokens": "masking",
    "train_tokenizer": "tokenization",
}

__all__ = list(_MODULES)


def __getattr__(name: str) -> Any:
    if name not in _MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULES[name]}"), name)
