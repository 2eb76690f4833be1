"""The simulated CP group: every rank's attention in one process equals full-sequence attention.

The reference is ``tests/parallel/test_attention.py``'s: SDPA on the whole sequence (padded) or on every
document alone (packed), K/V heads repeated by hand.
"""

import pytest
import torch

from lightning_cp.parallel.attention import _CPAttention
from lightning_cp.parallel.sharding import shard_batch
from lightning_cp.parallel.simulated import SimulatedCPGroup, exchange_input, simulate_cp_attention
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


def test_all_gather_returns_every_rank_in_order_with_the_callers_own_tensor():
    locals_ = [torch.full((3, 4, 2), float(r)) for r in range(3)]
    group = SimulatedCPGroup(locals_)
    mine = torch.full((3, 4, 2), 7.0)
    gathered = group.exchange(1).all_gather(mine)
    assert gathered.tolist() == torch.cat([locals_[0], mine, locals_[2]]).tolist()
    with pytest.raises(ValueError, match=r"gathers a \(2, 4, 2\) tensor"):
        group.exchange(0).all_gather(mine[:2])


def test_key_gradients_are_the_sum_of_what_every_rank_sent():
    group = SimulatedCPGroup([torch.zeros(2, 1, 1)] * 2)
    with pytest.raises(RuntimeError, match=r"ranks \[0, 1\] have not sent"):
        group.key_gradients(0)
    own = [group.exchange(r).reduce_scatter(torch.arange(4.0).view(4, 1, 1) * (r + 1)) for r in range(2)]
    assert [t.flatten().tolist() for t in own] == [[0.0, 1.0], [4.0, 6.0]]  # each rank's own share only
    assert group.key_gradients(0).flatten().tolist() == [0.0, 3.0]
    assert group.key_gradients(1).flatten().tolist() == [6.0, 9.0]
    with pytest.raises(ValueError, match=r"rank=2 must be in \[0, cp_size=2\)"):
        group.exchange(2)


def test_a_group_keeping_no_gradients_runs_one_rank_like_a_real_one():
    """One rank's attention through a group that records nothing (as the benchmark times it): the rank's
    rows of full attention, and no key gradients kept after its backward."""
    total = 24
    q, k, v, dout = _inputs(1, total)
    full = _reference(q, k, v, dout, None)[0][0].transpose(0, 1)  # [T, H, D]
    q, k, v = (t[0].transpose(0, 1) for t in (q, k, v))
    batch = {"input_ids": torch.zeros(1, total, dtype=torch.long), "token": torch.arange(total)[None]}
    shards = [shard_batch(batch, 2, rank) for rank in range(2)]
    mine = [s["token"][0] for s in shards]
    group = SimulatedCPGroup([exchange_input(k[m], v[m]) for m in mine], keep_key_gradients=False)
    lq = q[mine[1]].requires_grad_()
    out = _CPAttention.apply(lq, k[mine[1]], v[mine[1]], shards[1]["cp_shard"], group.exchange(1), DIM**-0.5)
    torch.testing.assert_close(out, full[mine[1]], rtol=1e-10, atol=1e-10)
    out.sum().backward()
    with pytest.raises(RuntimeError, match="have not sent"):
        group.key_gradients(1)
