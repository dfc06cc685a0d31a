"""Data modules, one per kind of data (``data`` config group), and the pieces they share: corpora,
tokenizers, resumable sample order, token-budget batches, masking, prepared-data caches."""

from trident.data.base import TridentDataModule
from trident.data.batching import TokenBudgetBatchSampler, TranslationBatch
from trident.data.images import ImageDataModule
from trident.data.lm import LMDataModule
from trident.data.masking import Masking, mask_tokens
from trident.data.mlm import MLMDataModule
from trident.data.order import EpochShuffleSampler, ResumableOrder
from trident.data.tokenization import train_tokenizer
from trident.data.translation import TranslationDataModule

__all__ = [
    "EpochShuffleSampler",
    "ImageDataModule",
    "LMDataModule",
    "MLMDataModule",
    "Masking",
    "ResumableOrder",
    "TokenBudgetBatchSampler",
    "TranslationBatch",
    "TranslationDataModule",
    "TridentDataModule",
    "mask_tokens",
    "train_tokenizer",
]
