"""The plan's DeepSeek Sparse Attention terms: read from a config, and one layer held against the CPU.

One rank of a CP group runs one sparse attention layer's work (``benchmarks/sparse_attention.py``'s
``layer_step``: the indexer's selection, int32, the attention and its backward; its peers' collectives
allocate as NCCL's, their rows zeros), its peak counted by storage (every tensor the step creates, inputs
left out), against :func:`lightning_cp.plan.sparse.sparse_layer_bytes`. The kernels' bounded blocks are made
small (1 MiB) so that the terms that grow with the tokens, which the blocks are beside at long context, are
what the measurement sees at a few thousand tokens; blocked by other rules of the kernels' own, the plan follows
(it reads their block sizes, never restates them). A sparse model's sizes are read through its family's
description (:mod:`lightning_cp.hf.sparse_kinds`).
"""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path
from types import ModuleType

import pytest
import torch

from lightning_cp.hf import sparse_kinds
from lightning_cp.parallel import key_indexer
from lightning_cp.parallel import sparse_attention as sparse_kernel
from lightning_cp.plan import Layout, ModelShape, estimate, local_tokens
from lightning_cp.plan.search import attentions
from lightning_cp.plan.sparse import sparse_layer_bytes

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
TOLERANCE = 0.10
BLOCK_BYTES = 2**20

_HY_V4 = {
    "model_type": "hy_v4",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "index_topk": 64,
    "index_n_heads": 2,
    "index_head_dim": 16,
    "pad_token_id": None,
    "bos_token_id": None,
    "eos_token_id": None,
}
"""A tiny HY-V4: MLA (keys of 16 + 8 dims, values of 12) with an indexer, whose default ``indexer_types`` give
layers 0, 1 and 5 a full indexer and 2-4 the previous one's selection."""


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """``benchmarks/sparse_attention.py``, imported as its script imports its siblings, with 1 MiB blocks."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setattr(key_indexer, "SCORE_BLOCK_BYTES", BLOCK_BYTES)
    monkeypatch.setattr(sparse_kernel, "SELECTED_BLOCK_BYTES", BLOCK_BYTES)
    monkeypatch.setattr(sparse_kernel, "MIN_BLOCK_QUERIES", 1)
    return importlib.import_module("sparse_attention")


def _measured(bench: ModuleType, shape: ModelShape, tokens: int, cp: int) -> int:
    step, inputs = bench.layer_step(shape, tokens, cp)
    tracker = bench.StoragePeak(inputs)
    with tracker:
        step()
    return tracker.peak


def test_one_sparse_layer_peaks_as_the_plan_says(bench):
    shape = bench.layer_shape(
        heads=2, qk_head_dim=48, v_head_dim=32, index_heads=4, index_head_dim=32, topk=256
    )
    planned = sparse_layer_bytes(shape, local_tokens(4096, 2), 2, heads_per_round=2, compute_bytes=4)
    assert _measured(bench, shape, 4096, cp=2) == pytest.approx(planned.peak, rel=TOLERANCE), planned
    # The saved selection is a tenth of the peak or more, at the backward: a plan without it is off by as much.
    assert planned.selection > TOLERANCE * planned.peak


def test_the_plan_holds_at_cp_4_with_more_heads_and_fewer_keys(bench):
    shape = bench.layer_shape(
        heads=4, qk_head_dim=48, v_head_dim=32, index_heads=4, index_head_dim=32, topk=64
    )
    planned = sparse_layer_bytes(shape, local_tokens(2048, 4), 4, heads_per_round=4, compute_bytes=4)
    assert _measured(bench, shape, 2048, cp=4) == pytest.approx(planned.peak, rel=TOLERANCE)


# Queries (and keys) per score block of the indexer, queries per block of the attention: 256 and 12 at 1 MiB.
_OTHER_BLOCKS = {
    "key_indexer": (key_indexer, "query_block_tokens", lambda keys: 512),
    "sparse_attention": (sparse_kernel, "query_block", lambda width, kv_heads, group, dims: (64, kv_heads)),
}


@pytest.mark.parametrize("kernel", sorted(_OTHER_BLOCKS))
def test_the_plan_counts_the_blocks_the_kernels_run(bench, monkeypatch, kernel):
    """A kernel that blocks by another rule moves the measured peak by half or more; the plan, which reads the
    kernels' block sizes, moves with it."""
    module, name, rule = _OTHER_BLOCKS[kernel]
    monkeypatch.setattr(module, name, rule)
    shape = bench.layer_shape(
        heads=4, qk_head_dim=48, v_head_dim=32, index_heads=4, index_head_dim=32, topk=64
    )
    planned = sparse_layer_bytes(shape, local_tokens(2048, 4), 4, heads_per_round=4, compute_bytes=4)
    assert _measured(bench, shape, 2048, cp=4) == pytest.approx(planned.peak, rel=TOLERANCE)


def test_the_shape_reads_a_family_through_its_description(monkeypatch):
    """The plan sizes a sparse model as its indexers' family description says (the config keys it names), and a
    model whose indexer no description names has no sparse attention to plan."""
    pytest.importorskip("transformers")
    hy_v4 = sparse_kinds.INDEXERS["HYV4Indexer"]
    other_keys = dataclasses.replace(hy_v4, topk_key="index_head_dim", selection_key="no_such_key")
    monkeypatch.setitem(sparse_kinds.INDEXERS, "HYV4Indexer", other_keys)
    sparse = ModelShape.from_hf_config(_HY_V4).sparse
    assert (sparse.topk, sparse.layers, sparse.indexer_layers) == (16, 6, 6)
    monkeypatch.delitem(sparse_kinds.INDEXERS, "HYV4Indexer")
    assert ModelShape.from_hf_config(_HY_V4).sparse is None


def test_the_shape_reads_the_indexer_and_mla_heads_from_the_config():
    pytest.importorskip("transformers")
    shape = ModelShape.from_hf_config(_HY_V4)
    assert (shape.heads, shape.kv_heads, shape.head_dim, shape.v_head_dim) == (4, 4, 24, 12)
    sparse = shape.sparse
    assert (sparse.topk, sparse.heads, sparse.head_dim) == (64, 2, 16)
    assert (sparse.layers, sparse.indexer_layers) == (6, 3)
    dense = {
        key: _HY_V4[key] for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
    }
    assert ModelShape.from_hf_config({"model_type": "llama", **dense}).sparse is None


def test_the_estimate_saves_one_selection_per_full_indexer_and_never_plans_ulysses():
    pytest.importorskip("transformers")
    shape = ModelShape.from_hf_config(_HY_V4)
    tokens = local_tokens(4096, 4)
    # HY-V4 is MLA: its sparse layers attend in the absorbed form, one key of the latent's 16 + 8 dims for its 4
    # heads, the values its first 16 columns; each head's query (24) and output (16) in the latent's space kept.
    absorbed_shape = dataclasses.replace(shape, kv_heads=1, head_dim=24, value_head_dim=16)
    absorbed = tokens * 4 * (24 + 16) * 4
    for layout in (Layout(4, 4), Layout(4, 4, fsdp=True, checkpointing=True, offload=True)):
        planned = estimate(shape, 4096, layout, precision="32-true")
        assert planned.selections == 3 * 4 * tokens * 64
        layer = sparse_layer_bytes(absorbed_shape, tokens, 4, heads_per_round=1, compute_bytes=4, latent=True)
        assert planned.sparse_attention == layer.backward + absorbed
        assert planned.indexer == layer.indexer
        assert planned.attention == 0  # no dense attention layer
    assert ("ulysses", None) not in attentions(4, shape)


def test_a_round_s_backward_holds_its_keys_and_one_fp32_copy_of_their_gradients(bench, monkeypatch):
    """Few selected keys per query in small blocks: the backward's peak is a round's gathered keys and values
    beside their fp32 gradients, added at their gathered rows of the buffer that is reduce-scattered. With a
    sequence-order copy of the gradients and their concatenation beside that buffer (three fp32 copies: in
    bf16, twice what the all-gather's round budget, ``gathered_bytes_per_head``, counts) the step peaked 30%
    above this plan."""
    monkeypatch.setattr(sparse_kernel, "SELECTED_BLOCK_BYTES", 2**16)
    shape = bench.layer_shape(heads=2, qk_head_dim=48, v_head_dim=32, index_heads=1, index_head_dim=8, topk=4)
    planned = sparse_layer_bytes(shape, local_tokens(4096, 2), 2, heads_per_round=2, compute_bytes=4)
    assert _measured(bench, shape, 4096, cp=2) == pytest.approx(planned.peak, rel=TOLERANCE / 2), planned


def test_the_plan_holds_for_mla_s_absorbed_form_one_latent_key_for_every_head(bench, monkeypatch):
    """Keys of one head shared by 8 query heads, whose first 64 columns are the values (``v=None``): only the
    keys are gathered and a block holds each selected key once for the 8 heads. Blocks of 64 queries, as the
    kernel runs at real shapes (``MIN_BLOCK_QUERIES``), so the block is a third of the peak."""
    monkeypatch.setattr(sparse_kernel, "MIN_BLOCK_QUERIES", 64)
    shape = bench.layer_shape(
        heads=8, qk_head_dim=72, v_head_dim=64, index_heads=4, index_head_dim=32, topk=256, kv_heads=1
    )
    tokens = local_tokens(4096, 2)
    planned = sparse_layer_bytes(shape, tokens, 2, heads_per_round=1, compute_bytes=4, latent=True)
    step, inputs = bench.layer_step(shape, 4096, 2, latent=True)
    tracker = bench.StoragePeak(inputs)
    with tracker:
        step()
    assert tracker.peak == pytest.approx(planned.peak, rel=TOLERANCE), planned
    expanded = sparse_layer_bytes(shape, tokens, 2, heads_per_round=1, compute_bytes=4)
    assert expanded.backward > planned.backward * (1 + TOLERANCE)  # the values gathered would be counted


def test_the_indexer_s_selection_peaks_as_the_plan_s_indexer_term(bench):
    """The selection alone (the indexer keys all-gathered, blocks of queries scored over their span and their
    top-k taken, the int32 copy), at 1 MiB blocks: 64 queries over the 4,096 gathered keys, scored 512 keys of 8
    heads a step. Without the step's products the plan is 32% short."""
    index_heads, topk = 8, 64
    from lightning_cp.parallel import shard_batch

    shape = bench.layer_shape(
        heads=2, qk_head_dim=48, v_head_dim=32, index_heads=index_heads, index_head_dim=32, topk=topk
    )
    ids = {"input_ids": torch.zeros(1, 4096, dtype=torch.long)}
    shard = shard_batch(ids, 2, 0, cp_group=bench.one_rank_exchange(2))["cp_shard"]
    g = torch.Generator().manual_seed(0)
    inputs = (torch.randn(2048, index_heads, 32, generator=g), torch.randn(2048, index_heads, generator=g))
    inputs += (torch.randn(2048, 32, generator=g),)
    tracker = bench.StoragePeak(inputs)
    with tracker:
        key_indexer.select_topk_keys(*inputs, shard, topk, 0.2).int()
    planned = sparse_layer_bytes(shape, 2048, 2, heads_per_round=2, compute_bytes=4)
    assert tracker.peak == pytest.approx(planned.indexer, rel=TOLERANCE / 2), planned


def test_the_step_s_flops_count_each_full_indexer_s_causal_scores_forward_only():
    """HY-V4's 3 full indexers of 2 heads x 16 dims: each query's products and weighted sum over its earlier keys
    (a quarter of the causal pairs at cp 4), once in the model's FLOPs and once more when checkpointing recomputes
    the layer (the indexer selects again); no backward (it selects without a gradient)."""
    pytest.importorskip("transformers")
    from lightning_cp.plan.flops import step_flops

    shape = ModelShape.from_hf_config(_HY_V4)
    without = dataclasses.replace(shape, sparse=dataclasses.replace(shape.sparse, indexer_layers=0))
    scores = 3 * 2 * 2 * (16 + 1) * (4096 * 4097 // 2 // 4)
    for layout in (Layout(4, 4), Layout(4, 4, checkpointing=True)):
        flops, base = step_flops(shape, 4096, layout), step_flops(without, 4096, layout)
        assert flops.model - base.model == scores
        assert flops.recomputed - base.recomputed == scores * layout.checkpointing
