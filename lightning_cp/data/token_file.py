"""A dataset over a user's own pre-tokenized corpus: one flat binary file of token ids.

The file is a raw array of ``uint16`` (vocabularies up to 65536) or ``uint32`` token ids with no
header, as written by ``np.asarray(ids, dtype=np.uint16).tofile(path)`` (nanoGPT's ``train.bin``
format). It is memory-mapped, so it may be far larger than RAM; only the tokens of a sample are read.

Two ways to cut it into samples:

- ``eos_id=None`` (pre-training): consecutive, non-overlapping windows of exactly ``seq_len`` tokens;
  sample ``i`` is ``tokens[i * seq_len : (i + 1) * seq_len]``, the ``N % seq_len`` tail is dropped.
- ``eos_id=<id>`` (packed SFT / document-aware training): the file is split into documents after every
  ``eos_id`` token (the EOS stays the last token of its document, so the model learns to stop; text
  after the last EOS is a final document). A document longer than ``seq_len`` is cut into pieces of
  ``seq_len`` tokens plus a shorter last piece. Samples then have different lengths: use them with
  ``collate_packed`` (or ``collate_padded``). Document boundaries come from the EOS token alone, so
  no index file has to be kept in sync with the token file.

Every token is a target (``loss_mask`` all ones); the strategy's next-token shift means the first
token of each sample is never predicted and the last one predicts nothing.

Example::

    import numpy as np
    from lightning_cp.data import TokenFileDataset

    np.random.randint(0, 50257, 100_000).astype(np.uint16).tofile("train.bin")
    ds = TokenFileDataset("train.bin", seq_len=1024, dtype="uint16", vocab_size=50257)
    ds[0]   # {"input_ids": int64 [1024], "loss_mask": float32 [1024]}
"""

from __future__ import annotations

import os
from typing import Literal

import numpy as np
import torch
from torch.utils.data import Dataset

TokenDType = Literal["uint16", "uint32"]

_SCAN_CHUNK = 1 << 24
"""Tokens read per step when scanning the file: bounds the scan's memory to a few tens of MB."""


class TokenFileDataset(Dataset):
    """Fixed windows or EOS-delimited documents of a flat ``uint16`` / ``uint32`` token file.

    Args:
        path: the token file (raw array, no header).
        seq_len: window length (``eos_id=None``) or the longest piece a document is cut into.
        dtype: the integer type the file was written with; its size must divide the file size.
        vocab_size: if given, every token id must be ``< vocab_size``; checked once by a sequential
            scan of the whole file, so a tokenizer / model mismatch fails here and not as an index
            error inside the embedding on some later step.
        eos_id: the end-of-document token that splits the file into documents (see the module
            docstring); ``None`` cuts fixed windows instead.

    Each item is ``{"input_ids": int64 [L], "loss_mask": float32 [L]}`` (``L = seq_len`` without
    ``eos_id``, ``1 <= L <= seq_len`` with it). The memory map is opened lazily in each process and not
    pickled, so DataLoader workers started with ``spawn`` do not copy the file.

    Raises:
        ValueError: on an unknown ``dtype``, a file size that is not a multiple of the dtype's size,
            a file shorter than one window, ``seq_len < 1``, an id ``>= vocab_size``, or an ``eos_id``
            that is out of range or never occurs.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        seq_len: int,
        dtype: TokenDType = "uint16",
        vocab_size: int | None = None,
        eos_id: int | None = None,
    ) -> None:
        if dtype not in ("uint16", "uint32"):
            raise ValueError(f"dtype={dtype!r} is not supported; use 'uint16' or 'uint32'.")
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len} must be at least 1.")
        np_dtype = np.dtype(dtype)
        size = os.path.getsize(path)
        if size % np_dtype.itemsize:
            raise ValueError(
                f"The size of path={os.fspath(path)!r} ({size} bytes) is not a multiple of "
                f"{np_dtype.itemsize} bytes, the size of dtype={dtype!r}; was it written with another dtype "
                "(e.g. uint16 vs uint32) or truncated?"
            )
        self.path = os.fspath(path)
        self.seq_len = seq_len
        self.dtype = dtype
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        self._tokens_cache: np.memmap | None = None
        num_tokens = size // np_dtype.itemsize
        id_limit = np.iinfo(np_dtype).max + 1
        if vocab_size is not None:
            id_limit = min(id_limit, vocab_size)
        if eos_id is not None and not 0 <= eos_id < id_limit:
            raise ValueError(
                f"eos_id={eos_id} is not a valid id for dtype={dtype!r} and vocab_size={vocab_size} "
                f"(valid: 0 <= id < {id_limit}); pass the tokenizer's end-of-document id."
            )
        if eos_id is None and num_tokens < seq_len:
            raise ValueError(
                f"path={self.path!r} holds {num_tokens} tokens, fewer than one window of "
                f"seq_len={seq_len}; use a smaller seq_len or a larger file."
            )
        eos_positions = self._scan(num_tokens)
        if eos_id is None:
            self._starts = np.arange(num_tokens // seq_len, dtype=np.int64) * seq_len
            self._lengths = np.full(len(self._starts), seq_len, dtype=np.int64)
        else:
            if len(eos_positions) == 0:
                raise ValueError(
                    f"eos_id={eos_id} never occurs in path={self.path!r}; pass the id the file was "
                    "tokenized with, or eos_id=None to cut fixed windows."
                )
            self._starts, self._lengths = _document_pieces(eos_positions, num_tokens, seq_len)

    def __len__(self) -> int:
        return len(self._starts)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start, length = int(self._starts[index]), int(self._lengths[index])
        ids = torch.from_numpy(self._tokens[start : start + length].astype(np.int64))
        return {"input_ids": ids, "loss_mask": torch.ones(length, dtype=torch.float32)}

    @property
    def _tokens(self) -> np.memmap:
        if self._tokens_cache is None:
            self._tokens_cache = np.memmap(self.path, dtype=self.dtype, mode="r")
        return self._tokens_cache

    def __getstate__(self) -> dict:
        # A pickled np.memmap carries its whole content; reopen the file in the receiving process instead.
        state = self.__dict__.copy()
        state["_tokens_cache"] = None
        return state

    def _scan(self, num_tokens: int) -> np.ndarray:
        """One sequential pass, chunk by chunk: check ids against ``vocab_size``, find the EOS positions."""
        if self.vocab_size is None and self.eos_id is None:
            return np.empty(0, dtype=np.int64)
        eos_positions = []
        max_id, max_pos = -1, -1
        for offset in range(0, num_tokens, _SCAN_CHUNK):
            chunk = self._tokens[offset : offset + _SCAN_CHUNK]
            if self.vocab_size is not None:
                pos = int(chunk.argmax())
                if int(chunk[pos]) > max_id:
                    max_id, max_pos = int(chunk[pos]), offset + pos
            if self.eos_id is not None:
                eos_positions.append(np.flatnonzero(chunk == self.eos_id) + offset)
        if self.vocab_size is not None and max_id >= self.vocab_size:
            raise ValueError(
                f"path={self.path!r} holds token id {max_id} (at position {max_pos}), but "
                f"vocab_size={self.vocab_size} allows ids < {self.vocab_size}; pass the tokenizer's "
                f"vocab size (at least {max_id + 1}) or check dtype={self.dtype!r}."
            )
        return np.concatenate(eos_positions) if eos_positions else np.empty(0, dtype=np.int64)


def _document_pieces(
    eos_positions: np.ndarray, num_tokens: int, seq_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """Start and length of every piece: documents end after each EOS, then are cut into ``seq_len`` pieces."""
    ends = eos_positions.astype(np.int64) + 1
    if ends[-1] != num_tokens:
        ends = np.append(ends, num_tokens)
    doc_starts = np.concatenate([[0], ends[:-1]])
    pieces_per_doc = -(-(ends - doc_starts) // seq_len)
    doc_of_piece = np.repeat(np.arange(len(ends)), pieces_per_doc)
    first_piece_of_doc = np.cumsum(pieces_per_doc) - pieces_per_doc
    piece_in_doc = np.arange(pieces_per_doc.sum()) - first_piece_of_doc[doc_of_piece]
    starts = doc_starts[doc_of_piece] + piece_in_doc * seq_len
    lengths = np.minimum(seq_len, ends[doc_of_piece] - starts)
    return starts, lengths
