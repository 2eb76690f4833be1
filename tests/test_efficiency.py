"""``benchmarks/efficiency.py``'s counts held at tiny shapes: what one CP rank's layer dispatches, the dtype of
its matmuls under ``bf16-mixed``, the bytes it sends.

Each count runs a tiny Llama layer on fake tensors (no data) with its CP peers simulated, as the benchmark
runs the real models; the module is imported as the script imports its siblings (``benchmarks/`` first on
``sys.path``).
"""

from __future__ import annotations

import importlib
import types
from pathlib import Path

import pytest

from lightning_cp.parallel.attention_mode import AttentionMode
from lightning_cp.plan import Layout, ModelShape, estimate
from lightning_cp.plan.terms import ring
from tests.hf.test_sparse_attention import SPARSE

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
TINY = {
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "tie_word_embeddings": False,
}
KV_BYTES_PER_TOKEN = 2 * (2 * 16) * 2  # keys and values: 2 heads x 16 each, bf16


@pytest.fixture(scope="module")
def efficiency() -> types.ModuleType:
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(BENCHMARKS))
        yield importlib.import_module("efficiency")


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_layer_dispatches_as_many_operators_at_4x_the_tokens(efficiency, checkpointing):
    # No tiles: a loop per query, per key block or per token would dispatch more operators at 1024 tokens.
    ops = [
        efficiency.count_layer(TINY, 0, cp=2, tokens=tokens, checkpointing=checkpointing).ops
        for tokens in (256, 1024)
    ]
    assert ops[0] == ops[1]
    assert ops[0] > 50  # the layer ran: projections, attention, MLP, forward and backward


@pytest.mark.parametrize("tiled", [False, True], ids=["whole", "tiled"])
@pytest.mark.parametrize("style", ["fsdp", "ddp"])
def test_no_matmul_runs_in_fp32_under_bf16_mixed(efficiency, style, tiled):
    # FSDP2: bf16 parameters; DDP: fp32 parameters under autocast (the loss's backward runs outside it). Tiled:
    # the tiles' weight gradients are summed in fp32 by bf16 GEMMs (products.add_product), not fp32 matmuls.
    layer = efficiency.count_layer(TINY, 0, cp=2, tokens=256, style=style, tiled=tiled)
    loss = efficiency.count_loss(TINY, 256, style, chunk_size=64)
    for counts in (layer, loss):
        assert counts.flops["torch.float32"] == 0, dict(counts.flops)
        assert counts.flops["torch.bfloat16"] > 0
    # The loss's matmuls, 2 N H V FLOPs each: the logits and the two gradients, and for a bf16 weight (FSDP2)
    # the logits again in the vocabulary-outer pass that sums its gradient in fp32 (ops/_engine.py).
    assert loss.total_flops == (4 if style == "fsdp" else 3) * 2 * 256 * 64 * 256


def test_the_all_gather_and_the_fp32_gradients_reduce_scatter_send_the_plan_s_bytes(efficiency):
    cp, tokens = 4, 256
    counts = efficiency.count_layer(TINY, 0, cp=cp, tokens=tokens)
    local = tokens * KV_BYTES_PER_TOKEN
    # Forward and backward each gather every peer's keys and values once.
    assert counts.sent["all_gather"] == 2 * (cp - 1) * local
    # The reduce-scatter sums the [cp * T_local] key/value gradients in fp32 (the kernels' accumulation).
    # (cp - 1) / cp of the [cp * T_local] buffer, at twice the bytes of bf16.
    assert counts.sent["reduce_scatter"] == (cp - 1) * 2 * local
    plan = estimate(ModelShape.from_hf_config(TINY), cp * tokens, Layout(cp, cp))
    plan_cp = plan.communication - efficiency.wrapper_bytes(
        ModelShape.from_hf_config(TINY).params, Layout(cp, cp)
    )
    # The plan counts the two gathers of the bf16 K/V and the reduce-scatter of their fp32 gradients.
    assert plan_cp == counts.sent["all_gather"] + counts.sent["reduce_scatter"]
    assert counts.sent["all_gather"] == 2 * ring(cp, cp * local)


def test_ulysses_all_to_alls_send_the_plan_s_bytes(efficiency):
    cp, tokens = 2, 256
    layout = Layout(cp, cp, attention="ulysses")
    counts = efficiency.count_layer(TINY, 0, cp=cp, tokens=tokens, attention=AttentionMode("ulysses"))
    shape = ModelShape.from_hf_config(TINY)
    plan = estimate(shape, cp * tokens, layout)
    assert counts.sent["all_to_all"] == plan.communication - efficiency.wrapper_bytes(shape.params, layout)
    assert set(counts.sent) == {"all_to_all"}


TINY_MLA = {  # DeepSeek-V3's attention at a tiny width: 4 heads, keys of 16 + 8, values of 12, a latent of 16
    "model_type": "deepseek_v3",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 12,
    "first_k_dense_replace": 1,
    "tie_word_embeddings": False,
}


@pytest.mark.parametrize("attention", ["allgather", "ulysses"])
def test_an_mla_layer_sends_its_latent_as_the_plan_counts_it(efficiency, attention):
    # The latent and rotary key part, 16 + 8 bf16 values per token, all-gathered forward and backward and its
    # gradient reduce-scattered in fp32, under either mode: not the 4 x (24 + 12) expanded keys and values.
    cp, tokens = 4, 256
    counts = efficiency.count_layer(TINY_MLA, 0, cp=cp, tokens=tokens, attention=AttentionMode(attention))
    local = tokens * (16 + 8) * 2
    assert counts.sent == {"all_gather": 2 * (cp - 1) * local, "reduce_scatter": (cp - 1) * 2 * local}
    layout = Layout(cp, cp, attention=attention)
    plan = estimate(ModelShape.from_hf_config(TINY_MLA), cp * tokens, layout)
    assert plan.cp_communication == counts.sent["all_gather"] + counts.sent["reduce_scatter"]
    # The backward's kv_b_proj products (the latent's gradient, the weight's) run as bf16 GEMMs summed into fp32,
    # not fp32 matmuls of upcast copies (before: 3.4% of the layer's matmul FLOPs in fp32).
    assert counts.flops["torch.float32"] == 0


TINY_DSA = {  # GLM-5's family at a tiny width (tests/hf's): 4 heads, top-4 keys, one sparse layer
    **SPARSE["glm_moe_dsa"],
    "num_hidden_layers": 1,
    "mlp_layer_types": ["sparse"],
    "indexer_types": ["full"],
}


def test_a_sparse_layer_runs_one_top_k_kernel_a_round_whatever_its_tokens(efficiency):
    # The sparse layer runs on fake tensors once it gets the model's deferred mask (it slices it for its
    # indexer) and attends in MLA's absorbed form (lightning_cp.hf.latent): one latent key of 16 + 8 dims, the
    # values its first 16, read by the 4 query heads. On the GPU path its top-k attention is one Triton kernel
    # call a round, forward and backward, with the FLOPs of every query head's 4 selected keys (a loop per
    # query or per block would dispatch more at more tokens); the indexer scores one block at these lengths.
    counts = [efficiency.count_layer(TINY_DSA, 0, cp=2, tokens=t) for t in (16, 48)]
    assert counts[0].ops == counts[1].ops
    assert [c.ops_in["attention"] for c in counts] == [2, 2]
    # Forward: scores (24 dims) and values (16); backward: scores, dq, dk (24) and dp, dv (16); 4 heads, top-4.
    assert [c.flops_in["attention"] for c in counts] == [2 * t * 4 * 4 * (4 * 24 + 3 * 16) for t in (16, 48)]
    assert all(c.fp32_in["attention"] == c.fp32_in["indexer"] == 0 for c in counts)  # bf16 under FSDP2


def test_a_dsa_layer_s_operators_fit_its_indexer_and_attention_query_blocks(efficiency, monkeypatch):
    # What the benchmark's GLM-5 fit assumes (benchmarks/_dsa_fit.py), at a tiny width: the indexer's operators
    # are a + b (query blocks: one scores call and one top-k each, whatever their span), the attention kernel's
    # and the rest's do not grow (no tiles), so a fit on three lengths gives a fourth's counts exactly. The indexer's blocks hold 160 keys' scores: 1, 1, 3 and 5 blocks at 6, 8, 14 and
    # 20 tokens (12, 16, 28 and 40 keys), so a loop per query or per key is not the blocks' fit.
    import _dsa_fit

    from lightning_cp.parallel import key_indexer

    monkeypatch.setattr(key_indexer, "SCORE_BLOCK_BYTES", 4 * 160)
    monkeypatch.setattr(_dsa_fit, "FIT_TOKENS", (6, 8, 14))
    monkeypatch.setattr(_dsa_fit, "CHECK_TOKENS", 20)
    layout = Layout(2, 2)
    shape = ModelShape.from_hf_config(TINY_DSA)
    fit = _dsa_fit.dsa_fit(TINY_DSA, 0, shape, layout, attention=layout.mode())
    assert fit.check_error() == (0.0, 0.0)
    blocks = [s.indexer_blocks for s, _ in fit.samples] + [fit.check[0].indexer_blocks]
    assert blocks == [1, 1, 3, 5]
    (low, low_counts), (high, high_counts) = fit.samples[0], fit.check
    # A block's scores call is one operator over all its keys; the attention and the rest of the layer dispatch
    # as many at any length.
    indexer = [c.ops_in["indexer"] for c in (low_counts, high_counts)]
    assert 0 < indexer[1] - indexer[0] <= 15 * (high.indexer_blocks - low.indexer_blocks)
    assert low_counts.ops_in["attention"] == high_counts.ops_in["attention"] == 2
    assert low_counts.ops_in["layer"] == high_counts.ops_in["layer"]


TINY_GDN = {  # one Gated DeltaNet layer: 4 value heads of 16 reading 2 key heads of 8
    "model_type": "qwen3_5_text",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 1,
    "layer_types": ["linear_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
}


def test_a_gated_deltanet_layer_runs_fla_s_kernels_whatever_its_tokens(efficiency):
    # On the GPU path the chunked delta rule is fla's kernels: 8 launches forward, 11 backward, whatever the
    # tokens (the torch path loops over every chunk of 64), in bf16, with their FLOPs on every rank's 2 value
    # heads of the whole sequence, its chunks padded to 64 (cp 2 x 40 tokens: 128).
    counts = [efficiency.count_layer(TINY_GDN, 0, cp=2, tokens=t) for t in (40, 640)]
    assert counts[0].ops == counts[1].ops
    assert [c.ops_in["delta_rule"] for c in counts] == [19, 19]
    # Per token and value head (K = 8, V = 16, C = 64): forward 2 K 10 x 16^2 / 64 + 2 x 16 x 16^3 / 64
    # + 4 C (K + V) + 6 K V; backward 16 K V + 18 C K + 10 C V + 4 C^2.
    forward = 2 * 8 * 40 + 2048 + 4 * 64 * 24 + 6 * 128
    backward = 16 * 128 + 18 * 64 * 8 + 10 * 64 * 16 + 4 * 64**2
    assert [c.flops_in["delta_rule"] for c in counts] == [2 * n * (forward + backward) for n in (128, 1280)]
    assert all(c.fp32_in["delta_rule"] == c.flops["torch.float32"] == 0 for c in counts)


def test_qwen3_5_s_delta_rule_flops_are_fla_s_kernels_at_its_width():
    # Qwen3.5's heads (K = V = 128), per token and value head, as read from fla's kernels' tl.dot calls: the
    # forward's intra-chunk products 10,240 + 2,048, w and u 32,768, the states 65,536, the output 65,536; the
    # backward's recomputation 98,304, dv 32,768, the states' gradient 98,304, dq dk dw 147,456, WY 131,072.
    import torch

    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(BENCHMARKS))
        fla = importlib.import_module("_fla_stand_in")
    q, v = torch.Size([1, 64, 16, 128]), torch.Size([1, 64, 32, 128])
    assert fla.forward_flops(q, v) == 64 * 32 * 176_128
    assert fla.backward_flops(q, v) == 64 * 32 * 507_904
    assert (
        fla.forward_flops(torch.Size([2, 65, 16, 128]), torch.Size([2, 65, 32, 128]))
        == 2 * 128 * 32 * 176_128
    )


def test_a_depthwise_convolution_s_backward_counts_twice_its_forward(efficiency):
    # torch's formula counts the weight's gradient over every pair of channels (groups ignored): a hybrid
    # mixer's depthwise convolution's backward counted as a dense one's, C times too many FLOPs.
    import torch
    from _counting import Counts, DispatchCounter
    from torch._subclasses.fake_tensor import FakeTensorMode

    counts = Counts()
    with FakeTensorMode():
        x = torch.empty(2, 48, 100, requires_grad=True)
        weight = torch.empty(48, 1, 4, requires_grad=True)
        counter = DispatchCounter(counts)
        with counter:
            out = torch.nn.functional.conv1d(x, weight, padding=3, groups=48)
            forward = counts.total_flops
            out.backward(torch.empty_like(out))
    assert forward == 2 * 2 * 103 * 48 * 4
    assert counts.total_flops == 3 * forward
