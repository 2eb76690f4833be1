"""A dataset over a user's own pre-tokenized corpus: one flat binary file of token ids and its sidecar.

The file is a raw array of ``uint16`` (vocabularies up to 65536) or ``uint32`` token ids with no header
(nanoGPT's ``train.bin`` format). It is memory-mapped, so it may be far larger than RAM; only the tokens of
a sample are read.

A raw array does not say how it was written, so the dtype is never guessed: :func:`write_token_file`
writes the file together with a *sidecar*, ``<path>.json``, which records its dtype, token count,
vocabulary size and end-of-document id (the schema: :mod:`lightning_cp.data.token_file_sidecar`). The
reader checks the file size against the recorded ``num_tokens`` (a sidecar left over from another file
fails) and the caller's ``dtype`` / ``vocab_size`` / ``eos_id`` against the sidecar. A file without a
sidecar needs an explicit ``dtype``; a ``uint16`` reading that looks like ``uint32`` ids (odd positions,
the high halves, hold only tiny values while even ones do not, on a sample of the file) is refused.

Two ways to cut the file into samples:

- ``eos_id=None`` (pre-training): consecutive, non-overlapping windows of exactly ``seq_len`` tokens;
  sample ``i`` is ``tokens[i * seq_len : (i + 1) * seq_len]``, the ``N % seq_len`` tail is dropped.
- ``eos_id=<id>`` (packed SFT / document-aware training): the file is split into documents after every
  ``eos_id`` token (the EOS stays the last token of its document, so the model learns to stop; text
  after the last EOS is a final document). A document longer than ``seq_len`` is cut into pieces of
  ``seq_len`` tokens plus a shorter last piece. Samples then have different lengths: use them with
  ``collate_packed`` (or ``collate_padded``).

Every token is a target (``loss_mask`` all ones); the strategy's next-token shift means the first
token of each sample is never predicted and the last one predicts nothing. Megatron-LM / NeMo indexed
datasets (``prefix.bin`` + ``prefix.idx``) are read by :class:`~lightning_cp.data.MegatronIndexedDataset`.

Example::

    import numpy as np
    from lightning_cp.data import TokenFileDataset, write_token_file

    write_token_file("train.bin", np.random.randint(0, 50257, 100_000), vocab_size=50257)  # + train.bin.json
    ds = TokenFileDataset("train.bin", seq_len=1024, vocab_size=50257)   # dtype from the sidecar
    ds[0]   # {"input_ids": int64 [1024], "loss_mask": float32 [1024]}
"""

from __future__ import annotations

import os

import numpy as np
from numpy.typing import ArrayLike

from lightning_cp.data._token_spans import (
    _check_sampled_ids,
    _check_seq_len,
    _document_pieces,
    _sample_blocks,
    _TokenSpans,
)
from lightning_cp.data.token_file_sidecar import TOKEN_DTYPES, TokenDType, TokenFileSidecar

_UINT16_IDS = 1 << 16

_MIN_SAMPLE_PAIRS = 16
"""Fewer ``(even, odd)`` pairs than this are too few to judge, and the check is skipped."""
_HIGH_HALF_LIMIT = 16
"""High halves (``id >> 16``) of ``uint32`` ids stay below this for any vocabulary up to a million ids."""


def write_token_file(
    path: str | os.PathLike, tokens: ArrayLike, vocab_size: int, eos_id: int | None = None
) -> TokenDType:
    """Write token ids as a flat token file plus its sidecar ``<path>.json`` (see the module docstring).

    The dtype is the smallest that holds ``vocab_size`` ids: ``uint16`` up to 65536, ``uint32`` above.
    An existing sidecar is removed first and the new one written last, so an interrupted write leaves a
    file without a sidecar (refused unless a ``dtype`` is given) rather than a wrong one.

    Args:
        path: the token file to write, e.g. ``data/train.bin`` (its sidecar is ``data/train.bin.json``).
        tokens: 1-D integer ids, every one in ``[0, vocab_size)``; documents each followed by ``eos_id``
            for document-aware training.
        vocab_size: the tokenizer's vocabulary size, at most ``2**32``.
        eos_id: the end-of-document id, recorded in the sidecar (readers then reject another ``eos_id``).

    Returns:
        The dtype written, ``"uint16"`` or ``"uint32"``.

    Raises:
        ValueError: if ``tokens`` is empty or not 1-D integers, an id or ``eos_id`` is outside
            ``[0, vocab_size)``, or ``vocab_size`` is outside ``[1, 2**32]``.
    """
    ids = np.asarray(tokens)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(
            f"tokens must be a non-empty 1-D array of integer ids, got shape {ids.shape} of {ids.dtype}."
        )
    if not 1 <= vocab_size <= 1 << 32:
        raise ValueError(f"vocab_size={vocab_size} must be in [1, 2**32] to fit a uint16 or uint32 file.")
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(
            f"tokens holds id {bad} (at position {int(np.argmax(ids == bad))}), outside [0, "
            f"vocab_size={vocab_size}); pass the tokenizer's vocabulary size."
        )
    if eos_id is not None and not 0 <= eos_id < vocab_size:
        raise ValueError(f"eos_id={eos_id} must be in [0, vocab_size={vocab_size}).")
    dtype: TokenDType = "uint16" if vocab_size <= _UINT16_IDS else "uint32"
    TokenFileSidecar.path_of(path).unlink(missing_ok=True)
    ids.astype(dtype).tofile(path)
    TokenFileSidecar(dtype=dtype, num_tokens=int(ids.size), vocab_size=vocab_size, eos_id=eos_id).write(path)
    return dtype


class TokenFileDataset(_TokenSpans):
    """Fixed windows or EOS-delimited documents of a flat ``uint16`` / ``uint32`` token file.

    Args:
        path: the token file (raw array, no header), ideally written by :func:`write_token_file`.
        seq_len: window length (``eos_id=None``) or the longest piece a document is cut into.
        dtype: the integer type the file was written with. ``None`` reads it from the sidecar
            ``<path>.json``; a file without a sidecar needs it. A value that contradicts the sidecar fails.
        vocab_size: if given, every token id must be ``< vocab_size``; checked once by a sequential
            scan of the whole file, so a tokenizer / model mismatch fails here and not as an index
            error inside the embedding on some later step. It may not be smaller than the sidecar's.
        eos_id: the end-of-document token that splits the file into documents (see the module
            docstring); ``None`` cuts fixed windows instead. It may not differ from the sidecar's.

    Each item is ``{"input_ids": int64 [L], "loss_mask": float32 [L]}`` (``L = seq_len`` without
    ``eos_id``, ``1 <= L <= seq_len`` with it). The memory map is opened lazily in each process and not
    pickled, so DataLoader workers started with ``spawn`` do not copy the file.

    Raises:
        ValueError: on a missing or empty file, a missing ``dtype`` (no sidecar), a ``dtype`` /
            ``vocab_size`` / ``eos_id`` that contradicts the sidecar or a file size that does not match it,
            a ``uint16`` reading of what looks like a ``uint32`` file, an unknown ``dtype``, a file size that
            is not a multiple of the dtype's size, a file shorter than one window, ``seq_len < 1``, an id
            ``>= vocab_size``, or an ``eos_id`` that is out of range or never occurs; also on one of the two
            files of a Megatron indexed dataset (pass its prefix to ``MegatronIndexedDataset``).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        seq_len: int,
        dtype: TokenDType | None = None,
        vocab_size: int | None = None,
        eos_id: int | None = None,
    ) -> None:
        dtype, num_tokens = _check_token_file(path, seq_len, dtype, vocab_size, eos_id)
        super().__init__(path, np.dtype(dtype))
        self.seq_len = seq_len
        self.dtype = dtype
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        eos_positions = self._scan(vocab_size, eos_id)
        if eos_id is None:
            self._starts = np.arange(num_tokens // seq_len, dtype=np.int64) * seq_len
            self._lengths = np.full(len(self._starts), seq_len, dtype=np.int64)
            return
        if len(eos_positions) == 0:
            raise ValueError(
                f"eos_id={eos_id} never occurs in path={self.path!r}; pass the id the file was "
                "tokenized with, or eos_id=None to cut fixed windows."
            )
        ends = eos_positions + 1
        if ends[-1] != num_tokens:
            ends = np.append(ends, num_tokens)
        self._starts, self._lengths = _document_pieces(np.concatenate([[0], ends[:-1]]), ends, seq_len)


def _check_token_file(
    path: str | os.PathLike,
    seq_len: int,
    dtype: TokenDType | None,
    vocab_size: int | None,
    eos_id: int | None,
) -> tuple[TokenDType, int]:
    """Every check of a flat token file that does not read it whole; returns its dtype and token count.

    Reads the sidecar, the file size and a sample of the ids (a few blocks, see ``_sample_blocks``), so it is
    cheap enough for a DataModule's constructor (where the CLI reports its errors as one line).
    """
    _check_seq_len(seq_len)
    path = os.fspath(path)
    _check_path(path)
    sidecar = TokenFileSidecar.read(path)
    if sidecar is None and dtype is None:
        raise ValueError(
            f"path={path!r} has no sidecar {str(TokenFileSidecar.path_of(path))!r} that records its dtype; pass "
            "dtype='uint16' or dtype='uint32' (the type it was written with), or write it with "
            "lightning_cp.data.write_token_file."
        )
    if sidecar is not None and dtype is not None and dtype != sidecar.dtype:
        raise ValueError(
            f"dtype={dtype!r} contradicts the sidecar {str(TokenFileSidecar.path_of(path))!r}, which records "
            f"dtype={sidecar.dtype!r}; leave dtype unset or fix the sidecar."
        )
    dtype = sidecar.dtype if dtype is None else dtype
    if dtype not in TOKEN_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; use 'uint16' or 'uint32'.")
    itemsize = np.dtype(dtype).itemsize
    size = os.path.getsize(path)
    if size == 0:
        raise ValueError(
            f"path={path!r} is empty (0 bytes): it holds no tokens; pass a non-empty token file."
        )
    if size % itemsize:
        raise ValueError(
            f"The size of path={path!r} ({size} bytes) is not a multiple of {itemsize} bytes, the size of "
            f"dtype={dtype!r}; was it written with another dtype (e.g. uint16 vs uint32) or truncated?"
        )
    num_tokens = size // itemsize
    if sidecar is not None:
        sidecar.check(path, num_tokens, vocab_size, eos_id)
    id_limit = np.iinfo(dtype).max + 1 if vocab_size is None else min(np.iinfo(dtype).max + 1, vocab_size)
    if eos_id is not None and not 0 <= eos_id < id_limit:
        raise ValueError(
            f"eos_id={eos_id} is not a valid id for dtype={dtype!r} and vocab_size={vocab_size} "
            f"(valid: 0 <= id < {id_limit}); pass the tokenizer's end-of-document id."
        )
    if eos_id is None and num_tokens < seq_len:
        raise ValueError(
            f"path={path!r} holds {num_tokens} tokens, fewer than one window of seq_len={seq_len}; use a "
            "smaller seq_len or a larger file."
        )
    if sidecar is None and dtype == "uint16" and size % 4 == 0:
        _refuse_uint32_read_as_uint16(path)
    if vocab_size is not None:
        _check_sampled_ids(path, np.dtype(dtype), vocab_size)
    return dtype, num_tokens


def _check_path(path: str) -> None:
    """``path`` is a file, and not one of the two files of a Megatron indexed dataset."""
    if not os.path.isfile(path):
        what = "is a directory" if os.path.isdir(path) else "does not exist"
        hint = (
            " It is the prefix of a Megatron indexed dataset: read it with MegatronIndexedDataset."
            if os.path.isfile(path + ".idx")
            else ""
        )
        raise ValueError(f"path={path!r} {what}; pass a token file (e.g. written by write_token_file).{hint}")
    prefix, extension = os.path.splitext(path)
    if extension in (".bin", ".idx") and os.path.isfile(prefix + ".idx") and os.path.isfile(prefix + ".bin"):
        raise ValueError(
            f"path={path!r} is one of the two files of the Megatron indexed dataset {prefix!r} ({prefix}.bin "
            f"+ {prefix}.idx); pass the prefix, path={prefix!r}, so that the documents come from the index."
        )


def _refuse_uint32_read_as_uint16(path: str) -> None:
    """Fail when the ``uint16`` reading of ``path`` looks like little-endian ``uint32`` ids.

    A ``uint32`` id ``x < 2**20`` reads as the pair ``(x & 0xFFFF, x >> 16)``: the odd positions hold
    values below 16 (zeros for vocabularies up to 65536) while the even ones hold the ids. Real ``uint16``
    text has the same distribution at odd and even positions, so it cannot look like this.
    """
    tokens = np.memmap(path, dtype=np.uint16, mode="r")  # an even number of ids: the size is a multiple of 4
    blocks = [block for _, block in _sample_blocks(tokens)]
    pairs = np.concatenate(blocks).reshape(-1, 2).astype(np.int64)
    if len(pairs) < _MIN_SAMPLE_PAIRS:
        return
    even, odd = pairs[:, 0], pairs[:, 1]
    if odd.max() < _HIGH_HALF_LIMIT and odd.mean() * 8 < even.mean():
        raise ValueError(
            f"path={path!r} read as dtype='uint16' looks like a uint32 file: in {len(pairs)} sampled pairs "
            f"of ids the second (the high half of a uint32 id) is always below {_HIGH_HALF_LIMIT} (mean "
            f"{odd.mean():.2f}) while the first is not (mean {even.mean():.1f}). Pass dtype='uint32', or "
            "write the file with lightning_cp.data.write_token_file so that its sidecar records the dtype."
        )
