"""Megatron-LM / NeMo indexed datasets (``prefix.bin`` + ``prefix.idx``), read without importing Megatron.

This is the format ``tools/preprocess_data.py`` of Megatron-LM (and NeMo's copy of it) writes, through
``megatron.core.datasets.indexed_dataset.IndexedDatasetBuilder``. ``prefix.bin`` holds the token ids of
every sequence back to back; ``prefix.idx`` is, in little-endian order::

    9 bytes   b"MMIDIDX\\x00\\x00"
    uint64    version, 1
    uint8     dtype code of the ids in .bin: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 8 uint16
              (6 float64 and 7 float32 are not token ids)
    uint64    S, the number of sequences
    uint64    D + 1, the number of document indices
    int32     [S]      length of each sequence, in ids
    int64     [S]      byte offset of each sequence in .bin
    int64     [D + 1]  document indices: document d is sequences [doc[d], doc[d + 1]), doc[0] = 0, doc[D] = S
    (int8     [S]      a mode per sequence, in multimodal datasets only; not read here)

A document is usually one sequence (the text of one JSON line, EOD appended with ``--append-eod``); with
``--split-sentences`` it is several, one per sentence. This reader is our own (DataLoader workers must not
import Megatron-core); the tests compare it with Megatron's ``IndexedDataset``.

Example::

    from lightning_cp.data import MegatronIndexedDataset

    ds = MegatronIndexedDataset("data/train_text_document", seq_len=4096, vocab_size=128256)
    ds[0]   # the first document (or its first 4096 ids): {"input_ids": int64 [L], "loss_mask": float32 [L]}
"""

from __future__ import annotations

import dataclasses
import os
import struct

import numpy as np

from lightning_cp.data._token_spans import _check_seq_len, _document_pieces, _TokenSpans

_MAGIC = b"MMIDIDX\x00\x00"
_HEADER = struct.Struct("<QBQQ")  # version, dtype code, sequence count, document index count
_VERSION = 1
_DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}


@dataclasses.dataclass(frozen=True)
class _MegatronIndex:
    """The content of ``prefix.idx``, validated against ``prefix.bin`` (arrays are memory-mapped)."""

    dtype: np.dtype
    """Type of the ids in ``prefix.bin``."""
    sequence_lengths: np.ndarray
    """``int32 [S]``: ids per sequence."""
    sequence_pointers: np.ndarray
    """``int64 [S]``: byte offset of each sequence in ``prefix.bin``."""
    document_indices: np.ndarray
    """``int64 [D + 1]``: document ``d`` is sequences ``[document_indices[d], document_indices[d + 1])``."""

    @classmethod
    def read(cls, prefix: str | os.PathLike) -> _MegatronIndex:
        """Read and check ``prefix.idx``: header, array sizes, document indices, and that the sequences lie
        back to back in ``prefix.bin`` and fill it exactly.

        Raises:
            ValueError: naming the file and what is wrong with it.
        """
        prefix = os.fspath(prefix)
        idx_path, bin_path = prefix + ".idx", prefix + ".bin"
        for file in (idx_path, bin_path):
            if not os.path.isfile(file):
                raise ValueError(
                    f"{file!r} does not exist: a Megatron indexed dataset needs both {prefix}.bin and "
                    f"{prefix}.idx (pass their common prefix, path={prefix!r})."
                )
        idx_size = os.path.getsize(idx_path)
        with open(idx_path, "rb") as stream:
            head = stream.read(len(_MAGIC) + _HEADER.size)
        if len(head) < len(_MAGIC) + _HEADER.size or not head.startswith(_MAGIC):
            raise ValueError(
                f"{idx_path!r} is not a Megatron index: it does not start with {_MAGIC!r}; write it with "
                "Megatron's tools/preprocess_data.py (IndexedDatasetBuilder)."
            )
        version, code, num_sequences, num_doc_indices = _HEADER.unpack(head[len(_MAGIC) :])
        if version != _VERSION:
            raise ValueError(f"{idx_path!r} has index version {version}; only version {_VERSION} is known.")
        if code not in _DTYPE_CODES:
            raise ValueError(
                f"{idx_path!r} records dtype code {code}, not an integer type of token ids (known: "
                f"{ {c: np.dtype(t).name for c, t in _DTYPE_CODES.items()} })."
            )
        offset = len(head)
        sizes = (4 * num_sequences, 8 * num_sequences, 8 * num_doc_indices)
        if idx_size < offset + sum(sizes):
            raise ValueError(
                f"{idx_path!r} is truncated: {idx_size} bytes, but its header announces {num_sequences} "
                f"sequences and {num_doc_indices} document indices ({offset + sum(sizes)} bytes)."
            )
        arrays = []
        for dtype, count, nbytes in zip(
            (np.int32, np.int64, np.int64), (num_sequences,) * 2 + (num_doc_indices,), sizes
        ):
            arrays.append(
                np.memmap(idx_path, dtype=dtype, mode="r", offset=offset, shape=(count,))
                if count
                else np.empty(0, dtype)
            )
            offset += nbytes
        index = cls(np.dtype(_DTYPE_CODES[code]), *arrays)
        index._check(idx_path, bin_path)
        return index

    def _check(self, idx_path: str, bin_path: str) -> None:
        docs, lengths = self.document_indices, self.sequence_lengths
        if len(docs) == 0 or docs[0] != 0 or docs[-1] != len(lengths) or (np.diff(docs) < 0).any():
            raise ValueError(
                f"{idx_path!r} has invalid document indices: they must rise from 0 to the number of "
                f"sequences ({len(lengths)}); the index is corrupt, rebuild it with Megatron's tools."
            )
        if (lengths < 0).any():
            raise ValueError(f"{idx_path!r} has negative sequence lengths; the index is corrupt.")
        ends = self.sequence_ends
        itemsize = self.dtype.itemsize
        if not np.array_equal(self.sequence_pointers, (ends - lengths) * itemsize):
            raise ValueError(
                f"The sequences of {idx_path!r} do not lie back to back in {bin_path!r} (their byte offsets "
                "are not the running sum of their lengths); rebuild the dataset with Megatron's tools."
            )
        bin_size = os.path.getsize(bin_path)
        total = int(ends[-1]) if len(ends) else 0
        if bin_size != total * itemsize:
            raise ValueError(
                f"{bin_path!r} has {bin_size} bytes, but {idx_path!r} describes {total} {self.dtype.name} "
                f"ids ({total * itemsize} bytes): the two files do not belong together."
            )
        if total == 0:
            raise ValueError(f"The Megatron indexed dataset {bin_path!r} holds no tokens.")

    @property
    def sequence_ends(self) -> np.ndarray:
        """``int64 [S]``: the end of each sequence in ``prefix.bin``, in ids."""
        return np.cumsum(self.sequence_lengths, dtype=np.int64)

    def document_spans(self) -> tuple[np.ndarray, np.ndarray]:
        """``int64 [D]`` start and end (exclusive) of every document in ``prefix.bin``, in ids."""
        bounds = np.concatenate([[0], self.sequence_ends])[self.document_indices]
        return bounds[:-1], bounds[1:]


class MegatronIndexedDataset(_TokenSpans):
    """The documents of a Megatron-LM / NeMo indexed dataset (``prefix.bin`` + ``prefix.idx``) as samples.

    Document boundaries and the dtype come from ``prefix.idx`` (see the module docstring), so nothing has to
    be passed about how the files were written. Every document is a sample; one longer than ``seq_len`` is
    cut into pieces of ``seq_len`` ids plus a shorter last piece (as :class:`TokenFileDataset` cuts
    EOS-delimited documents), and empty documents are skipped. Use the samples with ``collate_packed`` (or
    ``collate_padded``).

    Args:
        prefix: the path without extension, as given to Megatron's ``--data-path``, e.g.
            ``data/train_text_document`` for ``data/train_text_document.bin`` and ``.idx``.
        seq_len: the longest sample; longer documents are cut.
        vocab_size: if given, every id must be ``< vocab_size``; checked once by a sequential scan of
            ``prefix.bin``.

    Each item is ``{"input_ids": int64 [L], "loss_mask": float32 [L]}`` with ``1 <= L <= seq_len``. Only the
    index arrays are read at construction; ``prefix.bin`` is memory-mapped lazily in each process and not
    pickled.

    Raises:
        ValueError: if a file is missing, ``prefix.idx`` is not a valid index of integer ids, the two files
            do not match, the dataset is empty, ``seq_len < 1``, or an id is ``>= vocab_size``.
    """

    def __init__(self, prefix: str | os.PathLike, seq_len: int, vocab_size: int | None = None) -> None:
        _check_seq_len(seq_len)
        index = _MegatronIndex.read(prefix)
        super().__init__(os.fspath(prefix) + ".bin", index.dtype)
        self.prefix = os.fspath(prefix)
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self._scan(vocab_size, eos_id=None)
        self._starts, self._lengths = _document_pieces(*index.document_spans(), seq_len)


def _is_megatron_prefix(path: str | os.PathLike) -> bool:
    """Whether ``path`` names a Megatron indexed dataset by its prefix (``path.idx`` exists)."""
    return os.path.isfile(os.fspath(path) + ".idx")
