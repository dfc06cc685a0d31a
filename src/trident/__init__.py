"""trident: one Transformer backbone, three tasks, one configurable training pipeline."""

__version__ = "0.1.0"
