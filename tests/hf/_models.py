"""Tiny random-init Hugging Face configs with grouped-query attention (4 query heads, 2 key/value heads), and
models whose attention layers pass every variant of CP attention."""

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


# The attention variants a layer hands the attention function, each in a model that passes it, with values
# that change the result by far more than 1% at this size (tiny configs of tests/hf/_families.py).
VARIANTS = {
    # sliding_window: a 4-token window above layer 0 (layer 0 full attention)
    "qwen3-window": ("qwen3", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}),
    # softcap and a scaling of its own (query_pre_attn_scalar), windows on alternate layers
    "gemma2-softcap": (
        "gemma2",
        {
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 3.0,
            "query_pre_attn_scalar": 2,
            "sliding_window": 4,
        },
    ),
    # s_aux (attention sinks) with a window on alternate layers
    "gpt_oss-sinks": ("gpt_oss", {"sliding_window": 4}),
    # multi-head latent attention: a value head dim (8) of its own next to the query / key one (16)
    "deepseek_v3-mla": ("deepseek_v3", {}),
    # scaling = attention_multiplier instead of head_dim ** -0.5
    "granite-scaling": ("granite", {"attention_multiplier": 0.9}),
}


def build_variant(name, attn_implementation):
    """The model of ``VARIANTS[name]`` (fp32, weights from the current torch seed); ``None`` is the family's
    default attention (SDPA, or eager where SDPA cannot compute the variant)."""
    from tests.hf._families import tiny_config

    model_type, fields = VARIANTS[name]
    return transformers.AutoModelForCausalLM.from_config(
        tiny_config(model_type, **fields), attn_implementation=attn_implementation
    )


def assert_grads_close(got, want, rtol=2e-5):
    """Every gradient of ``want`` (name -> tensor) matched by ``got``'s within ``rtol`` of its norm: round-off
    of sums over many tokens (~1e-6 in fp32) passes, a 1% error in any parameter's gradient fails."""
    for key, expected in want.items():
        error = (got[key] - expected).norm()
        assert error <= rtol * expected.norm() + 1e-12, (
            f"{key}: error {error:.3e}, norm {expected.norm():.3e}"
        )
