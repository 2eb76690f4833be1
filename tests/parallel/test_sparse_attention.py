"""The indexer's top-k selection and the sparse attention over it, against whole sequences, on 4 gloo ranks.

The reference is independent of the code under test and computed as DeepSeek-V3.2's model does on each whole
sequence: the indexer's ``[S, S]`` scores in one matmul, the causal mask, ``topk``, a dense index mask, and
softmax attention under the combined mask (float64 for the attention).
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_cp.parallel import (
    CPShard,
    CPSplit,
    context_parallel_attention,
    groups,
    key_indexer,
    shard_batch,
    unshard,
)
from lightning_cp.parallel.key_indexer import (
    indexer_scores,
    key_block_tokens,
    query_block_tokens,
    select_topk_keys,
    sequence_rows,
)
from lightning_cp.parallel.sparse_attention import sparse_attention
from tests.ops.test_triton import _cases_env

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


def test_blocks_of_queries_over_steps_of_keys_select_each_document_s_dense_top_k(monkeypatch):
    """``SCORE_BLOCK_BYTES`` shrunk to 4 queries' scores over the 68 keys: blocks of 4 queries (some spanning two
    documents), each scored 8 keys a step by the torch path, whose top-k is taken over the block's whole span at
    once. The selection is the model's dense top-k of each packed document (cp = 1)."""
    monkeypatch.setattr("lightning_cp.parallel.key_indexer.SCORE_BLOCK_BYTES", 4 * 4 * 68)
    assert (query_block_tokens(68), key_block_tokens(4, INDEX_HEADS)) == (4, 8)
    cu = PACKED_CU * 2  # documents of 2 to 30 tokens
    total = int(cu[-1])
    inputs = _inputs(1, total)
    _, selections = _reference(inputs, cu, with_sinks=False)
    index_q, index_w, index_k = (t[0] for t in inputs[4:7])
    shard = CPShard.build(CPSplit(1, 0), cu.diff(), "cpu")
    selected = select_topk_keys(index_q, index_w, index_k, shard, TOPK, INDEX_SCALE)
    row, _ = sequence_rows(shard)
    _check_selections({0: [None] * 4 + [selected, row, shard.sequence_lengths]}, 1, 1, total, cu, selections)


def _score_inputs(dtype=torch.float32, grid=None):
    """A block of 45 queries (3 heads of 24 dims) over 150 keys: queries 0-19 see keys 0 .. 40-59 of a first
    document, 20-44 keys 70 .. 100-124 of a second. ``grid``: values on a grid of 1/8 in [-1, 1), whose
    products and sums are exact in fp32 (so a rounding is the only difference)."""
    g = torch.Generator().manual_seed(3)
    draw = (
        (lambda *shape: torch.randn(*shape, generator=g))
        if grid is None
        else (lambda *shape: torch.randint(-8, 8, shape, generator=g) / 8)
    )
    q, w, k = draw(45, 3, 24).to(dtype), draw(45, 3).to(dtype), draw(150, 24).to(dtype)
    first = torch.tensor([0] * 20 + [70] * 25)
    last = torch.cat([torch.arange(40, 60), torch.arange(100, 125)])
    return q, w, k, first, last


def _scores_reference(q, w, k, first, last, scale):
    """fp64: ``sum_h w relu(scale q . k)``, ``-inf`` outside ``first .. last``."""
    products = torch.relu(torch.einsum("bhd,kd->bhk", q.double(), k.double()) * scale)
    scores = torch.einsum("bh,bhk->bk", w.double(), products)
    rows = torch.arange(k.shape[0])
    return scores.masked_fill((rows < first[:, None]) | (rows > last[:, None]), float("-inf"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_indexer_scores_are_the_fp64_scores_of_their_inputs(dtype, monkeypatch):
    """In fp32, and for bf16 queries and keys (each product exact in fp32, the sum fp32 as the models' matmul of
    upcast copies: no score rounded to bf16, which would be 0.4% off), in steps of 16 keys."""
    monkeypatch.setattr("lightning_cp.parallel.key_indexer.SCORE_BLOCK_BYTES", 4 * 3 * 45 * 16)
    assert key_block_tokens(45, 3) == 16
    q, w, k, first, last = _score_inputs(dtype)
    got = indexer_scores(q, w.float(), k, first, last, INDEX_SCALE, None)
    want = _scores_reference(q, w.float(), k, first, last, INDEX_SCALE)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_under_autocast_the_scores_are_rounded_as_the_models_autocast_matmuls_round_them():
    """The models' scores under CPU autocast (bf16: ``matmul(q.float(), k.float())`` cast to bf16 and rounded,
    scaled and rounded, the weighted sum rounded) on a grid where only those roundings differ from fp32: equal
    to the last bit, and no longer equal without the rounding."""
    q, w, k, first, last = _score_inputs(grid=True)
    with torch.autocast("cpu", torch.bfloat16):
        products = torch.relu(torch.matmul(q.float(), k.float().T.unsqueeze(0)) * INDEX_SCALE)
        model = torch.matmul(w.float().unsqueeze(1), products).squeeze(1).float()
    mask = (torch.arange(150) < first[:, None]) | (torch.arange(150) > last[:, None])
    model = model.masked_fill(mask, float("-inf"))
    args = (q.bfloat16(), w.bfloat16(), k.bfloat16(), first, last, INDEX_SCALE)
    assert torch.equal(indexer_scores(*args, torch.bfloat16), model)
    assert not torch.equal(indexer_scores(*args, None), model)


def test_under_autocast_the_selection_scores_autocast_s_dtype_and_rounds_as_it(monkeypatch):
    """fp32 indexer inputs under bf16 autocast (the models' norm and rotary leave them fp32): the keys are
    gathered and scored in bf16, the scores rounded as the models' autocast matmuls round them; without
    autocast, no rounding, and bf16 queries beside fp32 keys both fp32 (the models' matmul of upcast copies),
    both bf16 kept bf16."""
    calls = []

    def recorded(queries, weights, keys, first, last, scale, rounding):
        calls.append((queries.dtype, weights.dtype, keys.dtype, rounding))
        return scores_of(queries, weights, keys, first, last, scale, rounding)

    scores_of = key_indexer.indexer_scores
    monkeypatch.setattr(key_indexer, "indexer_scores", recorded)
    index_q, index_w, index_k = (t[0] for t in _inputs(1, 12)[4:7])
    shard = CPShard.build(CPSplit(1, 0), torch.tensor([12]), "cpu")
    with torch.autocast("cpu", torch.bfloat16):
        select_topk_keys(index_q, index_w, index_k, shard, TOPK, INDEX_SCALE)
    select_topk_keys(index_q, index_w, index_k, shard, TOPK, INDEX_SCALE)
    select_topk_keys(index_q.bfloat16(), index_w, index_k, shard, TOPK, INDEX_SCALE)
    select_topk_keys(index_q.bfloat16(), index_w, index_k.bfloat16(), shard, TOPK, INDEX_SCALE)
    fp32 = (torch.float32,) * 3 + (None,)
    assert calls == [(torch.bfloat16,) * 4, fp32, fp32, (torch.bfloat16, torch.float32, torch.bfloat16, None)]


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


TRITON_CASES = Path(__file__).with_name("_sparse_triton_cases.py")

# The kernel on its own: a selection drawn per query (a random subset of its document's earlier keys, some
# with fewer keys than KERNEL_TOPK, the -1 entries interleaved), against SDPA under the selection as a mask.
KERNEL_TOPK = 6
FORMS = {"expanded": (HEADS, KV_HEADS), "latent": (HEADS, 1)}
"""Query and key/value heads: grouped heads with values of their own, or one key shared by every query head
whose first VALUE_DIM columns are the values (MLA's absorbed form, ``v=None``)."""


def _kernel_inputs(form, batch, total):
    g = torch.Generator().manual_seed(2)
    heads, kv_heads = FORMS[form]
    q = torch.randn(batch, heads, total, DIM, generator=g)
    k = torch.randn(batch, kv_heads, total, DIM, generator=g)
    v = torch.randn(batch, kv_heads, total, VALUE_DIM, generator=g) if form == "expanded" else None
    dout = torch.randn(batch, heads, total, VALUE_DIM, generator=g)
    return q, k, v, dout, torch.randn(heads, generator=g)


def _kernel_selection(length):
    """``[length, KERNEL_TOPK]`` positions within a document, ``-1`` for none, in a random order: query ``p``
    selects ``min(KERNEL_TOPK, p + 1)`` of its earlier keys, one fewer for every third query."""
    g = torch.Generator().manual_seed(length)
    chosen = torch.full((length, KERNEL_TOPK), -1)
    for p in range(length):
        count = min(KERNEL_TOPK, p + 1) - (p % 3 == 2)
        slots = torch.randperm(KERNEL_TOPK, generator=g)[:count]
        chosen[p, slots] = torch.randperm(p + 1, generator=g)[:count]
    return chosen


def _kernel_reference(inputs, cu, with_sinks):
    q, k, v, dout, sinks = (
        None if t is None else t.clone().requires_grad_() for t in _kernel_inputs(*inputs)
    )
    outs = torch.zeros_like(dout)
    group = q.shape[1] // k.shape[1]
    for b, start, stop in _documents(q.shape[0], q.shape[2], cu):
        length = stop - start
        keys = k[b, :, start:stop].repeat_interleave(group, 0)
        values = keys[..., :VALUE_DIM] if v is None else v[b, :, start:stop].repeat_interleave(group, 0)
        chosen = _kernel_selection(length)
        mask = torch.zeros(length, length + 1, dtype=torch.bool)
        mask.scatter_(1, chosen.clamp(min=0) + (chosen < 0) * length, True)  # -1 into the spare column
        bias = torch.zeros(q.shape[1], length, length).masked_fill(~mask[:, :length], float("-inf"))
        if with_sinks:  # one more key of zeros whose logit is the sink, with a zero value
            bias = torch.cat([bias, sinks[:, None, None].expand(-1, length, 1)], -1)
            keys = torch.cat([keys, keys.new_zeros(keys.shape[0], 1, DIM)], 1)
            values = torch.cat([values, values.new_zeros(values.shape[0], 1, VALUE_DIM)], 1)
        outs[b, :, start:stop] = torch.nn.functional.scaled_dot_product_attention(
            q[b, :, start:stop], keys, values, attn_mask=bias, scale=DIM**-0.5
        )
    outs.backward(dout)
    return outs.detach(), q.grad, k.grad, None if v is None else v.grad, sinks.grad if with_sinks else None


def _local_selection(shard, docs):
    """Each local query's ``_kernel_selection`` as rows in sequence order; CP's padding selects its own row."""
    row, first = sequence_rows(shard)
    lengths = shard.sequence_lengths
    sequence = torch.searchsorted(torch.cumsum(lengths, 0) - lengths, row, right=True) - 1
    selections = [_kernel_selection(stop - start) for _, start, stop in docs]
    selected = torch.full((row.numel(), KERNEL_TOPK), -1, dtype=torch.int32)
    for token, (r, f, s) in enumerate(zip(row.tolist(), first.tolist(), sequence.tolist(), strict=True)):
        if r - f < len(selections[s]):
            chosen = selections[s][r - f]
            selected[token] = torch.where(chosen >= 0, chosen + f, -1)
        else:
            selected[token, 0] = r
    return selected


def _kernel_run(form, packed, with_sinks, block):
    """On every rank of world2, at cp 1 and 2: the kernel's outputs and gradients of this rank's tokens, with
    blocks of ``block`` queries and one key/value head when given (else the module's own)."""
    from lightning_cp.parallel import sparse_attention as kernel

    saved = kernel.MIN_BLOCK_QUERIES, kernel.SELECTED_BLOCK_BYTES
    if block is not None:
        kernel.MIN_BLOCK_QUERIES, kernel.SELECTED_BLOCK_BYTES = block, 1
    cu = PACKED_CU if packed else None
    batch, total = (1, int(PACKED_CU[-1])) if packed else PADDED_SHAPE
    q, k, v, dout, sinks = _kernel_inputs(form, batch, total)
    results = {}
    try:
        for cp in (1, 2):
            layout = groups.initialize(tp=1, cp=cp)
            rank = layout.cp_rank
            local = [
                None if t is None else _shard(t.transpose(1, 2), cp, rank, cu, layout.cp_group)
                for t in (q, k, v, dout)
            ]
            shard = local[0][1]
            lq, lk, lv, ldout = (None if t is None else t[0].transpose(1, 2) for t in local)
            leaves = [t.requires_grad_() for t in (lq, lk, lv) if t is not None]
            local_sinks = sinks.clone().requires_grad_() if with_sinks else None
            selected = _local_selection(shard, _documents(batch, total, cu))
            value_dim = VALUE_DIM if lv is None else None
            out = sparse_attention(lq, lk, lv, selected, shard, DIM**-0.5, local_sinks, value_dim=value_dim)
            out.backward(ldout)
            grads = [t.grad for t in leaves] + ([None] if lv is None else [])
            results[cp] = (rank, out.detach(), *grads, local_sinks.grad if with_sinks else None)
            groups.destroy()
    finally:
        kernel.MIN_BLOCK_QUERIES, kernel.SELECTED_BLOCK_BYTES = saved
    return results


@pytest.mark.parametrize(
    ("form", "packed", "with_sinks", "block"),
    [
        ("expanded", False, False, 3),
        ("expanded", True, True, None),
        ("latent", True, False, 4),
        ("latent", False, True, None),
    ],
    ids=["expanded-padded-blocks-of-3", "expanded-packed-sinks", "latent-packed-blocks-of-4", "latent-sinks"],
)
def test_the_kernel_matches_sdpa_under_the_selection_as_a_mask(world2, form, packed, with_sinks, block):
    """Blocks of a few queries (the last one short) and one key/value head each, or the module's (one block):
    outputs and every gradient within fp32's error of the reference, at cp 1 and 2. With ``v=None`` the keys'
    gradient carries the values'."""
    cu = PACKED_CU if packed else None
    batch, total = (1, int(PACKED_CU[-1])) if packed else PADDED_SHAPE
    expected = _kernel_reference((form, batch, total), cu, with_sinks)
    per_rank = world2.run(_kernel_run, form, packed, with_sinks, block)
    for cp in (1, 2):
        by_cp_rank = {}
        for results in per_rank:
            rank, *tensors = results[cp]
            by_cp_rank.setdefault(rank, tensors)
        for i, name in enumerate(("out", "dq", "dk", "dv")):
            if expected[i] is None:
                continue
            shards = [by_cp_rank[r][i].transpose(1, 2) for r in range(cp)]
            full = unshard(shards, seq_len=None if packed else total, cu_seqlens=cu).transpose(1, 2)
            torch.testing.assert_close(full, expected[i], rtol=1e-5, atol=1e-5, msg=f"cp={cp} {name}")
        if with_sinks:
            total_grad = sum(by_cp_rank[r][4] for r in range(cp))
            torch.testing.assert_close(total_grad, expected[4], rtol=1e-5, atol=1e-5, msg=f"cp={cp} dsinks")


def test_the_values_are_v_or_the_keys_columns_named_by_value_dim():
    q, k = torch.zeros(1, 2, 4, 8), torch.zeros(1, 1, 4, 8)
    shard = CPShard.build(CPSplit(1, 0), torch.tensor([4]), "cpu")
    selected = torch.zeros(4, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"v=None with value_dim.*value_dim=None"):
        sparse_attention(q, k, None, selected, shard, 1.0)
    with pytest.raises(ValueError, match=r"value_dim=9 must be in 1..8"):
        sparse_attention(q, k, None, selected, shard, 1.0, value_dim=9)
    with pytest.raises(ValueError, match=r"got v=\(1, 1, 4, 8\) and value_dim=8"):
        sparse_attention(q, k, k, selected, shard, 1.0, value_dim=8)


@pytest.mark.parametrize(
    "interpret", [True, pytest.param(False, marks=pytest.mark.gpu)], ids=["interpreter", "cuda"]
)
def test_the_triton_kernels_match_sdpa(interpret):
    """``_sparse_triton_cases.py`` in a fresh process: in Triton's interpreter on CPU tensors (the variable must
    be set before Triton is first imported), or compiled on a GPU."""
    pytest.importorskip("triton")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(TRITON_CASES)],
        check=False,
        cwd=TRITON_CASES.resolve().parents[2],
        env=_cases_env(interpret=interpret),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"Triton cases failed:\n{result.stdout[-8000:]}\n{result.stderr[-4000:]}"
