"""Hybrid families (Gated DeltaNet, Kimi Delta Attention, Mamba2, short convolutions) train exactly under CP.

References are ``transformers``' own models with the same weights and their default attention: the
whole padded batch through ``model(input_ids, labels=...)``, and each packed document alone (a document's
state must never flow into the next, which ``transformers``' torch paths do on a packed row). Weights are
drawn at 10x the default initializer range: at 0.02 a shard-local short convolution differs from the right
answer by about 2e-6, far below the tolerances; at 0.2 every mistake is visible.

- the family matrix: every adapted family, at dp 2 x cp 2 and dp 1 x cp 4, padded and packed rows, loss and
  every parameter's gradient against the reference (one training step of ``HFCausalLM``);
- each mixer alone: the adapted layer on the shards against the layer itself on each whole document,
  outputs and the gradients of its input and parameters (the sliced ones summed over the ranks);
- refusals: heads or channels that do not split over cp, named with their numbers.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_cp.hf.mixers import ADAPTERS, adapt_token_mixers
from lightning_cp.hf.mixers._adapter import depthwise_conv
from lightning_cp.parallel import groups, shard_batch, unshard
from tests.hf import _exactness

transformers = pytest.importorskip("transformers")

VOCAB, INIT = _exactness.VOCAB, _exactness.INIT
_COMMON = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "max_position_embeddings": 256}
_ATTENTION = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
_GDN = {
    "linear_num_key_heads": 2,  # fewer key heads than cp = 4: each is read by two ranks
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    "num_hidden_layers": 2,
    "layer_types": ["linear_attention", "full_attention"],
}
_MLA_LINEAR = {  # multi-head latent attention beside KDA layers (Kimi-Linear, Bailing's hybrid)
    **_COMMON,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 16,
    "q_lora_rank": None,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "linear_num_heads": 4,
    "linear_head_dim": 8,
    "num_hidden_layers": 2,
    "layer_types": ["linear_attention", "full_attention"],
    "mlp_layer_types": ["dense", "dense"],
    "pad_token_id": 0,
    "eos_token_id": 2,
}
_MAMBA = {"mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_expand": 2}
_MOE = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
}
HYBRIDS: dict[str, dict] = {
    "qwen3_5_text": {"model_type": "qwen3_5_text", **_COMMON, **_ATTENTION, **_GDN},
    "qwen3_5_moe_text": {"model_type": "qwen3_5_moe_text", **_COMMON, **_ATTENTION, **_GDN, **_MOE},
    "qwen3_next": {"model_type": "qwen3_next", **_COMMON, **_ATTENTION, **_GDN, **_MOE},
    "olmo_hybrid": {
        "model_type": "olmo_hybrid",
        **_COMMON,
        **_ATTENTION,
        **_GDN,
        "pad_token_id": 0,
        "eos_token_id": 1,
    },
    "kimi_linear": {"model_type": "kimi_linear", **_MLA_LINEAR, "bos_token_id": 1},
    "bailing_hybrid": {
        "model_type": "bailing_hybrid",
        **_MLA_LINEAR,
        "head_dim": 8,
        "num_nextn_predict_layers": 0,
    },
    "mamba2": {
        "model_type": "mamba2",
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "num_heads": 8,
        "head_dim": 16,
        "expand": 2,
        "n_groups": 2,
        "state_size": 8,
        "chunk_size": 8,  # several chunks per sequence
        "num_hidden_layers": 2,
        "time_step_rank": 8,
    },
    "nemotron_h": {
        "model_type": "nemotron_h",
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "layers_block_type": ["linear_attention", "mlp", "full_attention"],
        **_ATTENTION,
        "intermediate_size": 96,
        "mamba_num_heads": 8,
        "mamba_head_dim": 16,
        "n_groups": 4,  # a group per rank at cp = 4
        "ssm_state_size": 8,
        "chunk_size": 8,
        "conv_kernel": 4,
    },
    "granitemoehybrid": {
        "model_type": "granitemoehybrid",
        **_COMMON,
        **_ATTENTION,
        **_MAMBA,
        "mamba_n_groups": 1,  # Granite-4.0-H's one group: B and C replicated on every rank
        "mamba_chunk_size": 8,
        "num_hidden_layers": 2,
        "layer_types": ["linear_attention", "full_attention"],
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "shared_intermediate_size": 64,
    },
    "bamba": {
        "model_type": "bamba",
        **_COMMON,
        **_ATTENTION,
        **_MAMBA,
        "mamba_n_groups": 2,
        "mamba_chunk_size": 8,
        "num_hidden_layers": 2,
        "attn_layer_indices": [1],
    },
    "falcon_h1": {
        "model_type": "falcon_h1",
        **_COMMON,
        **_ATTENTION,
        **_MAMBA,
        "mamba_n_groups": 1,
        "mamba_chunk_size": 8,
        "mamba_d_ssm": 128,
        "mamba_rms_norm": True,
        "num_hidden_layers": 2,
        # muP multipliers as real Falcon-H1 configs have them (none is 1): the mixer's ssm_in_multiplier and
        # mup_vector (one multiplier per part of [z | x | B | C | dt]), the layer's and the head's
        "ssm_multipliers": [0.6, 1.4, 0.8, 1.25, 0.7],
        "ssm_in_multiplier": 0.9,
        "ssm_out_multiplier": 1.3,
        "attention_in_multiplier": 0.8,
        "attention_out_multiplier": 1.2,
        "key_multiplier": 0.7,
        "mlp_multipliers": [1.3, 0.8],
        "embedding_multiplier": 1.5,
        "lm_head_multiplier": 0.5,
    },
    "zamba2": {
        "model_type": "zamba2",
        **_COMMON,
        "num_hidden_layers": 2,
        "layers_block_type": ["linear_attention", "hybrid"],
        "n_mamba_heads": 8,
        "mamba_ngroups": 2,
        "mamba_d_state": 8,
        "chunk_size": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
    },
    "lfm2": {
        "model_type": "lfm2",
        **_COMMON,
        **_ATTENTION,
        "num_hidden_layers": 2,
        "layer_types": ["conv", "full_attention"],
        "block_auto_adjust_ff_dim": False,
    },
    "lfm2_moe": {
        "model_type": "lfm2_moe",
        **_COMMON,
        **_ATTENTION,
        "num_hidden_layers": 2,
        "layer_types": ["conv", "full_attention"],
        "num_dense_layers": 1,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
    },
}


def _config(name: str) -> dict:
    return {**HYBRIDS[name], "initializer_range": INIT}


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("cp", [2, 4], ids=["dp2-cp2", "dp1-cp4"])
def test_every_adapted_family_trains_as_the_unsharded_model(world4, cp, packed):
    results = world4.run(_exactness.train_step, {name: _config(name) for name in HYBRIDS}, cp, packed)[0]
    assert set(results) == set(HYBRIDS)
    failures = _exactness.failures(results)
    assert not failures, "\n".join(failures)


def test_every_adapter_is_in_the_matrix():
    """Each mixer class the adapters know is built by a family of the matrix (or named here as covered by a
    twin with the same forward)."""
    twins = {"Qwen4ExpTextGatedDeltaNet", "LaraMiniGatedDeltaNet", "Lfm3ShortConv"}
    built = set()
    for name in HYBRIDS:
        config = transformers.AutoConfig.for_model(**_config(name))
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        built |= {type(m).__name__ for m in model.modules()}
    assert set(ADAPTERS) - built == twins


# --- each mixer alone: the adapted layer on shards vs the layer on each whole document ---------------------

_MIXERS = {  # a family, and where its first mixer sits
    "qwen3_5_text": "model.layers.0.linear_attn",
    "qwen3_next": "model.layers.0.linear_attn",
    "olmo_hybrid": "model.layers.0.linear_attn",
    "kimi_linear": "model.layers.0.self_attn",
    "bailing_hybrid": "model.layers.0.self_attn",
    "mamba2": "backbone.layers.0.mixer",
    "granitemoehybrid": "model.layers.0.mamba",
    "falcon_h1": "model.layers.0.mamba",
    "lfm2": "model.layers.0.conv",
}
_MIXER_DOCS = (5, 1, 16, 9)  # 16: a multiple of 2 * cp, so no padding separates it from the next
HIDDEN = 64


def _mixer(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**_config(name))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    return model.get_submodule(_MIXERS[name])


def _mixer_alone(name: str, cp: int) -> tuple:
    """This rank's output and input gradient (of its shard), and the mixer's parameter gradients summed over
    the CP ranks."""
    layout = groups.initialize(tp=1, cp=cp)
    mixer = _mixer(name)
    adapt_token_mixers(mixer, cp)
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(1, sum(_MIXER_DOCS), HIDDEN, generator=g, dtype=torch.float64)
    weight = torch.randn(hidden.shape, generator=g, dtype=torch.float64)
    cu = torch.tensor([0, *_MIXER_DOCS]).cumsum(0)
    batch = shard_batch(
        {
            "input_ids": torch.zeros(1, hidden.shape[1], dtype=torch.long),
            "cu_seqlens": cu,
            "h": hidden,
            "w": weight,
        },
        cp,
        layout.cp_rank,
        cp_group=layout.cp_group,
    )
    x = batch["h"].clone().requires_grad_()
    out = mixer(x, cp_shard=batch["cp_shard"])
    (out * batch["w"]).sum().backward()
    grads = torch.cat([_exactness.grad(p).flatten() for p in mixer.parameters()])
    dist.all_reduce(grads, group=layout.cp_group)
    return out.detach(), x.grad, grads


@pytest.mark.parametrize("name", list(_MIXERS))
def test_each_mixer_on_its_shards_equals_the_mixer_on_each_whole_document(world4, name):
    mixer = _mixer(name)
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(1, sum(_MIXER_DOCS), HIDDEN, generator=g, dtype=torch.float64)
    weight = torch.randn(hidden.shape, generator=g, dtype=torch.float64)
    x = hidden.clone().requires_grad_()
    out = torch.cat([mixer(piece) for piece in x.split(_MIXER_DOCS, dim=1)], dim=1)  # transformers' own
    (out * weight).sum().backward()
    expected_grads = torch.cat([_exactness.grad(p).flatten() for p in mixer.parameters()])
    cu = torch.tensor([0, *_MIXER_DOCS]).cumsum(0)
    per_rank = world4.run(_mixer_alone, name, 4)
    got_out = unshard([r[0] for r in per_rank], cu_seqlens=cu)
    got_grad = unshard([r[1] for r in per_rank], cu_seqlens=cu)
    # The kernels compute in fp32 whatever the input (the chunked scans cast): fp32 round-off, in norm.
    for what, got, want in (
        ("output", got_out, out.detach()),
        ("input gradient", got_grad, x.grad),
        ("parameter gradients", per_rank[0][2], expected_grads),
    ):
        error = (got - want).norm() / want.norm()
        assert error < 1e-5, f"{name}: {what} off by {error:.2e} of its norm"


def _causal_conv1d_cuda(torch_path, layouts: list[str]):
    """A stand-in on the CPU for causal-conv1d's CUDA ``causal_conv1d_fn``: the layout checks of its
    ``csrc/causal_conv1d.cpp`` (a channel-last input needs a multiple of 8 channels and strides), then the
    torch path's result; ``layouts`` records which of its two kernels each call would run."""

    def kernel(x, weight, bias=None, activation=None):
        assert x.stride(2) == 1 or x.stride(1) == 1
        channel_last = x.stride(1) == 1 and x.stride(2) > 1
        if channel_last and (x.shape[1] % 8 or x.stride(2) % 8 or x.stride(0) % 8):
            raise RuntimeError("causal_conv1d only supports channel dimension divisible by 8 for now")
        layouts.append("channel-last" if channel_last else "channel-first")
        return torch_path(x, weight, bias, activation=activation)

    return kernel


@pytest.mark.parametrize(("channels", "layout"), [(16, "channel-last"), (12, "channel-first")])
def test_a_rank_s_channels_reach_causal_conv1d_in_a_layout_its_kernel_takes(monkeypatch, channels, layout):
    """A rank's share of a layer's channels need not be a multiple of 8 (12 here): the CUDA kernel then gets
    them channel-first, where it takes any count, and the convolution is the layer's own on those rows."""
    mixer = _mixer("lfm2")
    modeling = sys.modules[type(mixer).__module__]
    layouts: list[str] = []
    monkeypatch.setattr(modeling, "causal_conv1d_fn", _causal_conv1d_cuda(modeling.causal_conv1d_fn, layouts))
    rows = torch.arange(channels) * 5 % HIDDEN  # scattered rows of the layer's 64 channels
    x = torch.randn(2, 11, channels, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    (out,) = depthwise_conv(mixer, mixer.conv, rows, None, x)
    weight = mixer.conv.weight[rows]  # [C, 1, K]
    expected = F.conv1d(
        x.transpose(1, 2),
        weight,
        mixer.conv.bias[rows] if mixer.conv.bias is not None else None,
        padding=weight.shape[-1] - 1,
        groups=channels,
    )[:, :, : x.shape[1]].transpose(1, 2)
    assert layouts == [layout]
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("name", "fields", "cp", "match"),
    [
        ("qwen3_5_text", {"linear_num_value_heads": 6}, 4, r"value heads=6 is not divisible by cp=4"),
        (
            "qwen3_5_text",
            {"linear_num_key_heads": 3, "linear_num_value_heads": 6},
            2,
            r"key heads=3 for 6 heads",
        ),
        (
            "mamba2",
            {"n_groups": 3, "num_heads": 12, "head_dim": 32, "expand": 6},
            4,
            r"groups=3 for 12 heads",
        ),
        ("lfm2", {"hidden_size": 66}, 4, r"hidden_size=66 is not divisible by cp=4"),
    ],
)
def test_a_mixer_that_does_not_split_over_cp_is_refused_with_its_numbers(name, fields, cp, match):
    config = transformers.AutoConfig.for_model(**{**_config(name), **fields})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=rf"cannot be split over cp={cp} ranks: .*{match}"):
        adapt_token_mixers(model, cp)
