"""What the token-file datasets share: samples cut from a memory-mapped array of token ids.

A sample is a contiguous span ``tokens[start : start + length]`` of one binary file of token ids; the
datasets differ only in how they find the spans (fixed windows, EOS tokens, a Megatron index). This module
imports numpy, torch and the batch keys (``lightning_cp.constants``) only, so DataLoader workers stay light.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_cp.constants import INPUT_IDS, LOSS_MASK

_SCAN_CHUNK = 1 << 24
"""Tokens read per step when scanning a file: bounds the scan's memory to a few tens of MB."""
_SAMPLE_BLOCKS = 16
"""Blocks read, evenly spaced over a file, by the cheap checks of a constructor."""
_SAMPLE_BLOCK = 4096
"""Ids per sampled block; even, so that a block of a ``uint16`` reading holds whole ``uint32`` ids."""


class _TokenSpans(Dataset):
    """Samples ``tokens[starts[i] : starts[i] + lengths[i]]`` of a token file, memory-mapped lazily.

    Subclasses call ``__init__`` with the file and its dtype, find the spans (they may read the file through
    ``self._tokens``), then set ``self._starts`` and ``self._lengths`` (int64 arrays, in tokens).

    Each item is ``{"input_ids": int64 [L], "loss_mask": float32 [L]}`` with an all-ones ``loss_mask``:
    every token is a target. The memory map is opened on first use in each process and never pickled, so
    DataLoader workers started with ``spawn`` do not copy the file.
    """

    def __init__(self, path: str | os.PathLike, dtype: np.dtype) -> None:
        self.path = os.fspath(path)
        self._np_dtype = np.dtype(dtype)
        self._tokens_cache: np.memmap | None = None
        self._starts = np.empty(0, dtype=np.int64)
        self._lengths = np.empty(0, dtype=np.int64)

    def __len__(self) -> int:
        return len(self._starts)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start, length = int(self._starts[index]), int(self._lengths[index])
        ids = torch.from_numpy(self._tokens[start : start + length].astype(np.int64))
        return {INPUT_IDS: ids, LOSS_MASK: torch.ones(length, dtype=torch.float32)}

    @property
    def _tokens(self) -> np.memmap:
        if self._tokens_cache is None:
            self._tokens_cache = np.memmap(self.path, dtype=self._np_dtype, mode="r")
        return self._tokens_cache

    def __getstate__(self) -> dict:
        # A pickled np.memmap carries its whole content; reopen the file in the receiving process instead.
        state = self.__dict__.copy()
        state["_tokens_cache"] = None
        return state

    def _scan(self, vocab_size: int | None, eos_id: int | None) -> np.ndarray:
        """One sequential pass, chunk by chunk: check ids against ``vocab_size``, return the EOS positions."""
        if vocab_size is None and eos_id is None:
            return np.empty(0, dtype=np.int64)
        tokens = self._tokens
        eos_positions = []
        max_id, max_pos = -1, -1
        for offset in range(0, len(tokens), _SCAN_CHUNK):
            chunk = tokens[offset : offset + _SCAN_CHUNK]
            if vocab_size is not None:
                pos = int(chunk.argmax())
                if int(chunk[pos]) > max_id:
                    max_id, max_pos = int(chunk[pos]), offset + pos
            if eos_id is not None:
                eos_positions.append(np.flatnonzero(chunk == eos_id) + offset)
        if vocab_size is not None and max_id >= vocab_size:
            raise _out_of_vocab(self.path, self._np_dtype, max_id, max_pos, vocab_size)
        return np.concatenate(eos_positions) if eos_positions else np.empty(0, dtype=np.int64)


def _check_seq_len(seq_len: int) -> None:
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be at least 1 (the longest sample, in tokens).")


def _sample_blocks(tokens: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """``(start, ids)`` of up to ``_SAMPLE_BLOCKS`` blocks of ``_SAMPLE_BLOCK`` ids spread evenly over
    ``tokens``, from its first id to its last; every ``start`` is even."""
    last = max(len(tokens) - _SAMPLE_BLOCK, 0)
    starts = np.unique(np.linspace(0, last, _SAMPLE_BLOCKS).astype(np.int64) // 2 * 2)
    return [(int(start), tokens[start : start + _SAMPLE_BLOCK]) for start in starts]


def _check_sampled_ids(path: str, dtype: np.dtype, vocab_size: int) -> None:
    """Check a sample of the file's ids (:func:`_sample_blocks`) against ``vocab_size``.

    Cheap enough for a DataModule's constructor, where a wrong ``vocab_size`` or ``dtype`` then fails as one
    line of the CLI; the full scan at ``setup`` still checks every id.
    """
    tokens = np.memmap(path, dtype=dtype, mode="r")
    for start, block in _sample_blocks(tokens):
        pos = int(block.argmax())
        if int(block[pos]) >= vocab_size:
            raise _out_of_vocab(path, tokens.dtype, int(block[pos]), start + pos, vocab_size)


def _out_of_vocab(path: str, dtype: np.dtype, token_id: int, position: int, vocab_size: int) -> ValueError:
    return ValueError(
        f"{path!r} holds token id {token_id} (at position {position}), but vocab_size={vocab_size} allows "
        f"ids < {vocab_size}; pass the tokenizer's vocab size (at least {token_id + 1}) or check that the "
        f"file really holds {np.dtype(dtype).name} ids."
    )


def _document_pieces(
    doc_starts: np.ndarray, doc_ends: np.ndarray, seq_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """Start and length of every piece when each document ``[start, end)`` is cut into ``seq_len`` pieces.

    A document of ``n`` tokens gives ``ceil(n / seq_len)`` pieces (the last one shorter), an empty one none.
    """
    doc_starts, doc_ends = doc_starts.astype(np.int64), doc_ends.astype(np.int64)
    pieces_per_doc = -(-(doc_ends - doc_starts) // seq_len)
    doc_of_piece = np.repeat(np.arange(len(doc_starts)), pieces_per_doc)
    first_piece_of_doc = np.cumsum(pieces_per_doc) - pieces_per_doc
    piece_in_doc = np.arange(pieces_per_doc.sum()) - first_piece_of_doc[doc_of_piece]
    starts = doc_starts[doc_of_piece] + piece_in_doc * seq_len
    lengths = np.minimum(seq_len, doc_ends[doc_of_piece] - starts)
    return starts, lengths
