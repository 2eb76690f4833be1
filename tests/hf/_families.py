"""The decoder families of ``transformers``' causal-LM auto mapping, and a tiny random config for each.

Which families: every ``model_type`` of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, less those the rule of
:func:`families` excludes (listed in :data:`EXCLUDED` with why). The config of a family is its config
class's defaults shrunk through its own field names (:func:`tiny_config`): sizes, layer counts, heads,
experts, vocabulary, dropout off; per-family overrides only where the generic rule does not fit
(:data:`OVERRIDES`, each with its reason).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_MASKED_LM_MAPPING_NAMES,
)

VOCAB = 96
LAYERS = 2
# Sub-configs of another modality or of an encoder: a composite model, whose text decoder is its own
# model type (gemma3 -> gemma3_text, qwen3_5 -> qwen3_5_text).
_COMPOSITE_PARTS = ("text", "vision", "audio", "speech", "vq", "encoder", "decoder")

# Tiny values by config field name; a field is only ever made smaller.
_SIZES = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "n_embd": 32,
    "d_model": 32,
    "num_attention_heads": 4,
    "n_head": 4,
    "n_heads": 4,
    "num_heads": 4,
    "head_dim": 8,
    "max_position_embeddings": 128,
    "n_positions": 128,
    "n_ctx": 128,
    "max_seq_len": 128,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_top_k": 2,
    "top_k": 2,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 8,
    "rotary_dim": 4,
    "sliding_window": 8,
    # Gemma-3n / Gemma-4 per-layer input embeddings
    "vocab_size_per_layer_input": VOCAB,
    # an output vocabulary of its own (Inkling-2: the LM head has unpadded_vocab_size rows)
    "unpadded_vocab_size": VOCAB,
    "hidden_size_per_layer_input": 8,
    # mixture of experts: groups of the group-limited routing, tokens per expert choice
    "moe_k": 2,
    "num_experts_per_token": 2,
    "n_group": 1,
    "topk_group": 1,
    # state-space and linear-attention layers
    "mamba_n_heads": 4,
    "mamba_d_head": 16,
    "mamba_num_heads": 4,
    "mamba_head_dim": 16,
    "mamba_d_state": 16,
    "n_groups": 1,
    "mamba_n_groups": 1,
    "mamba_d_ssm": 64,
    "state_size": 16,
    "ssm_state_size": 16,
    "time_step_rank": 8,
    "mamba_dt_rank": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_num_heads": 4,
    "linear_head_dim": 8,
    # sparse-attention indexers
    "index_n_heads": 8,  # the ReLU scores of few heads tie at zero: which tied key topk keeps is unspecified
    "index_head_dim": 8,
    "index_topk": 8,
}
_LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads")
_FFN_PARTS = ("intermediate_size", "ffn_dim", "ffn_hidden_size", "n_inner", "dff", "dim_ff")


def families() -> tuple[list[str], dict[str, str]]:
    """``(kept, excluded)``: the decoder-only text families, and the other model types with why.

    The rule: a model type of the causal-LM mapping is kept unless its config is encoder-decoder (the
    class is the decoder half of a seq2seq model), it also has a masked-LM head (a bidirectional encoder
    that can run as a decoder), its config is composite (sub-configs of another modality or of an
    encoder: the text decoder is its own model type), or it names the same config and model classes as
    a type kept before (an alias; the type whose name is the config's ``model_type`` is kept first).
    """
    kept: list[str] = []
    excluded: dict[str, str] = {}
    seen: dict[tuple[type, str], str] = {}
    canonical_first = sorted(
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, key=lambda t: (CONFIG_MAPPING[t].model_type != t, t)
    )
    for model_type in canonical_first:
        config_class = CONFIG_MAPPING[model_type]
        parts = [p for p in getattr(config_class, "sub_configs", {}) if any(c in p for c in _COMPOSITE_PARTS)]
        pair = (config_class, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
        if _default(model_type).get("is_encoder_decoder"):
            excluded[model_type] = (
                "encoder-decoder: the causal-LM class is the decoder half of a seq2seq model"
            )
        elif model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
            excluded[model_type] = (
                "a bidirectional encoder (it has a masked-LM head) that can run as a decoder"
            )
        elif parts:
            excluded[model_type] = f"composite ({', '.join(parts)}): not a text-only decoder"
        elif pair in seen:
            excluded[model_type] = f"an alias of {seen[pair]} (same config and model classes)"
        else:
            seen[pair] = model_type
            kept.append(model_type)
    return sorted(kept), dict(sorted(excluded.items()))


@functools.cache
def _default(model_type: str) -> dict[str, Any]:
    """The fields of the family's default config (empty if the defaults do not validate)."""
    try:
        return dict(vars(CONFIG_MAPPING[model_type]()))
    except Exception:  # noqa: BLE001 - a config class whose defaults are invalid alone
        return {}


def tiny_config(model_type: str, **extra: Any):
    """The family's config with every size shrunk (see the module docstring), dropout off, and ``extra``."""
    default = _default(model_type)
    fields: dict[str, Any] = {}
    for name, value in default.items():
        tiny = _tiny(name, value, default)
        if tiny is not None:
            fields[name] = tiny
    fields.update(_layers(model_type, default))
    fields.update(OVERRIDES.get(model_type, {}))
    fields.update(extra)
    return CONFIG_MAPPING[model_type](**fields)


def _tiny(name: str, value: Any, default: dict[str, Any]) -> Any:
    if value is None and name == "head_dim":
        return _SIZES[name]  # some families read it without deriving it
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, float) and any(part in name for part in ("dropout", "pdrop", "jitter")):
        return 0.0 if value else None  # a deterministic step: no dropout, no router jitter noise
    if name.endswith(("_token_id", "_token_index")):
        return _token_ids(value)
    if not isinstance(value, int):
        return None
    if name in _KV_HEADS:
        heads = next((default[h] for h in ("num_attention_heads", "n_head") if h in default), value)
        return 1 if value == 1 else 4 if value == heads else 2
    target = _SIZES.get(name)
    if target is None and any(part in name for part in _FFN_PARTS):
        target = 64
    return target if target is not None and value > target else None


def _token_ids(value: Any) -> Any:
    if isinstance(value, list):
        return [v % VOCAB for v in value]
    return value % VOCAB if isinstance(value, int) and value >= VOCAB else None


def _layers(model_type: str, default: dict[str, Any]) -> dict[str, Any]:
    """The layer count, and layer types that keep one layer of each kind the family mixes."""
    fields = {name: LAYERS for name in _LAYER_COUNTS if name in default}
    types_field = getattr(CONFIG_MAPPING[model_type], "attribute_map", {}).get("layer_types", "layer_types")
    types = default.get(types_field)
    if isinstance(types, list) and types:
        distinct = list(dict.fromkeys(types))
        count = max(LAYERS, len(distinct))
        fields[types_field] = (distinct * count)[:count]
        fields.update({name: count for name in _LAYER_COUNTS if name in default})
    return fields


# Per-family fields where the generic rule does not fit, with why.
OVERRIDES: dict[str, dict[str, Any]] = {
    # Its rotary embedding reads RoPE parameters per layer type, which the defaults do not give.
    "cohere_compass_text": {
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}
    },
    # Its attention reads attn_config.rope_theta and clamps with clip_qkv, which the defaults leave unset.
    "dbrx": {"attn_config": {"rope_theta": 1e4, "clip_qkv": 8.0}},
    # Mixture-of-experts fields whose defaults are None (the model needs them set).
    "deepseek_v2": {"num_experts_per_tok": 2},
    "dots1": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1},
    # Two layers cannot share key/value caches across layer types; its shared layers are a cache option.
    "gemma3n_text": {"num_kv_shared_layers": 0},
    # Its layer pattern is [[types], repeats]: one global and one local layer.
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    # Their default configs have no convolution layer (lfm2: all attention; lfm2_moe: no layer types, which
    # the model reads), while every released LFM2 mixes both: one attention and one convolution layer.
    "lfm2": {"layer_types": ["full_attention", "conv"]},
    "lfm2_moe": {"layer_types": ["full_attention", "conv"]},
    # hidden_size * expand must equal num_heads * head_dim.
    "mamba2": {"num_heads": 8},
    # Its default num_key_value_heads is None, which the attention divides by.
    "nemotron": {"num_key_value_heads": 2},
    # Its attention builds an indexer whose fields default to None.
    "qwen4_exp_text": {
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 8,
        "indexer_budget": 8,
        "indexer_compress_ratio": 4,
    },
    # The shared transformer block is tied across the hybrid layers: it needs two of them.
    "zamba": {"layers_block_type": ["mamba", "hybrid", "hybrid"], "num_hidden_layers": 3},
}
