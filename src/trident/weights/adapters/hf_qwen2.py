"""Qwen2 (``Qwen2ForCausalLM`` / ``Qwen2Model``) <-> trident's ``CausalLM`` (task=lm): the layout of
``llama_style.py``; biases on q, k and v, none on o (model.qkv_bias=true, model.attn_out_bias=false); use_sliding_window in the
layers from max_window_layers on (or those layer_types names): model.attention_window where that is every layer, else
model.layers."""

from trident.weights.adapters.llama_style import Family

ADAPTER = Family(model_type="qwen2", architecture="Qwen2ForCausalLM", target="Qwen2 (hf export)",
                 qk_norm=False, attention_bias="qkv", mlp_bias=False, window="layers",
                 defaults={"num_key_value_heads": 32, "max_position_embeddings": 32768, "sliding_window": 4096,
                           "use_sliding_window": False, "max_window_layers": 28})
