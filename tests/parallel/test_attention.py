"""CP attention against full-sequence causal attention, on 4 gloo ranks for cp = 1, 2, 4."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_cp.parallel import all_gather, context_parallel_attention, groups, shard_batch, unshard

HEADS, DIM = 2, 8
PADDED_SHAPE = (2, 22)  # B, S: 22 is not a multiple of 2*cp for cp = 4 (padding exercised)
PACKED_CU = torch.tensor([0, 9, 10, 25, 32])


def _inputs(batch, total):
    g = torch.Generator().manual_seed(1234)
    q, k, v, dout = (torch.randn(batch, HEADS, total, DIM, generator=g) for _ in range(4))
    return q, k, v, dout


def _reference(q, k, v, dout, cu_seqlens):
    """Plain SDPA on the full sequence; a packed row gets a block-diagonal causal mask built by a loop."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    if cu_seqlens is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        total = q.shape[2]
        mask = torch.zeros(total, total, dtype=torch.bool)
        for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
            mask[start:end, start:end] = torch.ones(end - start, end - start, dtype=torch.bool).tril()
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _shard_heads(x, cp, rank, cu_seqlens):
    """Shard a [B, H, S, D] tensor along S with shard_batch's layout (as an extra per-token key)."""
    batch = {"input_ids": torch.zeros(x.shape[0], x.shape[2], dtype=torch.long), "x": x.transpose(1, 2)}
    if cu_seqlens is not None:
        batch["cu_seqlens"] = cu_seqlens
    shard = shard_batch(batch, cp, rank)
    return shard["x"].transpose(1, 2).contiguous(), shard.get("cu_seqlens")


def _run_cp_attention(packed):
    """On every rank, for cp in (1, 2, 4): local output and grads of this rank's shard."""
    cu = PACKED_CU if packed else None
    batch, total = (1, int(PACKED_CU[-1])) if packed else PADDED_SHAPE
    q, k, v, dout = _inputs(batch, total)
    results = {}
    for cp in (1, 2, 4):
        groups.initialize(tp=1, cp=cp)
        rank = groups.cp_rank()
        lq, local_cu = _shard_heads(q, cp, rank, cu)
        lk, _ = _shard_heads(k, cp, rank, cu)
        lv, _ = _shard_heads(v, cp, rank, cu)
        ldout, _ = _shard_heads(dout, cp, rank, cu)
        lq, lk, lv = (t.requires_grad_() for t in (lq, lk, lv))
        out = context_parallel_attention(lq, lk, lv, cu_seqlens=local_cu, cp_group=groups.cp_group())
        out.backward(ldout)
        results[cp] = (rank, out.detach(), lq.grad, lk.grad, lv.grad)
        groups.destroy()
    return results


@pytest.mark.parametrize("packed", [False, True])
def test_cp_attention_matches_full_causal_attention(world4, packed):
    per_rank = world4.run(_run_cp_attention, packed)
    cu = PACKED_CU if packed else None
    batch, total = (1, int(PACKED_CU[-1])) if packed else PADDED_SHAPE
    expected = _reference(*_inputs(batch, total), cu)
    for cp in (1, 2, 4):
        by_cp_rank = {}
        for results in per_rank:
            rank, *tensors = results[cp]
            by_cp_rank.setdefault(rank, tensors)  # DP replicas hold the same shard
        for i, name in enumerate(("out", "dq", "dk", "dv")):
            # [B, H, S, D] -> [B, S, H, D] so unshard sees the sequence in dim 1
            shards = [by_cp_rank[r][i].transpose(1, 2) for r in range(cp)]
            full = unshard(shards, seq_len=None if packed else total, cu_seqlens=cu).transpose(1, 2)
            torch.testing.assert_close(full, expected[i], rtol=1e-5, atol=1e-5, msg=f"cp={cp} {name}")


def _gather_on_second_subgroup():
    """all_gather on the CP group [2, 3] (not starting at rank 0) with a backward that sums per owner."""
    groups.initialize(tp=1, cp=2)
    rank = dist.get_rank()
    x = torch.full((2, 3), float(rank), requires_grad=True)
    y = all_gather(x, 0, groups.cp_group())
    weights = torch.arange(y.numel(), dtype=torch.float32).view_as(y) * (rank + 1)
    (y * weights).sum().backward()
    return y.detach(), x.grad


def test_all_gather_forward_and_backward_on_gloo_subgroups(world4):
    results = world4.run(_gather_on_second_subgroup)
    weights = torch.arange(12, dtype=torch.float32).view(4, 3)
    for rank, (y, grad) in enumerate(results):
        peers = [rank - rank % 2, rank - rank % 2 + 1]
        assert torch.equal(y, torch.cat([torch.full((2, 3), float(p)) for p in peers]))
        # d/dx of sum_p (y_p * w * (p + 1)) for this rank's slice of y
        slice_rows = slice(2 * (rank % 2), 2 * (rank % 2) + 2)
        expected = sum(weights[slice_rows] * (p + 1) for p in peers)
        torch.testing.assert_close(grad, expected)


def test_without_cp_any_length_is_plain_causal_attention():
    q, k, v = torch.randn(3, 1, 2, 7, 4).unbind(0)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(context_parallel_attention(q, k, v), expected)


def test_attention_rejects_bad_shapes():
    q = torch.randn(1, 2, 6, 4)
    with pytest.raises(ValueError, match="odd"):
        context_parallel_attention(q[:, :, :5], q[:, :, :5], q[:, :, :5], cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="same B, heads and S_local"):
        context_parallel_attention(q, q[:, :1], q[:, :1])
    with pytest.raises(ValueError, match="cu_seqlens ends at"):
        context_parallel_attention(q, q, q, cu_seqlens=torch.tensor([0, 4]))
