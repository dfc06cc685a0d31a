"""Llama (``LlamaForCausalLM`` / ``LlamaModel``) <-> trident's ``CausalLM`` (task=lm): the layout of
``llama_style.py``; attention_bias (biases on q, k, v and o) and mlp_bias read and written; no sliding window, no QK-norm."""

from trident.weights.adapters.llama_style import Family

ADAPTER = Family(model_type="llama", architecture="LlamaForCausalLM", target="Llama (hf export)",
                 qk_norm=False, attention_bias="config", mlp_bias=True, window="none",
                 defaults={"max_position_embeddings": 2048})
