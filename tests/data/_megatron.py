"""Megatron indexed datasets for the tests, written and read back by Megatron-core itself (the reference)."""

from __future__ import annotations

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder


def write_megatron_dataset(prefix, documents, dtype=np.int32) -> str:
    """Write ``prefix.bin`` + ``prefix.idx`` with Megatron's ``IndexedDatasetBuilder``; returns the prefix.

    ``documents`` is a list of documents, each a list of sequences (lists of ids, possibly empty); a document
    given as a 1-D array goes through ``add_document`` as one sequence instead.
    """
    prefix = str(prefix)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for document in documents:
        if isinstance(document, np.ndarray):
            builder.add_document(torch.from_numpy(document), [len(document)])
            continue
        for sequence in document:
            builder.add_item(torch.tensor(sequence, dtype=torch.int64))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def megatron_documents(prefix) -> list[list[int]]:
    """Every document as Megatron's ``IndexedDataset`` reads it: the concatenation of its sequences."""
    reference = IndexedDataset(str(prefix))
    bounds = reference.document_indices
    return [
        [int(t) for i in range(bounds[d], bounds[d + 1]) for t in reference[i]]
        for d in range(len(bounds) - 1)
    ]


def random_documents(rng: np.random.Generator, num_docs: int, high: int) -> list[list[list[int]]]:
    """Documents of 0-3 sequences of 0-12 ids in ``[0, high)`` (so some documents and sequences are empty)."""
    return [
        [rng.integers(0, high, size=rng.integers(0, 13)).tolist() for _ in range(rng.integers(0, 4))]
        for _ in range(num_docs)
    ]
