import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

from lightning_cp.data import MegatronIndexedDataset
from lightning_cp.data.megatron_indexed import _MegatronIndex
from tests.data._megatron import megatron_documents, random_documents, write_megatron_dataset


def _pieces(documents, seq_len):
    return [doc[i : i + seq_len] for doc in documents for i in range(0, len(doc), seq_len)]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64, np.uint8])
def test_index_matches_megatrons_reader(tmp_path, dtype):
    rng = np.random.default_rng(0)
    high = min(np.iinfo(dtype).max, 100_000)
    prefix = write_megatron_dataset(tmp_path / "corpus", random_documents(rng, 40, high), dtype)
    index = _MegatronIndex.read(prefix)
    reference = IndexedDataset(prefix)
    assert index.dtype == np.dtype(reference.index.dtype)
    np.testing.assert_array_equal(index.sequence_lengths, reference.sequence_lengths)
    np.testing.assert_array_equal(index.sequence_pointers, reference.index.sequence_pointers)
    np.testing.assert_array_equal(index.document_indices, reference.document_indices)


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
@pytest.mark.parametrize("seq_len", [1000, 5, 1])
def test_every_document_is_a_sample_cut_at_seq_len(tmp_path, dtype, seq_len):
    rng = np.random.default_rng(1)
    documents = [
        [[7, 8, 9]],
        [],
        [[], [1, 2]],
        rng.integers(0, 60_000, size=23),
        *random_documents(rng, 30, 60_000),
    ]
    prefix = write_megatron_dataset(tmp_path / "corpus", documents, dtype)
    ds = MegatronIndexedDataset(prefix, seq_len=seq_len, vocab_size=60_000)
    expected = _pieces(megatron_documents(prefix), seq_len)
    assert len(ds) == len(expected)
    for i, piece in enumerate(expected):
        sample = ds[i]
        assert sample["input_ids"].dtype == torch.int64 and sample["input_ids"].tolist() == piece
        assert sample["loss_mask"].dtype == torch.float32 and sample["loss_mask"].tolist() == [1.0] * len(
            piece
        )
    if seq_len == 1000:  # whole documents: the sentences of a document are one sample, empty ones are skipped
        assert [ds[i]["input_ids"].tolist() for i in range(3)] == [[7, 8, 9], [1, 2], documents[3].tolist()]


def test_datasets_merged_by_megatron_read_back_as_their_documents(tmp_path):
    rng = np.random.default_rng(2)
    parts = [
        write_megatron_dataset(tmp_path / f"part{k}", random_documents(rng, 20, 500), np.uint16)
        for k in range(2)
    ]
    builder = IndexedDatasetBuilder(str(tmp_path / "merged.bin"), dtype=np.uint16)
    for part in parts:
        builder.add_index(part)
    builder.finalize(str(tmp_path / "merged.idx"))
    ds = MegatronIndexedDataset(tmp_path / "merged", seq_len=4)
    expected = _pieces(megatron_documents(tmp_path / "merged"), 4)
    assert expected == _pieces(megatron_documents(parts[0]) + megatron_documents(parts[1]), 4)
    assert [ds[i]["input_ids"].tolist() for i in range(len(ds))] == expected


def test_out_of_vocab_id_is_named(tmp_path):
    prefix = write_megatron_dataset(tmp_path / "corpus", [[[1, 2, 3]], [[4, 999, 5]]])
    with pytest.raises(ValueError, match=r"corpus.bin' holds token id 999 \(at position 4\).*vocab_size=999"):
        MegatronIndexedDataset(prefix, seq_len=8, vocab_size=999)
    assert len(MegatronIndexedDataset(prefix, seq_len=8, vocab_size=1000)) == 2


def test_pickling_does_not_carry_the_file(tmp_path):
    documents = [np.arange(1000, dtype=np.int64) + k for k in range(4)]
    prefix = write_megatron_dataset(tmp_path / "corpus", documents)
    ds = MegatronIndexedDataset(prefix, seq_len=100)
    first = ds[0]["input_ids"]  # opens the memory map
    blob = pickle.dumps(ds)
    assert len(blob) < 4000  # far smaller than the 16000-byte .bin
    clone = pickle.loads(blob)
    assert torch.equal(clone[0]["input_ids"], first)
    assert clone[39]["input_ids"].tolist() == list(range(903, 1003))


def _header(code=4, sequences=1, doc_indices=2, version=1):
    return b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", version, code, sequences, doc_indices)


def _corrupt(prefix, case):
    """Break ``prefix`` (one sequence of three int32 ids, one document) in the way ``case`` names."""
    idx, bin_ = Path(prefix + ".idx"), Path(prefix + ".bin")
    arrays = idx.read_bytes()[34:]  # lengths [1] int32, pointers [1] int64, document indices [2] int64
    if case == "missing-bin":
        bin_.unlink()
    elif case == "magic":
        idx.write_bytes(b"NOTANIDX" + idx.read_bytes()[8:])
    elif case == "bin-size":
        bin_.write_bytes(bin_.read_bytes() + b"\x00" * 4)
    else:
        idx.write_bytes(
            {
                "version": _header(version=2) + arrays,
                "float": _header(code=7) + arrays,
                "truncated": _header() + arrays[:-1],
                "pointers": _header() + arrays[:4] + struct.pack("<q", 4) + arrays[12:],
                "documents": _header() + arrays[:12] + struct.pack("<qq", 0, 2),
                "unordered-documents": _header(doc_indices=4) + arrays[:12] + struct.pack("<4q", 0, 1, 0, 1),
            }[case]
        )


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("missing-bin", r"corpus.bin' does not exist: a Megatron indexed dataset needs both"),
        ("magic", "is not a Megatron index: it does not start with"),
        ("version", "has index version 2; only version 1"),
        ("float", "records dtype code 7, not an integer type"),
        ("truncated", "is truncated: 61 bytes, but its header announces 1 sequences"),
        ("bin-size", r"corpus.bin' has 16 bytes, but .* describes 3 int32 ids \(12 bytes\)"),
        ("pointers", "do not lie back to back"),
        ("documents", "invalid document indices"),
        ("unordered-documents", "invalid document indices"),
    ],
)
def test_corrupt_or_mismatched_files_are_named(tmp_path, case, match):
    prefix = write_megatron_dataset(tmp_path / "corpus", [[[1, 2, 3]]])
    assert len(MegatronIndexedDataset(prefix, seq_len=8)) == 1
    _corrupt(prefix, case)
    with pytest.raises(ValueError, match=match):
        MegatronIndexedDataset(prefix, seq_len=8)


def test_empty_dataset_and_bad_seq_len(tmp_path):
    prefix = write_megatron_dataset(tmp_path / "corpus", [[[]], []])
    with pytest.raises(ValueError, match="holds no tokens"):
        MegatronIndexedDataset(prefix, seq_len=8)
    with pytest.raises(ValueError, match="seq_len=0 must be at least 1"):
        MegatronIndexedDataset(prefix, seq_len=0)
