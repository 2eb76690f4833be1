"""Tiny random-init Hugging Face configs with grouped-query attention (4 query heads, 2 key/value heads)."""

import pytest

transformers = pytest.importorskip("transformers")

VOCAB = 61
_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 256,
}
CONFIGS = {
    "llama": {"model_type": "llama", **_COMMON},
    "qwen3": {"model_type": "qwen3", "tie_word_embeddings": True, **_COMMON},
}


def build(name, attn_implementation, **overrides):
    """The model of ``CONFIGS[name]`` (fp32), weights drawn from the current torch seed."""
    config = transformers.AutoConfig.for_model(**{**CONFIGS[name], **overrides})
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
