"""The keys CP attention selects for every query piece (``CPShard.keys``), causal and with a sliding window.

The reference is a plain loop over every query of a piece: the keys of its padded sequence it may see by
the definition (``p - window < j <= p``), never the index arithmetic under test.
"""

import itertools

import pytest
import torch

from lightning_cp.parallel import CPShard, CPSplit, shard_batch
from lightning_cp.parallel._key_selection import select_row_keys


def _expected_piece_keys(lengths, cp, rank, window):
    """For every piece (sequence, kept chunk) in local order: the 1-based global ids of the keys its
    queries see (0 for padding), in sequence order."""
    pieces, start = [], 0
    for length in lengths:
        c = -(-length // (2 * cp))
        ids = [start + t + 1 if t < length else 0 for t in range(2 * cp * c)]
        for chunk in (rank, 2 * cp - 1 - rank):
            queries = range(chunk * c, (chunk + 1) * c)
            seen = {j for p in queries for j in range(p + 1) if window is None or j > p - window}
            pieces.append([ids[j] for j in sorted(seen)])
        start += length
    return pieces


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
        selection = layout.keys(window)
        keys = gathered[selection.key_index].tolist()
        cu_keys, cu_queries = selection.cu_keys.tolist(), selection.cu_queries.tolist()
        expected = _expected_piece_keys(lengths if packed else [total] * rows, cp, rank, window)
        assert [keys[a:b] for a, b in itertools.pairwise(cu_keys)] == expected
        local = shard["token_id"].flatten().tolist()
        pieces = [local[a:b] for a, b in itertools.pairwise(cu_queries)]
        # Each piece's queries are the last keys of its key range (bottom-right causal alignment).
        assert all(keys_of[len(keys_of) - len(q) :] == q for keys_of, q in zip(expected, pieces))
        assert selection.pieces == [
            (*q, *k) for q, k in zip(itertools.pairwise(cu_queries), itertools.pairwise(cu_keys))
        ]
        assert selection.num_keys == sum(len(p) for p in expected) == len(keys)
        assert selection.gathered_tokens == len(gathered)
        assert selection.max_queries == max(len(p) for p in pieces)
        assert selection.max_keys == max(len(p) for p in expected)
        assert layout.local_tokens == shard["input_ids"].numel()
        if packed:
            assert torch.equal(layout.cu_seqlens, shard["cu_seqlens"])


def test_a_selection_is_built_once_per_shard_and_window():
    shard = CPShard.build(CPSplit(2, 1), torch.tensor([40, 7]), "cpu")  # padded lengths 40 and 8
    assert shard.keys(5) is shard.keys(5)
    assert shard.keys(5) is not shard.keys(6) and shard.keys(5) is not shard.keys()
    assert shard.keys(5).window == 5 and shard.keys().window is None
    # A window as long as the longest padded sequence changes nothing: it is the causal selection.
    assert shard.keys(40) is shard.keys() and shard.keys(10**9) is shard.keys()
    assert shard.keys(39).window == 39
    assert shard.keys(3).num_keys < shard.keys().num_keys


def test_without_a_shard_each_row_is_one_piece_of_local_keys():
    selection = select_row_keys(3, 5, 2, torch.device("cpu"))
    assert selection.pieces == [(0, 5, 0, 5), (5, 10, 5, 10), (10, 15, 10, 15)]
    assert selection.key_index is None and selection.window == 2
    assert selection.cu_queries.tolist() == selection.cu_keys.tolist() == [0, 5, 10, 15]
    assert selection.num_keys == 15 and (selection.max_queries, selection.max_keys) == (5, 5)
    assert select_row_keys(3, 5, 5, torch.device("cpu")).window is None
