"""Documents of many lengths packed into rows of at most ``seq_len`` tokens: best-fit decreasing.

A document longer than a row is split into pieces of ``seq_len`` tokens, each a full row of its own, and
a shorter last piece; every other document, and the last pieces, are placed whole: longest first, each
into the open row with the least room that still holds it (a new row when none does). No document shorter
than a row is ever split, and the rows come out in a deterministic order (ties broken by document index).
Pure Python on lengths only: the tokens are read when a row is served.

Example::

    from lightning_cp.data.packing import pack_documents

    rows = pack_documents([5, 3, 9, 2], seq_len=6)
    # [[Piece(2, 0, 6)], [Piece(0, 0, 5)], [Piece(1, 0, 3), Piece(2, 6, 3)], [Piece(3, 0, 2)]]
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import NamedTuple


class Piece(NamedTuple):
    """Tokens ``[start, start + length)`` of document ``document``."""

    document: int
    start: int
    length: int


def pack_documents(lengths: Sequence[int], seq_len: int) -> list[list[Piece]]:
    """Pack documents of ``lengths`` tokens into rows of at most ``seq_len`` tokens (best-fit decreasing).

    Args:
        lengths: the token count of every document, indexed by document; an empty document is skipped.
        seq_len: the capacity of a row, in tokens.

    Returns:
        The rows, each a list of :class:`Piece`: first the full ``seq_len`` pieces of the long documents (in
        document order), then the rows of the best-fit placement in the order they were opened. Every token
        of every document is in exactly one piece.

    Raises:
        ValueError: if ``seq_len < 1`` or a length is negative.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be at least 1 (the tokens of a packed row).")
    rows: list[list[Piece]] = []
    items: list[Piece] = []
    for document, length in enumerate(lengths):
        if length < 0:
            raise ValueError(f"lengths[{document}]={length} is negative; a document has at least 0 tokens.")
        full, rest = divmod(int(length), seq_len)
        rows.extend([Piece(document, i * seq_len, seq_len)] for i in range(full))
        if rest:
            items.append(Piece(document, full * seq_len, rest))
    items.sort(key=lambda piece: -piece.length)  # stable: equal lengths stay in document order
    placed: list[list[Piece]] = []
    room: list[tuple[int, int]] = []  # (free tokens, row index) of the rows that still have room, sorted
    for piece in items:
        at = bisect.bisect_left(room, (piece.length, -1))
        if at == len(room):
            placed.append([piece])
            free, row = seq_len - piece.length, len(placed) - 1
        else:
            free, row = room.pop(at)
            placed[row].append(piece)
            free -= piece.length
        if free:
            bisect.insort(room, (free, row))
    return rows + placed
