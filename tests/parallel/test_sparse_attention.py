"""The indexer's top-k selection and the sparse attention over it, against whole sequences, on 4 gloo ranks.

The reference is independent of the code under test and computed as DeepSeek-V3.2's model does on each whole
sequence: the indexer's ``[S, S]`` scores in one matmul, the causal mask, ``topk``, a dense index mask, and
softmax attention under the combined mask (float64 for the attention).
"""

import pytest
import torch

from lightning_cp.parallel import CPShard, CPSplit, context_parallel_attention, groups, shard_batch, unshard
from lightning_cp.parallel.key_indexer import select_topk_keys, sequence_rows
from lightning_cp.parallel.sparse_attention import sparse_attention

HEADS, KV_HEADS, DIM, VALUE_DIM = 4, 2, 8, 6
INDEX_HEADS, INDEX_DIM, TOPK, INDEX_SCALE = 8, 8, 5, 0.35
PADDED_SHAPE = (2, 22)
# Documents of length 1, shorter and longer than TOPK, one longer than a chunk at every cp.
PACKED_CU = torch.tensor([0, 1, 10, 11, 26, 33, 34])


def _inputs(batch, total):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(batch, HEADS, total, DIM, generator=g, dtype=torch.float64)
    k = torch.randn(batch, KV_HEADS, total, DIM, generator=g, dtype=torch.float64)
    v = torch.randn(batch, KV_HEADS, total, VALUE_DIM, generator=g, dtype=torch.float64)
    dout = torch.randn(batch, HEADS, total, VALUE_DIM, generator=g, dtype=torch.float64)
    index_q = torch.randn(batch, total, INDEX_HEADS, INDEX_DIM, generator=g)
    index_w = torch.randn(batch, total, INDEX_HEADS, generator=g)
    index_k = torch.randn(batch, total, INDEX_DIM, generator=g)
    sinks = torch.randn(HEADS, generator=g, dtype=torch.float64)
    return q, k, v, dout, index_q, index_w, index_k, sinks


def _documents(batch, total, cu):
    if cu is None:
        return [(b, 0, total) for b in range(batch)]
    return [(0, a, b) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)]


def _reference(inputs, cu, with_sinks):
    """Per document: the model's dense selection, then attention under the index mask (with the sinks as one
    more softmax column without a value). Returns the outputs and gradients ``[B, H, S, ...]`` (and the sinks'
    gradient) and the selected keys (positions within each document, sorted)."""
    q, k, v, dout, index_q, index_w, index_k, sinks = inputs
    q, k, v, sinks = (t.clone().requires_grad_() for t in (q, k, v, sinks))
    group = HEADS // KV_HEADS
    outs, selections = torch.zeros_like(dout), {}
    for b, start, stop in _documents(q.shape[0], q.shape[2], cu):
        length = stop - start
        scores = torch.relu(
            torch.matmul(index_q[b, start:stop].float(), index_k[b, start:stop].T.float().unsqueeze(0))
            * INDEX_SCALE
        )  # [S, H, S]
        scores = torch.matmul(index_w[b, start:stop].unsqueeze(-2), scores).squeeze(-2)
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        top = scores.topk(min(TOPK, length), dim=-1).indices
        if length > TOPK:  # the queries with more keys than TOPK
            ranked = scores[TOPK:].sort(dim=-1, descending=True).values
            tied = ranked[:, TOPK - 1] == ranked[:, TOPK]
            assert not tied.any(), (
                "the draw ties at the TOPK-th score (ReLU zeros): the selection is ambiguous"
            )
        chosen = torch.zeros(length, length, dtype=torch.bool).scatter(-1, top, True) & causal
        for i in range(length):
            selections[(b, start + i)] = chosen[i].nonzero().flatten().tolist()
        keys = k[b, :, start:stop].repeat_interleave(group, 0)
        values = v[b, :, start:stop].repeat_interleave(group, 0)
        logits = torch.matmul(q[b, :, start:stop], keys.transpose(-1, -2)) * DIM**-0.5
        logits = logits.masked_fill(~chosen, float("-inf"))
        if with_sinks:
            column = sinks[:, None, None].expand(HEADS, length, 1)
            probabilities = torch.softmax(torch.cat([logits, column], dim=-1), -1)[..., :-1]
        else:
            probabilities = torch.softmax(logits, -1)
        outs[b, :, start:stop] = torch.matmul(probabilities, values)
    outs.backward(dout)
    grads = (q.grad, k.grad, v.grad) + ((sinks.grad,) if with_sinks else ())
    return (outs.detach(), *grads), selections


def _shard(x, cp, rank, cu, group=None):
    """Shard ``x`` ``[B, S, ...]`` along S in shard_batch's layout."""
    batch = {"input_ids": torch.zeros(x.shape[:2], dtype=torch.long), "x": x}
    if cu is not None:
        batch["cu_seqlens"] = cu
    shard = shard_batch(batch, cp, rank, cp_group=group)
    return shard["x"], shard["cp_shard"]


def _run(packed, with_sinks):
    cu = PACKED_CU if packed else None
    batch, total = (1, int(PACKED_CU[-1])) if packed else PADDED_SHAPE
    q, k, v, dout, index_q, index_w, index_k, sinks = _inputs(batch, total)
    results = {}
    for cp in (1, 2, 4):
        layout = groups.initialize(tp=1, cp=cp)
        rank = layout.cp_rank
        _, shard = _shard(index_k, cp, rank, cu, layout.cp_group)
        lq, lk, lv, ldout = (
            _shard(t.transpose(1, 2), cp, rank, cu)[0].transpose(1, 2) for t in (q, k, v, dout)
        )
        iq, iw, ik = (_shard(t, cp, rank, cu)[0].flatten(0, 1) for t in (index_q, index_w, index_k))
        selected = select_topk_keys(iq, iw, ik, shard, TOPK, INDEX_SCALE)
        lq, lk, lv = (t.requires_grad_() for t in (lq, lk, lv))
        local_sinks = sinks.clone().requires_grad_() if with_sinks else None
        out = sparse_attention(lq, lk, lv, selected.int(), shard, DIM**-0.5, local_sinks)
        out.backward(ldout)
        row, _ = sequence_rows(shard)
        sink_grad = local_sinks.grad if with_sinks else None
        results[cp] = (
            rank,
            out.detach(),
            lq.grad,
            lk.grad,
            lv.grad,
            selected,
            row,
            shard.sequence_lengths,
            sink_grad,
        )
        groups.destroy()
    return results


@pytest.mark.parametrize(
    ("packed", "with_sinks"), [(False, False), (True, True)], ids=["padded", "packed-sinks"]
)
def test_sparse_attention_matches_the_models_dense_selection_on_whole_sequences(world4, packed, with_sinks):
    cu = PACKED_CU if packed else None
    batch, total = (1, int(PACKED_CU[-1])) if packed else PADDED_SHAPE
    expected, selections = _reference(_inputs(batch, total), cu, with_sinks)
    per_rank = world4.run(_run, packed, with_sinks)
    for cp in (1, 2, 4):
        by_cp_rank = {}
        for results in per_rank:
            rank, *tensors = results[cp]
            by_cp_rank.setdefault(rank, tensors)
        for i, name in enumerate(("out", "dq", "dk", "dv")):
            shards = [by_cp_rank[r][i].transpose(1, 2) for r in range(cp)]
            full = unshard(shards, seq_len=None if packed else total, cu_seqlens=cu).transpose(1, 2)
            torch.testing.assert_close(full, expected[i], rtol=1e-6, atol=1e-7, msg=f"cp={cp} {name}")
        if with_sinks:  # each rank's share of the sinks' gradient, summed (what DDP's all-reduce does)
            total_grad = sum(by_cp_rank[r][7] for r in range(cp))
            torch.testing.assert_close(total_grad, expected[4], rtol=1e-6, atol=1e-7, msg=f"cp={cp} dsinks")
        _check_selections(by_cp_rank, cp, batch, total, cu, selections)


def _check_selections(by_cp_rank, cp, batch, total, cu, selections):
    """Every rank's selected rows, mapped back to document positions, are the reference's."""
    lengths = by_cp_rank[0][6]
    starts = torch.cumsum(lengths, 0) - lengths
    docs = _documents(batch, total, cu)
    for rank in range(cp):
        selected, rows = by_cp_rank[rank][4], by_cp_rank[rank][5]
        for token, row in enumerate(rows.tolist()):
            sequence = int(torch.searchsorted(starts, row, right=True)) - 1
            b, start, stop = docs[sequence]
            offset = row - int(starts[sequence])
            if offset >= stop - start:
                continue  # padding CP added
            chosen = sorted(int(r) - int(starts[sequence]) for r in selected[token] if r >= 0)
            assert chosen == selections[(b, start + offset)], f"cp={cp} rank {rank} token {token}"


def test_a_running_top_k_over_many_key_blocks_is_each_document_s_dense_top_k(monkeypatch):
    """Score blocks of 4 queries by 4 keys (``SCORE_BLOCK_BYTES`` shrunk): a query's keys span up to 8 key
    blocks, and the candidates kept from the earlier blocks compete with each later one's. The selection is
    the model's dense top-k of each packed document (cp = 1)."""
    monkeypatch.setattr("lightning_cp.parallel.key_indexer.SCORE_BLOCK_BYTES", 4 * INDEX_HEADS * 4 * 4)
    cu = PACKED_CU * 2  # documents of 2 to 30 tokens
    total = int(cu[-1])
    inputs = _inputs(1, total)
    _, selections = _reference(inputs, cu, with_sinks=False)
    index_q, index_w, index_k = (t[0] for t in inputs[4:7])
    shard = CPShard.build(CPSplit(1, 0), cu.diff(), "cpu")
    selected = select_topk_keys(index_q, index_w, index_k, shard, TOPK, INDEX_SCALE)
    row, _ = sequence_rows(shard)
    _check_selections({0: [None] * 4 + [selected, row, shard.sequence_lengths]}, 1, 1, total, cu, selections)


@pytest.mark.gpu
def test_on_cuda_in_bf16_the_selection_is_the_cpu_s_and_the_attention_the_fp64_reference():
    """The CUDA path (cp = 1, packed, bf16 q / k / v, fp32 indexer inputs): the same selected keys as the CPU, and
    outputs and gradients within bf16's error of the float64 reference."""
    cu = PACKED_CU * 8  # documents of 8 to 120 tokens
    total = int(cu[-1])
    inputs = _inputs(1, total)
    expected, _ = _reference(inputs, cu, with_sinks=False)
    q, k, v, dout, index_q, index_w, index_k, _ = inputs
    shard = CPShard.build(CPSplit(1, 0), cu.diff(), "cuda")
    flat = [t.flatten(0, 1) for t in (index_q, index_w, index_k)]
    on_cpu = select_topk_keys(*flat, CPShard.build(CPSplit(1, 0), cu.diff(), "cpu"), TOPK, INDEX_SCALE)
    selected = select_topk_keys(*(t.cuda() for t in flat), shard, TOPK, INDEX_SCALE)
    assert torch.equal(selected.cpu(), on_cpu)
    lq, lk, lv = (t.cuda().bfloat16().requires_grad_() for t in (q, k, v))
    out = context_parallel_attention(lq, lk, lv, cp_shard=shard, selected=selected.int())
    out.backward(dout.cuda().bfloat16())
    for got, want in zip((out, lq.grad, lk.grad, lv.grad), expected, strict=True):
        got = got.double().cpu()
        assert ((got - want).norm() / want.norm()).item() < 2e-2
