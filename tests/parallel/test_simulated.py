"""The simulated CP group: every rank's attention in one process equals full-sequence attention.

The reference is ``tests/parallel/test_attention.py``'s: SDPA on the whole sequence (padded) or on every
document alone (packed), K/V heads repeated by hand.
"""

import pytest
import torch

from lightning_cp.parallel.sharding import shard_batch
from lightning_cp.parallel.simulated import SimulatedCPGroup, rank_attention, simulate_cp_attention
from tests.parallel.test_attention import DIM, HEADS, PACKED_CU, PADDED_SHAPE, _inputs, _reference


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("kv_heads", [HEADS, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_every_simulated_rank_together_is_full_attention(packed, kv_heads, cp):
    cu = PACKED_CU if packed else None
    batch, total = (1, int(PACKED_CU[-1])) if packed else PADDED_SHAPE
    q, k, v, dout = _inputs(batch, total, kv_heads)
    expected = _reference(q, k, v, dout, cu)
    got = simulate_cp_attention(q, k, v, dout, cp_size=cp, cu_seqlens=cu)
    for name, g, e in zip(("out", "dq", "dk", "dv"), got, expected, strict=True):
        # dk / dv need every rank's contribution: a rank's own share alone is off by far more.
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-10, msg=f"cp={cp} {name}")


def test_all_gather_answers_exactly_once_every_rank_is_recorded():
    group = SimulatedCPGroup(3)
    sent = [torch.full((2, 3), float(r)) for r in range(3)]
    with group.recording():
        assert (
            group.exchange(1).all_gather(sent[1]).tolist()
            == [[0.0] * 3] * 2 + [[1.0] * 3] * 2 + [[0.0] * 3] * 2
        )
    with pytest.raises(RuntimeError, match=r"ranks \[0, 2\] have not all-gathered"):
        group.exchange(1).all_gather(sent[1])
    with group.recording():
        group.exchange(0).all_gather(sent[0])
        group.exchange(2).all_gather(sent[2])
    mine = torch.full((2, 3), 7.0)  # the caller's own tensor, not the recorded one, in its slot
    assert group.exchange(1).all_gather(mine).tolist() == torch.cat([sent[0], mine, sent[2]]).tolist()
    with pytest.raises(ValueError, match=r"rank=3 must be in \[0, cp_size=3\)"):
        group.exchange(3)


def test_reduce_scatter_answers_the_sum_of_what_every_rank_sent():
    group, timed = SimulatedCPGroup(2), SimulatedCPGroup(2, sum_key_gradients=False)
    sent = [torch.arange(4.0).view(4, 1) * (r + 1) for r in range(2)]  # rank r sends (r + 1) * [0, 1, 2, 3]
    with group.recording():
        own = [group.exchange(r).reduce_scatter(sent[r]) for r in range(2)]
    assert [t.flatten().tolist() for t in own] == [[0.0, 1.0], [4.0, 6.0]]  # each rank's own share
    assert group.exchange(0).reduce_scatter(sent[0]).flatten().tolist() == [0.0, 3.0]
    assert group.exchange(1).reduce_scatter(sent[1]).flatten().tolist() == [6.0, 9.0]
    with pytest.raises(RuntimeError, match=r"ranks \[0, 1\] have not sent their key gradients"):
        SimulatedCPGroup(2).exchange(0).reduce_scatter(sent[0])
    assert timed.exchange(1).reduce_scatter(sent[1]).flatten().tolist() == [4.0, 6.0]


def test_one_rank_timed_like_the_benchmark_computes_its_rows_of_full_attention():
    """Every rank's forward recorded once, then one rank's attention with its own share of the key
    gradients (``sum_key_gradients=False``): its output is exactly its rows of full attention."""
    total = 24
    q, k, v, dout = _inputs(1, total)
    full = _reference(q, k, v, dout, None)[0][0].transpose(0, 1)  # [T, H, D]
    q, k, v = (t[0].transpose(0, 1) for t in (q, k, v))
    batch = {"input_ids": torch.zeros(1, total, dtype=torch.long), "token": torch.arange(total)[None]}
    group = SimulatedCPGroup(2, sum_key_gradients=False)
    shards = [shard_batch(batch, 2, rank, cp_group=group.exchange(rank)) for rank in range(2)]
    mine = [s["token"][0] for s in shards]
    with group.recording(), torch.no_grad():
        for rank in range(2):
            rank_attention(q[mine[rank]], k[mine[rank]], v[mine[rank]], shards[rank]["cp_shard"], DIM**-0.5)
    lq = q[mine[1]].requires_grad_()
    out = rank_attention(lq, k[mine[1]], v[mine[1]], shards[1]["cp_shard"], DIM**-0.5)
    torch.testing.assert_close(out, full[mine[1]], rtol=1e-10, atol=1e-10)
    out.sum().backward()
    assert lq.grad is not None
