"""Complete networks built on the backbone: token embedding + stack(s) + head."""

from trident.models.causal_lm import CausalLM
from trident.models.decoding import Hypothesis, beam_search, greedy_decode
from trident.models.masked_lm import MaskedLM
from trident.models.sampling import generate, sample_next_token
from trident.models.seq2seq import EncoderDecoder

__all__ = ["CausalLM", "EncoderDecoder", "Hypothesis", "MaskedLM", "beam_search", "generate", "greedy_decode", "sample_next_token"]
