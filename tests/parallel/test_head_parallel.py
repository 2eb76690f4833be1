"""The head-parallel exchange against the whole sequences, on real gloo groups of 2 and 4 ranks.

References are built from the full batch without the code under test: each sequence of the original
layout padded with zeros to its ``2 * cp`` chunks (what a rank must receive), and the upstream gradient
sharded by ``shard_batch``'s own gather (what each rank must get back).
"""

import pytest
import torch

from lightning_cp.parallel import groups, shard_batch
from lightning_cp.parallel.head_parallel import (
    for_each_sequence,
    head_slices,
    shared_heads,
    to_heads,
    to_tokens,
)
from lightning_cp.parallel.split import CPSplit

HEADS, DIM = 4, 3
PADDED = (2, 22)  # B, S: padded to 24 at cp = 4, 24 at cp = 2
PACKED = (1, 9, 1, 13, 6)  # documents of length 1, odd lengths: every split pads


def _batch(packed: bool) -> dict:
    g = torch.Generator().manual_seed(0)
    rows, total = (1, sum(PACKED)) if packed else PADDED
    batch = {
        "input_ids": torch.zeros(rows, total, dtype=torch.long),
        "x": torch.randn(rows, total, HEADS, DIM, generator=g, dtype=torch.float64),
        "w": torch.randn(rows, total, HEADS, DIM, generator=g, dtype=torch.float64),
    }
    if packed:
        batch["cu_seqlens"] = torch.tensor([0, *torch.tensor(PACKED).cumsum(0).tolist()])
    return batch


def _sequences(batch: dict, name: str, cp: int) -> torch.Tensor:
    """``[T_seq, H, D]``: every sequence of ``batch[name]`` in order, padded with zeros to ``2 * cp`` chunks."""
    value = batch[name]
    if "cu_seqlens" in batch:
        pieces = list(value[0].split(PACKED))
    else:
        pieces = list(value)
    out = []
    for piece in pieces:
        padded = -(-len(piece) // (2 * cp)) * 2 * cp
        out.append(torch.cat([piece, piece.new_zeros(padded - len(piece), *piece.shape[1:])]))
    return torch.cat(out)


def _exchange(cp: int, packed: bool, shared: int | None):
    layout = groups.initialize(tp=1, cp=cp)
    shard = shard_batch(_batch(packed), cp, layout.cp_rank, cp_group=layout.cp_group)
    x = shard["x"].flatten(0, 1).clone().requires_grad_()  # [T_local, H, D]
    slices = head_slices(HEADS, cp)
    heads = slices if shared is None else shared_heads(slices, HEADS, shared)
    # Two dtypes in one exchange (a layer's fp32 decay beside its values): each comes back as it went.
    out, single = to_heads(shard["cp_shard"], (x, heads), (x.detach().float(), slices[:, :1]))
    assert single.dtype == torch.float32 and torch.equal(
        single, _sequences(_batch(packed), "x", cp)[:, slices[layout.cp_rank, :1]].float()
    )
    full_w = _sequences(_batch(packed), "w", cp)
    (out * full_w[:, heads[layout.cp_rank]]).sum().backward()
    back = to_tokens(shard["cp_shard"], to_heads(shard["cp_shard"], (x, slices))[0])
    return layout.cp_rank, heads[layout.cp_rank], out.detach(), x.grad, back.detach(), x.detach()


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize(
    ("cp", "shared"), [(2, None), (4, None), (4, 2), (2, 1)], ids=["cp2", "cp4", "cp4-shared2", "cp2-shared1"]
)
def test_each_rank_gets_every_token_of_its_heads_and_the_gradients_come_back_summed(
    world4, cp, packed, shared
):
    batch = _batch(packed)
    expected_x = _sequences(batch, "x", cp)
    for rank, heads, out, grad, back, x in world4.run(_exchange, cp, packed, shared):
        torch.testing.assert_close(out, expected_x[:, heads], rtol=0, atol=0)
        torch.testing.assert_close(back, x, rtol=0, atol=0)  # to_tokens inverts to_heads
        # d/dx of sum over ranks of <out_r, w[:, heads_r]>: each head's w summed over the ranks that took it.
        every_rank = (
            head_slices(HEADS, cp) if shared is None else shared_heads(head_slices(HEADS, cp), HEADS, shared)
        )
        taken = torch.bincount(every_rank.flatten(), minlength=HEADS).double()
        weight = {**batch, "w": batch["w"] * taken[:, None]}
        expected_grad = shard_batch(weight, cp, rank)["w"].flatten(0, 1)
        torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-12)


def test_the_sequence_order_is_a_loop_over_chunks():
    """Every token of the padded sequences in order, found among the ranks' local tokens by a plain loop."""
    for cp in (1, 2, 3, 4):
        chunks = torch.tensor([1, 3, 2])
        local = int(2 * chunks.sum())
        expected = []
        for i, c in enumerate(chunks.tolist()):
            start = 2 * int(chunks[:i].sum())
            for g in range(2 * cp):
                rank, slot = (g, 0) if g < cp else (2 * cp - 1 - g, 1)
                expected += [rank * local + start + slot * c + j for j in range(c)]
        for rank in range(cp):
            assert CPSplit(cp, rank).sequence_order(chunks).tolist() == expected


def test_each_sequence_runs_alone():
    """A running sum (a state carried along the sequence) restarts at every packed document."""
    batch = shard_batch(
        {
            "input_ids": torch.zeros(1, sum(PACKED), dtype=torch.long),
            "cu_seqlens": torch.tensor([0, 1, 10, 11, 24, 30]),
        },
        1,
        0,
    )
    values = torch.arange(1.0, sum(PACKED) + 7)[: batch["cp_shard"].local_tokens]
    calls = []

    def running_sum(x):
        calls.append(tuple(x.shape))
        return x.cumsum(1)

    got = for_each_sequence(batch["cp_shard"], running_sum, values)
    lengths = batch["cp_shard"].sequence_lengths.tolist()  # each document padded to an even length
    assert got.tolist() == torch.cat([piece.cumsum(0) for piece in values.split(lengths)]).tolist()
    assert sorted(calls) == [(1, 6), (1, 10), (1, 14), (2, 2)]  # documents of one length run together


@pytest.mark.parametrize(("heads", "cp", "match"), [(6, 4, "heads=6 is not divisible by cp=4")])
def test_heads_that_do_not_divide_are_refused_with_the_numbers(heads, cp, match):
    with pytest.raises(ValueError, match=match):
        head_slices(heads, cp)
    with pytest.raises(ValueError, match="key heads=3 for 8 heads"):
        shared_heads(head_slices(8, 2), 8, 3, "key heads")
