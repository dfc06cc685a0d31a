"""Mistral (``MistralForCausalLM`` / ``MistralModel``) <-> trident's ``CausalLM`` (task=lm): the layout of
``llama_style.py``; no biases; sliding_window on every layer (model.attention_window; one as long as the context is none)."""

from trident.weights.adapters.llama_style import Family

ADAPTER = Family(model_type="mistral", architecture="MistralForCausalLM", target="Mistral (hf export)",
                 qk_norm=False, attention_bias="none", mlp_bias=False, window="all",
                 defaults={"num_key_value_heads": 8, "max_position_embeddings": 4096 * 32, "sliding_window": 4096})
