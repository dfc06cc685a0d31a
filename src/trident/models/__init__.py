"""Complete networks built on the backbone: token embedding (or patches) + stack(s) + head."""

from trident.models.causal_lm import CausalLM
from trident.models.decoding import Decoding, Hypothesis, beam_search, greedy_decode
from trident.models.masked_lm import MaskedLM
from trident.models.replaced_token_detector import ReplacedTokenDetector
from trident.models.sampling import generate, sample_next_token
from trident.models.seq2seq import EncoderDecoder
from trident.models.sequence_classifier import POOLS, SequenceClassifier
from trident.models.vit import VisionTransformer, attention_rollout, vit_geometry

__all__ = [
    "POOLS",
    "CausalLM",
    "Decoding",
    "EncoderDecoder",
    "Hypothesis",
    "MaskedLM",
    "ReplacedTokenDetector",
    "SequenceClassifier",
    "VisionTransformer",
    "attention_rollout",
    "beam_search",
    "generate",
    "greedy_decode",
    "sample_next_token",
    "vit_geometry",
]
