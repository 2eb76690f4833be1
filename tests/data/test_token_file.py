import pickle

import numpy as np
import pytest
import torch

import lightning_cp.data.token_file as token_file
from lightning_cp.data import TokenFileDataset


def _write(path, tokens, dtype):
    np.asarray(tokens, dtype=dtype).tofile(path)
    return path


def _reference_pieces(tokens, eos_id, seq_len):
    """Plain-Python split: documents end after each EOS, then are cut into seq_len pieces."""
    docs, current = [], []
    for t in tokens:
        current.append(int(t))
        if t == eos_id:
            docs.append(current)
            current = []
    if current:
        docs.append(current)
    return [doc[i : i + seq_len] for doc in docs for i in range(0, len(doc), seq_len)]


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_windows_match_the_raw_file(tmp_path, dtype):
    high = 65536 if dtype == "uint16" else 1 << 31  # uint32 ids above 2**16 catch a misread dtype
    tokens = np.random.default_rng(0).integers(0, high, size=103)
    path = _write(tmp_path / "tok.bin", tokens, dtype)
    ds = TokenFileDataset(path, seq_len=10, dtype=dtype)
    raw = np.fromfile(path, dtype=dtype).astype(np.int64)
    assert len(ds) == 10  # the 3-token tail is dropped
    for i in range(len(ds)):
        sample = ds[i]
        assert sample["input_ids"].dtype == torch.int64
        assert sample["input_ids"].tolist() == raw[10 * i : 10 * i + 10].tolist()
        assert sample["loss_mask"].dtype == torch.float32 and sample["loss_mask"].tolist() == [1.0] * 10


def test_file_size_not_a_multiple_of_the_dtype(tmp_path):
    path = tmp_path / "odd.bin"
    path.write_bytes(b"\x01" * 7)
    with pytest.raises(ValueError, match=r"7 bytes\) is not a multiple of 2 bytes.*dtype='uint16'"):
        TokenFileDataset(path, seq_len=2, dtype="uint16")
    _write(path, np.arange(5), "uint16")  # 10 bytes: fine as uint16, not as uint32
    with pytest.raises(ValueError, match=r"10 bytes\) is not a multiple of 4 bytes.*dtype='uint32'"):
        TokenFileDataset(path, seq_len=2, dtype="uint32")


def test_unsupported_dtype_and_short_file(tmp_path):
    path = _write(tmp_path / "tok.bin", np.arange(5), "uint16")
    with pytest.raises(ValueError, match="dtype='int32' is not supported"):
        TokenFileDataset(path, seq_len=2, dtype="int32")
    with pytest.raises(ValueError, match="holds 5 tokens, fewer than one window of seq_len=6"):
        TokenFileDataset(path, seq_len=6)


@pytest.mark.parametrize("chunk", [None, 4])
def test_out_of_vocab_id_is_named(tmp_path, monkeypatch, chunk):
    if chunk is not None:  # the scan must find the maximum in a later chunk too
        monkeypatch.setattr(token_file, "_SCAN_CHUNK", chunk)
    tokens = np.arange(30) % 7
    tokens[17] = 999
    path = _write(tmp_path / "tok.bin", tokens, "uint16")
    with pytest.raises(ValueError, match=r"token id 999 \(at position 17\).*vocab_size=500"):
        TokenFileDataset(path, seq_len=5, vocab_size=500)
    assert len(TokenFileDataset(path, seq_len=5, vocab_size=1000)) == 6


@pytest.mark.parametrize("chunk", [None, 3])
def test_documents_split_at_eos_and_long_ones_are_cut(tmp_path, monkeypatch, chunk):
    if chunk is not None:  # EOS positions found across scan-chunk boundaries
        monkeypatch.setattr(token_file, "_SCAN_CHUNK", chunk)
    eos = 0
    # Documents of 3 and 1 tokens, of 5 (> seq_len) and 10 (> 2 * seq_len) tokens, then a tail without EOS.
    tokens = [5, 6, eos, eos, 1, 2, 3, 4, eos, 7, 8, 9, 10, 11, 12, 13, 14, 15, eos, 3, 3]
    path = _write(tmp_path / "tok.bin", tokens, "uint32")
    ds = TokenFileDataset(path, seq_len=4, dtype="uint32", eos_id=eos, vocab_size=16)
    expected = _reference_pieces(tokens, eos, 4)
    assert [ds[i]["input_ids"].tolist() for i in range(len(ds))] == expected
    assert [ds[i]["loss_mask"].sum().item() for i in range(len(ds))] == [len(p) for p in expected]


def test_random_documents_match_reference(tmp_path):
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 6, size=500)  # eos_id=0: about one token in six ends a document
    path = _write(tmp_path / "tok.bin", tokens, "uint16")
    ds = TokenFileDataset(path, seq_len=3, eos_id=0)
    assert [ds[i]["input_ids"].tolist() for i in range(len(ds))] == _reference_pieces(tokens, 0, 3)


def test_bad_eos_id(tmp_path):
    path = _write(tmp_path / "tok.bin", [1, 2, 3, 4], "uint16")
    with pytest.raises(ValueError, match="eos_id=9 never occurs"):
        TokenFileDataset(path, seq_len=2, eos_id=9)
    with pytest.raises(ValueError, match="eos_id=20 is not a valid id.*vocab_size=10"):
        TokenFileDataset(path, seq_len=2, eos_id=20, vocab_size=10)
    with pytest.raises(ValueError, match="eos_id=70000 is not a valid id for dtype='uint16'"):
        TokenFileDataset(path, seq_len=2, eos_id=70000)


def test_pickling_does_not_carry_the_file(tmp_path):
    tokens = np.arange(4000) % 1000
    path = _write(tmp_path / "tok.bin", tokens, "uint16")
    ds = TokenFileDataset(path, seq_len=100)
    first = ds[0]["input_ids"]  # opens the memory map
    blob = pickle.dumps(ds)
    assert len(blob) < tokens.size  # far smaller than the 8000-byte file
    clone = pickle.loads(blob)
    assert torch.equal(clone[0]["input_ids"], first)
    assert clone[39]["input_ids"].tolist() == tokens[3900:].tolist()


def test_empty_file(tmp_path):
    path = tmp_path / "empty.bin"
    path.write_bytes(b"")
    with pytest.raises(ValueError, match="holds 0 tokens"):
        TokenFileDataset(path, seq_len=4, vocab_size=10)
    with pytest.raises(ValueError, match="eos_id=1 never occurs"):
        TokenFileDataset(path, seq_len=4, vocab_size=10, eos_id=1)
