"""``pack_documents``: every token placed once, no short document split, best-fit decreasing placement."""

from __future__ import annotations

import random

import pytest

from lightning_cp.data import Piece, pack_documents


def _reference_best_fit_decreasing(lengths: list[int], seq_len: int) -> list[list[Piece]]:
    """The textbook algorithm, quadratic: long documents cut first, then every item into the fullest row
    that holds it (the first such row on a tie), longest items first (document order on a tie)."""
    full_rows, items = [], []
    for doc, length in enumerate(lengths):
        start = 0
        while length - start >= seq_len:
            full_rows.append([Piece(doc, start, seq_len)])
            start += seq_len
        if length > start:
            items.append(Piece(doc, start, length - start))
    rows: list[list[Piece]] = []
    for item in sorted(items, key=lambda p: (-p.length, p.document)):
        free = [seq_len - sum(p.length for p in row) for row in rows]
        fits = [(room, i) for i, room in enumerate(free) if room >= item.length]
        if fits:
            rows[min(fits)[1]].append(item)
        else:
            rows.append([item])
    return full_rows + rows


@pytest.mark.parametrize("seed", range(5))
def test_packing_matches_best_fit_decreasing_and_places_every_token_once(seed):
    rng = random.Random(seed)
    seq_len = rng.choice([16, 37, 64])
    edge = [0, 1, seq_len, 2 * seq_len + 3]
    lengths = [rng.choice(edge) if rng.random() < 0.2 else rng.randint(1, seq_len) for _ in range(150)]
    rows = pack_documents(lengths, seq_len)
    assert rows == _reference_best_fit_decreasing(lengths, seq_len)

    covered = {doc: [] for doc in range(len(lengths))}
    for row in rows:
        assert 0 < sum(p.length for p in row) <= seq_len
        for piece in row:
            covered[piece.document].append((piece.start, piece.start + piece.length))
    for doc, length in enumerate(lengths):
        tokens = [t for start, end in sorted(covered[doc]) for t in range(start, end)]
        assert tokens == list(range(length)), f"document {doc}: tokens not placed exactly once"
        spans = covered[doc]
        if length <= seq_len:
            assert len(spans) == (1 if length else 0), (
                f"document {doc} of {length} <= {seq_len} tokens was split"
            )


def test_long_documents_fill_rows_of_their_own_and_rows_are_full_when_items_fit():
    rows = pack_documents([5, 3, 9, 2, 1], seq_len=6)
    assert rows == [
        [Piece(2, 0, 6)],
        [Piece(0, 0, 5), Piece(4, 0, 1)],
        [Piece(1, 0, 3), Piece(2, 6, 3)],
        [Piece(3, 0, 2)],
    ]


def test_packing_rejects_bad_arguments():
    with pytest.raises(ValueError, match="seq_len=0"):
        pack_documents([1], seq_len=0)
    with pytest.raises(ValueError, match=r"lengths\[1\]=-2"):
        pack_documents([1, -2], seq_len=4)
