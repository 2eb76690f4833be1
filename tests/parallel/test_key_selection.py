"""The keys CP attention selects for every query piece (``shard_keys``), causal and with a sliding window.

The reference is a plain loop over every query of a piece: the keys of its padded sequence it may see by
the definition (``p - window < j <= p``), never the index arithmetic under test.
"""

import itertools

import pytest
import torch

from lightning_cp.parallel import CPShard, CPSplit, shard_batch
from lightning_cp.parallel._key_selection import select_row_keys, shard_keys


def _expected_piece_keys(lengths, cp, rank, window):
    """For every piece in local order: the 1-based global ids of the keys its queries see (0 for padding),
    in sequence order; and how many distinct keys all pieces see. A piece is a kept chunk of a sequence
    (without CP, the two chunks are the whole sequence, all local: one piece)."""
    pieces, distinct, start = [], 0, 0
    for length in lengths:
        c = -(-length // (2 * cp))
        ids = [start + t + 1 if t < length else 0 for t in range(2 * cp * c)]
        chunks = [range(2 * c)] if cp == 1 else [range(g * c, (g + 1) * c) for g in (rank, 2 * cp - 1 - rank)]
        union = set()
        for queries in chunks:
            seen = {j for p in queries for j in range(p + 1) if window is None or j > p - window}
            pieces.append([ids[j] for j in sorted(seen)])
            union |= seen
        distinct += len(union)
        start += length
    return pieces, distinct


@pytest.mark.parametrize("window", [None, 1, 2, 5, 13], ids=lambda w: f"window{w}")
@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_cp_shard_finds_every_key_of_every_piece(cp, packed, window):
    # Chunks of 1 to 6 tokens: windows inside one chunk, across several, and longer than a document.
    lengths = [5, 1, 9, 8, 3, 41] if packed else [11, 11]
    rows, total = (1, sum(lengths)) if packed else (len(lengths), lengths[0])
    batch = {"input_ids": torch.zeros(rows, total, dtype=torch.long)}
    batch["token_id"] = torch.arange(1, rows * total + 1).view(rows, total)
    if packed:
        batch["cu_seqlens"] = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    shards = [shard_batch(batch, cp, r) for r in range(cp)]
    gathered = torch.cat([s["token_id"].flatten() for s in shards])  # all_gather order: rank-major
    for rank, shard in enumerate(shards):
        layout = shard["cp_shard"]
        selection = shard_keys(layout, window)
        expected, distinct = _expected_piece_keys(lengths if packed else [total] * rows, cp, rank, window)
        local = shard["token_id"].flatten().tolist()
        ordered = gathered.tolist() if selection.order is None else gathered[selection.order].tolist()
        assert [ordered[k0:k1] for _, _, k0, k1 in selection.pieces] == expected
        pieces = [local[q0:q1] for q0, q1, _, _ in selection.pieces]
        # Each piece's queries are the last keys of its key range (bottom-right causal alignment).
        assert all(keys_of[len(keys_of) - len(q) :] == q for keys_of, q in zip(expected, pieces))
        # Sequence order holds every key the pieces read exactly once: no key is copied per piece.
        if selection.order is not None:
            assert len(set(selection.order.tolist())) == selection.num_keys
        assert selection.num_keys == distinct
        assert selection.gathered_tokens == len(gathered)
        # The varlen calls cover the same pieces: their rows and boundaries give each piece its keys.
        called = []
        for call in selection.calls:
            q_rows, k_rows = _rows(call.queries), _rows(call.keys)
            cu_q, cu_k = call.cu_queries.tolist(), call.cu_keys.tolist()
            for (a, b), (c, d) in zip(itertools.pairwise(cu_q), itertools.pairwise(cu_k), strict=True):
                called.append(([local[i] for i in q_rows[a:b]], [ordered[i] for i in k_rows[c:d]]))
            assert call.max_queries == max(b - a for a, b in itertools.pairwise(cu_q))
            assert call.max_keys == max(d - c for c, d in itertools.pairwise(cu_k))
        assert sorted(called) == sorted(zip(pieces, expected))
        if window is None and cp > 1:  # the late chunks' call reads every key in place
            assert selection.calls[0].keys == slice(0, selection.num_keys)
        assert layout.local_tokens == shard["input_ids"].numel()
        if packed:
            assert torch.equal(layout.cu_seqlens, shard["cu_seqlens"])


def _rows(rows):
    return list(range(rows.start, rows.stop)) if isinstance(rows, slice) else rows.tolist()


def test_a_selection_is_built_once_per_shard_and_window():
    shard = CPShard.build(CPSplit(2, 1), torch.tensor([40, 7]), "cpu")  # padded lengths 40 and 8
    assert shard_keys(shard, 5) is shard_keys(shard, 5)
    assert shard_keys(shard, 5) is not shard_keys(shard, 6) and shard_keys(shard, 5) is not shard_keys(shard)
    assert shard_keys(shard, 5).window == 5 and shard_keys(shard).window is None
    # A window as long as the longest padded sequence changes nothing: it is the causal selection.
    assert shard_keys(shard, 40) is shard_keys(shard) and shard_keys(shard, 10**9) is shard_keys(shard)
    assert shard_keys(shard, 39).window == 39
    assert shard_keys(shard, 3).num_keys < shard_keys(shard).num_keys


def test_without_a_shard_each_row_is_one_piece_of_local_keys():
    selection = select_row_keys(3, 5, 2, torch.device("cpu"))
    assert selection.pieces == [(0, 5, 0, 5), (5, 10, 5, 10), (10, 15, 10, 15)]
    assert selection.order is None and selection.window == 2
    (call,) = selection.calls
    assert call.queries == call.keys == slice(0, 15)
    assert call.cu_queries.tolist() == call.cu_keys.tolist() == [0, 5, 10, 15]
    assert selection.num_keys == 15 and (call.max_queries, call.max_keys) == (5, 5)
    assert select_row_keys(3, 5, 5, torch.device("cpu")).window is None
