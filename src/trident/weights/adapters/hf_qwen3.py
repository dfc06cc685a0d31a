"""Qwen3 (``Qwen3ForCausalLM`` / ``Qwen3Model``) <-> trident's ``CausalLM`` (task=lm): the layout of
``llama_style.py``; q_norm / k_norm over each head before rope (model.qk_norm=true), head_dim independent of the width,
attention_bias on q, k, v and o; the sliding window as Qwen2."""

from trident.weights.adapters.llama_style import Family

ADAPTER = Family(model_type="qwen3", architecture="Qwen3ForCausalLM", target="Qwen3 (hf export)",
                 qk_norm=True, attention_bias="config", mlp_bias=False, window="layers",
                 defaults={"num_key_value_heads": 32, "head_dim": 128, "max_position_embeddings": 32768,
                           "sliding_window": 4096, "use_sliding_window": False, "max_window_layers": 28})
