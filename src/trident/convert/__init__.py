"""Outside formats in and out: one adapter module per format, both directions.

``read_pretrained(path)`` reads a Hugging Face model directory (GPT-2, BERT, ViT) or a timm ViT
state-dict file into a :class:`PretrainedWeights`, in trident's names and settings; each adapter's
``to_hf`` writes a trident model back (the ``trident-export`` command).
"""

from trident.convert.reading import read_pretrained, supported
from trident.convert.weights import PretrainedWeights

__all__ = ["PretrainedWeights", "read_pretrained", "supported"]
