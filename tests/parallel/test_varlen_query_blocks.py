"""The CPU attention kernel when a piece's queries span several blocks of scores.

The blocked torch kernel (``parallel/_varlen.py``) walks each piece's queries in blocks whose
``[heads, block, keys]`` scores fit ``SCORE_BLOCK_BYTES`` (64 MiB): at test sizes one block holds a
whole piece, so the blocks' key gradients are never summed. Here the budget is shrunk so that every piece
spans several blocks, the last one ragged. The reference is ``scaled_dot_product_attention`` on each
whole sequence (causal, K/V heads repeated by hand), in float64.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from lightning_cp.parallel import _varlen, context_parallel_attention, groups, shard_batch

HEADS, KV_HEADS, DIM = 4, 2, 8
SCALE = DIM**-0.5
BUDGET_BYTES = 4 * HEADS * 48
"""fp32 scores of 48 (query, key) pairs per head: blocks of 3 queries against 16 keys, of 2 against 20."""


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor) -> list[torch.Tensor]:
    """Causal SDPA of ``[T, H, D]`` sequences: output and ``(dq, dk, dv)`` for the upstream ``dout``."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    heads_first = [
        t.transpose(0, 1)[None] for t in (q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))
    ]
    out = F.scaled_dot_product_attention(*heads_first, is_causal=True)[0].transpose(0, 1)
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


def _blocks_per_piece(pieces: _varlen.Pieces) -> list[int]:
    blocks = _varlen._blocks(pieces, HEADS)
    return [sum(q0 <= b[0] < q1 for b in blocks) for q0, q1, _, _ in pieces]


def test_torch_kernel_matches_sdpa_when_pieces_span_several_query_blocks(monkeypatch):
    monkeypatch.setattr(_varlen, "SCORE_BLOCK_BYTES", BUDGET_BYTES)
    g = torch.Generator().manual_seed(0)
    # (queries, keys) of each piece: its queries are the last ones of a sequence of `keys` tokens, as for
    # a CP chunk (bottom-right causal); the first piece is a whole sequence.
    shapes = [(10, 10), (7, 16), (13, 20)]
    sequences = []
    for lq, lk in shapes:
        q, k, v, dout = (
            torch.randn(lk, h, DIM, generator=g, dtype=torch.float64)
            for h in (HEADS, KV_HEADS, KV_HEADS, HEADS)
        )
        dout[: lk - lq] = 0.0  # queries before the piece's: not in the problem, no gradient from them
        sequences.append((lq, q, k, v, dout))
    q = torch.cat([s[1][-s[0] :] for s in sequences])
    k, v = (torch.cat([s[i] for s in sequences]) for i in (2, 3))
    dout = torch.cat([s[4][-s[0] :] for s in sequences])
    cu_q, cu_k = ([0, *itertools.accumulate(n)] for n in zip(*shapes))
    pieces = [(*qs, *ks) for qs, ks in zip(itertools.pairwise(cu_q), itertools.pairwise(cu_k))]
    assert min(_blocks_per_piece(pieces)) >= 3

    out, lse = _varlen.torch_forward(q, k, v, pieces, SCALE)
    grads = _varlen.torch_backward(dout, q, k, v, out, lse, pieces, SCALE)

    expected = [(lq, _sdpa(*tensors)) for lq, *tensors in sequences]
    want = [
        torch.cat([e[0][-lq:] for lq, e in expected]),  # the outputs and dQ of the piece's own queries
        torch.cat([e[1][-lq:] for lq, e in expected]),
        torch.cat([e[2] for _, e in expected]),
        torch.cat([e[3] for _, e in expected]),
    ]
    for name, got, reference in zip(("out", "dq", "dk", "dv"), (out, *grads), want, strict=True):
        torch.testing.assert_close(got, reference, rtol=1e-10, atol=1e-10, msg=name)


DOCS = [8, 20, 12]
"""Packed document lengths, multiples of 2 * cp = 4 (no padding); the longest spans more than a chunk."""


def _packed(tensors: dict[str, torch.Tensor], cp_rank: int, group=None) -> dict[str, torch.Tensor]:
    """``shard_batch`` of the packed documents ``DOCS`` with the ``[1, T, heads, D]`` ``tensors``, at cp = 2."""
    total = sum(DOCS)
    cu = torch.tensor([0, *itertools.accumulate(DOCS)])
    batch = {"input_ids": torch.zeros(1, total, dtype=torch.long), "cu_seqlens": cu, **tensors}
    return shard_batch(batch, 2, cp_rank, cp_group=group)


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    heads = {"q": HEADS, "k": KV_HEADS, "v": KV_HEADS, "dout": HEADS}
    return {
        name: torch.randn(1, sum(DOCS), h, DIM, generator=g, dtype=torch.float64) for name, h in heads.items()
    }


def _cp_attention_with_a_small_budget() -> list[torch.Tensor]:
    """This rank's output and dQ, dK, dV at cp = 2, with one query per block of scores."""
    layout = groups.initialize(tp=1, cp=2)
    batch = _packed(_inputs(), layout.cp_rank, layout.cp_group)
    q, k, v = (batch[name].transpose(1, 2).contiguous().requires_grad_() for name in ("q", "k", "v"))
    budget = _varlen.SCORE_BLOCK_BYTES
    _varlen.SCORE_BLOCK_BYTES = 4 * HEADS  # one query per block: every piece of 2 or more spans several
    try:
        out = context_parallel_attention(q, k, v, cp_shard=batch["cp_shard"])
        out.backward(batch["dout"].transpose(1, 2))
    finally:
        _varlen.SCORE_BLOCK_BYTES = budget
    return [t.detach().transpose(1, 2) for t in (out, q.grad, k.grad, v.grad)]


def _reference_shards(cp_rank: int) -> list[torch.Tensor]:
    """SDPA on every whole document of the packed sequence, then cut as rank ``cp_rank`` of 2 holds it."""
    inputs = _inputs()
    bounds = [0, *itertools.accumulate(DOCS)]
    per_doc = [
        _sdpa(*(inputs[n][0, a:b] for n in ("q", "k", "v", "dout"))) for a, b in itertools.pairwise(bounds)
    ]
    names = ("out", "dq", "dk", "dv")
    batch = _packed({name: torch.cat([d[i] for d in per_doc])[None] for i, name in enumerate(names)}, cp_rank)
    return [batch[name] for name in names]


def test_cp_attention_matches_sdpa_when_pieces_span_several_query_blocks(world2):
    per_rank = world2.run(_cp_attention_with_a_small_budget)
    for cp_rank, got in enumerate(per_rank):
        for name, value, reference in zip(
            ("out", "dq", "dk", "dv"), got, _reference_shards(cp_rank), strict=True
        ):
            torch.testing.assert_close(
                value, reference, rtol=1e-10, atol=1e-10, msg=f"cp rank {cp_rank} {name}"
            )
