"""Complete networks built on the backbone: token embedding + stack(s) + head."""

from trident.models.causal_lm import CausalLM
from trident.models.sampling import generate, sample_next_token

__all__ = ["CausalLM", "generate", "sample_next_token"]
