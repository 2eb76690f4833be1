"""The attention mode a batch carries: which exchange runs, and in how many all-gather rounds.

Every mode gives the same numbers, so these tests check *the collectives that ran*
(:mod:`tests.parallel._collectives`) besides the result, against full-sequence SDPA.
"""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from lightning_cp.parallel import attention_mode, context_parallel_attention, groups, unshard
from lightning_cp.parallel.attention_mode import AttentionMode
from tests.parallel._collectives import kinds, recorded_collectives
from tests.parallel.test_attention import PADDED_SHAPE, _inputs, _reference, _shard_heads

KV_HEADS = 4  # rounds of 1, 2 or 4 heads
# Bytes of one key/value head's copies at the backward's peak at cp = 2: the rows padded to 24 tokens, 48
# gathered tokens of D + Dv = 16 float64 values, three times (written out: the plan counts the same).
PER_HEAD = 3 * 48 * 16 * 8


def _free_memory_of_this_rank(monkeypatch, rank):
    """Simulate CUDA: rank 0 has 1 TiB free (every head in one round), rank 1 room for two heads per round
    at its first measurement and for one at every later one (a layer, or a recomputation, that measured
    again would gather in other rounds than the forward)."""
    measured = iter([10 * PER_HEAD] + [2 * PER_HEAD] * 100)  # a quarter of it: 2.5, then 0.5 heads
    free = (lambda: 2**40) if rank == 0 else (lambda: next(measured))
    monkeypatch.setattr(attention_mode, "_is_cuda", lambda device: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free(), 2**41))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)


def _checkpointed_attention_with_free_memory_per_rank():
    """cp = 2, ``kv_heads_per_gather=None``, each rank with its own free memory; the attention under
    activation checkpointing (its recomputation gathers again)."""
    layout = groups.initialize(tp=1, cp=2)
    rank = layout.cp_rank
    q, k, v, dout = _inputs(*PADDED_SHAPE, kv_heads=KV_HEADS)
    with pytest.MonkeyPatch.context() as monkeypatch:
        _free_memory_of_this_rank(monkeypatch, rank)
        lq, shard = _shard_heads(q, 2, rank, None, layout.cp_group, AttentionMode())
        lk, lv, ldout = (_shard_heads(t, 2, rank, None)[0] for t in (k, v, dout))
        leaves = [t.requires_grad_() for t in (lq, lk, lv)]
        with recorded_collectives() as forward:
            out = checkpoint(
                lambda *x: context_parallel_attention(*x, cp_shard=shard), *leaves, use_reentrant=False
            )
        with recorded_collectives() as backward:
            out.backward(ldout)
    grads = (t.grad for t in leaves)
    return rank, shard.kv_gather_budget, kinds(forward), kinds(backward), out.detach(), *grads


def test_ranks_agree_on_the_rounds_whatever_their_free_memory(world2):
    per_rank = world2.run(_checkpointed_attention_with_free_memory_per_rank)
    budgets = {budget for _, budget, *_ in per_rank}
    assert budgets == {10 * PER_HEAD // 4}  # rank 1's first measurement (the least), on both ranks
    for _, _, forward, backward, *_ in per_rank:
        # Two heads per round on every rank: 2 all-gathers forward; the recomputation the same 2, the
        # backward 2 more and 2 reduce-scatters.
        assert forward == ["all_gather"] * 2
        assert sorted(backward) == ["all_gather"] * 4 + ["reduce_scatter"] * 2
    expected = _reference(*_inputs(*PADDED_SHAPE, kv_heads=KV_HEADS), None)
    by_rank = {rank: tensors for rank, _, _, _, *tensors in per_rank}
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        shards = [by_rank[r][i].transpose(1, 2) for r in range(2)]
        full = unshard(shards, seq_len=PADDED_SHAPE[1]).transpose(1, 2)
        torch.testing.assert_close(full, expected[i], rtol=1e-10, atol=1e-10, msg=name)


CASES = {  # the mode, query and key/value heads, and the collectives of one forward at cp = 2
    "a count that does not divide Hkv": (AttentionMode(kv_heads_per_gather=3), 4, 4, ["all_gather"] * 2),
    "auto where the heads split": (AttentionMode("auto"), 4, 2, ["all_to_all"] * 2),
    "auto where they do not": (AttentionMode("auto"), 3, 3, ["all_gather"]),
}


def _forward_collectives(mode, heads, kv_heads):
    layout = groups.initialize(tp=1, cp=2)
    rank = layout.cp_rank
    q, k, v, dout = _inputs(*PADDED_SHAPE, kv_heads=kv_heads, heads=heads)
    lq, shard = _shard_heads(q, 2, rank, None, layout.cp_group, mode)
    lk, lv, ldout = (_shard_heads(t, 2, rank, None)[0] for t in (k, v, dout))
    leaves = [t.requires_grad_() for t in (lq, lk, lv)]
    with recorded_collectives() as calls:
        out = context_parallel_attention(*leaves, cp_shard=shard)
    out.backward(ldout)
    return rank, kinds(calls), out.detach(), *(t.grad for t in leaves)


@pytest.mark.parametrize("case", CASES)
def test_the_mode_runs_its_exchange(world2, case):
    mode, heads, kv_heads, expected_calls = CASES[case]
    per_rank = world2.run(_forward_collectives, mode, heads, kv_heads)
    assert [calls for _, calls, *_ in per_rank] == [expected_calls] * 2
    expected = _reference(*_inputs(*PADDED_SHAPE, kv_heads=kv_heads, heads=heads), None)
    by_rank = {rank: tensors for rank, _, *tensors in per_rank}
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        shards = [by_rank[r][i].transpose(1, 2) for r in range(2)]
        full = unshard(shards, seq_len=PADDED_SHAPE[1]).transpose(1, 2)
        torch.testing.assert_close(full, expected[i], rtol=1e-10, atol=1e-10, msg=name)


def test_heads_per_gather_is_the_largest_divisor_of_hkv_within_the_count_or_the_budget():
    assert AttentionMode(kv_heads_per_gather=3).heads_per_gather(4, 100, None) == 2  # not 4
    assert AttentionMode(kv_heads_per_gather=5).heads_per_gather(8, 100, None) == 4
    assert AttentionMode(kv_heads_per_gather=16).heads_per_gather(8, 100, None) == 8
    assert AttentionMode().heads_per_gather(8, 100, 350) == 2  # room for 3 heads: 2 divide 8
    assert AttentionMode().heads_per_gather(8, 100, 50) == 1  # room for none: one at a time
    assert AttentionMode().heads_per_gather(8, 100, None) == 8  # no budget: all at once


def test_auto_is_ulysses_exactly_where_the_heads_split():
    auto = AttentionMode("auto")
    assert auto.ulysses(4, 2, 2) and auto.ulysses(8, 1, 4) and auto.ulysses(8, 8, 4)
    assert not auto.ulysses(6, 3, 2) and not auto.ulysses(6, 6, 4) and not auto.ulysses(4, 2, 1)
    assert not AttentionMode("allgather").ulysses(4, 2, 2)


def test_a_count_of_heads_per_gather_with_ulysses_is_refused():
    with pytest.raises(ValueError, match=r"kv_heads_per_gather=2 .* cp_attention='ulysses' never runs"):
        AttentionMode("ulysses", kv_heads_per_gather=2)
