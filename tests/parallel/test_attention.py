"""CP attention against full-sequence attention, on 4 gloo ranks for cp = 1, 2, 4.

The references are independent of the code under test: ``scaled_dot_product_attention`` on the whole
sequence (padded) and SDPA run on every document alone (packed), with K/V heads repeated by hand for
grouped-query attention.
"""

import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_cp.parallel import (
    CPShard,
    CPSplit,
    _varlen,
    context_parallel_attention,
    groups,
    shard_batch,
    unshard,
)

HEADS, KV_HEADS, DIM = 4, 2, 8
PADDED_SHAPE = (2, 22)  # B, S: 22 is not a multiple of 2*cp for cp = 4 (padding exercised)
# Documents of length 1, odd lengths, and one longer than a CP chunk at every cp.
PACKED_CU = torch.tensor([0, 1, 10, 11, 26, 33, 34])


def _inputs(batch, total, kv_heads=KV_HEADS, heads=HEADS):
    g = torch.Generator().manual_seed(1234)
    q = torch.randn(batch, heads, total, DIM, generator=g, dtype=torch.float64)
    k, v = (torch.randn(batch, kv_heads, total, DIM, generator=g, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(batch, heads, total, DIM, generator=g, dtype=torch.float64)
    return q, k, v, dout


def _reference(q, k, v, dout, cu_seqlens):
    """SDPA on the full sequence (padded) or on every document alone (packed); K/V repeated per group."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k_full, v_full = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if cu_seqlens is None:
        out = F.scaled_dot_product_attention(q, k_full, v_full, is_causal=True)
    else:
        bounds = list(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()))
        out = torch.cat(
            [
                F.scaled_dot_product_attention(
                    q[:, :, a:b], k_full[:, :, a:b], v_full[:, :, a:b], is_causal=True
                )
                for a, b in bounds
            ],
            dim=2,
        )
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _shard_heads(x, cp, rank, cu_seqlens, group=None, attention=None):
    """Shard a [B, H, S, D] tensor along S with shard_batch's layout (as an extra per-token key)."""
    batch = {"input_ids": torch.zeros(x.shape[0], x.shape[2], dtype=torch.long), "x": x.transpose(1, 2)}
    if cu_seqlens is not None:
        batch["cu_seqlens"] = cu_seqlens
    shard = shard_batch(batch, cp, rank, cp_group=group, attention=attention)
    return shard["x"].transpose(1, 2).contiguous(), shard["cp_shard"]


def _run_cp_attention(packed, kv_heads):
    """On every rank, for cp in (1, 2, 4): local output and grads of this rank's shard."""
    cu = PACKED_CU if packed else None
    batch, total = (1, int(PACKED_CU[-1])) if packed else PADDED_SHAPE
    q, k, v, dout = _inputs(batch, total, kv_heads)
    results = {}
    for cp in (1, 2, 4):
        layout = groups.initialize(tp=1, cp=cp)
        lq, shard = _shard_heads(q, cp, layout.cp_rank, cu, layout.cp_group)
        lk, lv, ldout = (_shard_heads(t, cp, layout.cp_rank, cu)[0] for t in (k, v, dout))
        lq, lk, lv = (t.requires_grad_() for t in (lq, lk, lv))
        out = context_parallel_attention(lq, lk, lv, cp_shard=shard)
        out.backward(ldout)
        results[cp] = (layout.cp_rank, out.detach(), lq.grad, lk.grad, lv.grad)
        groups.destroy()
    return results


@pytest.mark.parametrize("kv_heads", [HEADS, KV_HEADS, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_cp_attention_matches_full_attention(world4, packed, kv_heads):
    per_rank = world4.run(_run_cp_attention, packed, kv_heads)
    cu = PACKED_CU if packed else None
    batch, total = (1, int(PACKED_CU[-1])) if packed else PADDED_SHAPE
    expected = _reference(*_inputs(batch, total, kv_heads), cu)
    for cp in (1, 2, 4):
        by_cp_rank = {}
        for results in per_rank:
            rank, *tensors = results[cp]
            by_cp_rank.setdefault(rank, tensors)  # DP replicas hold the same shard
        for i, name in enumerate(("out", "dq", "dk", "dv")):
            # [B, H, S, D] -> [B, S, H, D] so unshard sees the sequence in dim 1
            shards = [by_cp_rank[r][i].transpose(1, 2) for r in range(cp)]
            full = unshard(shards, seq_len=None if packed else total, cu_seqlens=cu).transpose(1, 2)
            torch.testing.assert_close(full, expected[i], rtol=1e-10, atol=1e-10, msg=f"cp={cp} {name}")


def test_bf16_inputs_give_bf16_outputs_close_to_fp32():
    (q, shard), (k, _), (v, _) = (
        _shard_heads(t, 1, 0, PACKED_CU) for t in _inputs(1, int(PACKED_CU[-1]))[:3]
    )
    want = context_parallel_attention(q.float(), k.float(), v.float(), cp_shard=shard)
    got = context_parallel_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), cp_shard=shard)
    assert got.dtype == torch.bfloat16
    assert (got.float() - want).norm() / want.norm() < 1e-2


def test_without_cp_a_row_is_one_causal_sequence():
    """No layout, no group: each row attends causally to itself; checked against a hand-written softmax."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 2, 7, 4, generator=g, dtype=torch.float64) for _ in range(3))
    scores = q @ k.transpose(-1, -2) / 2.0
    scores = scores.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
    expected = scores.softmax(-1) @ v
    torch.testing.assert_close(context_parallel_attention(q, k, v), expected)


def test_empty_batch_gives_an_empty_output():
    q = torch.zeros(0, HEADS, 4, DIM)
    shard = CPShard.build(CPSplit(1, 0), torch.zeros(0, dtype=torch.long), "cpu")
    assert context_parallel_attention(q, q[:, :KV_HEADS], q[:, :KV_HEADS], cp_shard=shard).shape == q.shape


def test_attention_rejects_bad_input():
    q = torch.randn(1, 4, 6, 8)
    _, shard = _shard_heads(q, 1, 0, torch.tensor([0, 2, 6]))
    with pytest.raises(ValueError, match="must divide"):
        context_parallel_attention(q, q[:, :3], q[:, :3], cp_shard=shard)
    with pytest.raises(ValueError, match="k, v"):
        context_parallel_attention(q, q[:, :2, :4], q[:, :2, :4], cp_shard=shard)
    with pytest.raises(ValueError, match="describes 6 local tokens"):
        context_parallel_attention(q[:, :, :4], q[:, :, :4], q[:, :, :4], cp_shard=shard)
    local, data_only = _shard_heads(q, 2, 1, torch.tensor([0, 2, 6]))  # a split over 2 ranks, no group
    with pytest.raises(ValueError, match="carries no CP group"):
        context_parallel_attention(local, local, local, cp_shard=data_only)


def _shard_with_another_group():
    layout = groups.initialize(tp=1, cp=2)
    q = torch.randn(1, 2, 4, 8)
    try:
        _shard_heads(q, 4, layout.cp_rank, None, layout.cp_group)
    except ValueError as error:
        return str(error)
    finally:
        groups.destroy()
    return None


def test_a_shard_and_a_cp_group_of_other_sizes_are_an_error_on_every_rank(world2):
    for message in world2.run(_shard_with_another_group):
        assert message is not None and "cp_group of 2 ranks" in message


_LONG_PACKED = """
import resource, torch
from lightning_cp.parallel import context_parallel_attention, shard_batch
total = 32768
cu = torch.tensor([0, 1, 4097, 8190, 12285, 16384, 20479, 24576, 28671, total])  # ~4K documents and one of 1
batch = shard_batch({"input_ids": torch.zeros(1, total, dtype=torch.long), "cu_seqlens": cu}, 1, 0)
g = torch.Generator().manual_seed(0)
local = batch["cp_shard"].local_tokens  # each document padded to an even length
q, k, v = (torch.randn(1, 1, local, 16, generator=g).requires_grad_() for _ in range(3))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = context_parallel_attention(q, k, v, cp_shard=batch["cp_shard"])
out.sum().backward()
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


def test_packed_attention_at_32k_local_tokens_builds_no_dense_mask():
    """A [T, T] boolean mask alone would be 1 GiB here (and the fp32 scores 8 GiB); the blocked kernel
    keeps one 64 MiB block of scores at a time."""
    result = subprocess.run(
        [sys.executable, "-c", _LONG_PACKED], check=False, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    growth = int(result.stdout.strip().splitlines()[-1])
    assert growth < 400 * 2**20, f"peak RSS grew {growth / 2**20:.0f} MiB"


@pytest.mark.gpu
def test_flash_varlen_path_on_cuda_matches_the_fp32_reference():
    """The FlashAttention-2 varlen path (bf16, CUDA, packed, cp = 1) against per-document SDPA in fp64."""
    cu = PACKED_CU * 40  # documents of 40 to 600 tokens, 1360 in all
    total = int(cu[-1])
    q, k, v, dout = _inputs(1, total)
    expected = _reference(q, k, v, dout, cu)
    layout = CPShard.build(CPSplit(1, 0), cu.diff(), "cuda")  # even lengths: no padding at cp = 1
    lq, lk, lv = (t.cuda().bfloat16().requires_grad_() for t in (q, k, v))
    out = context_parallel_attention(lq, lk, lv, cp_shard=layout)
    out.backward(dout.cuda().bfloat16())
    for got, want in zip((out, lq.grad, lk.grad, lv.grad), expected, strict=True):
        got = got.double().cpu()
        assert ((got - want).norm() / want.norm()).item() < 2e-2


@pytest.mark.gpu
def test_flash_and_torch_kernels_agree_on_cuda_for_every_piece_shape():
    """Pieces with fewer queries than keys (bottom-right causal), GQA: flash (bf16) vs the torch kernel (fp32)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    pieces = [(0, 64, 0, 64), (64, 192, 64, 448), (192, 193, 448, 1000)]
    cu_q = torch.tensor([0, 64, 192, 193], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 64, 448, 1000], dtype=torch.int32, device="cuda")
    q = torch.randn(193, 8, 64, device="cuda", generator=g)
    k, v = (torch.randn(1000, 2, 64, device="cuda", generator=g) for _ in range(2))
    dout = torch.randn(193, 8, 64, device="cuda", generator=g)
    out, lse = _varlen.torch_forward(q, k, v, pieces, 0.125)
    grads = _varlen.torch_backward(dout, q, k, v, out, lse, pieces, 0.125)
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    flash_out, flash_lse, rng = _varlen.flash_forward(qb, kb, vb, cu_q, cu_k, 128, 552, 0.125)
    flash_grads = _varlen.flash_backward(
        dout.bfloat16(), qb, kb, vb, flash_out, flash_lse, cu_q, cu_k, 128, 552, 0.125, rng
    )
    torch.testing.assert_close(flash_lse, lse, rtol=0, atol=2e-2)
    for got, want in zip((flash_out, *flash_grads), (out, *grads), strict=True):
        assert ((got.float() - want).norm() / want.norm()).item() < 2e-2


def _grads_and_future_warnings(reduce_scatter):
    """CP attention forward and backward (cp=2), recording every warning; ``reduce_scatter``: take the
    NCCL branch of the gradient exchange, the group's CPU backend named NCCL (gloo implements reduce-scatter
    too in torch 2.13)."""
    layout = groups.initialize(tp=1, cp=2)
    q, k, v, dout = _inputs(*PADDED_SHAPE)
    lq, shard = _shard_heads(q, 2, layout.cp_rank, None, layout.cp_group)
    lk, lv, ldout = (_shard_heads(t, 2, layout.cp_rank, None)[0] for t in (k, v, dout))
    lq, lk, lv = (t.requires_grad_() for t in (lq, lk, lv))
    get_backend = dist.get_backend
    if reduce_scatter:
        dist.get_backend = lambda group=None: "cpu:nccl"
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = context_parallel_attention(lq, lk, lv, cp_shard=shard)
            out.backward(ldout)
    finally:
        dist.get_backend = get_backend
    future = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    return future, lk.grad, lv.grad


def test_cp_attention_uses_no_deprecated_collective(world2):
    # torch 2.13 deprecates all_gather_into_tensor / reduce_scatter_tensor with a FutureWarning per call.
    gathered = world2.run(_grads_and_future_warnings, False)
    scattered = world2.run(_grads_and_future_warnings, True)
    for (future_ar, dk_ar, dv_ar), (future_rs, dk_rs, dv_rs) in zip(gathered, scattered):
        assert future_ar == [] and future_rs == []
        torch.testing.assert_close(dk_rs, dk_ar, rtol=1e-12, atol=1e-12)  # the same sums, either exchange
        torch.testing.assert_close(dv_rs, dv_ar, rtol=1e-12, atol=1e-12)
