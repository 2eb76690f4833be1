import json
import pickle

import numpy as np
import pytest
import torch

import lightning_cp.data._token_spans as token_spans
from lightning_cp.data import TokenFileDataset, write_token_file


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
        TokenFileDataset(path, seq_len=6, dtype="uint16")


@pytest.mark.parametrize("chunk", [None, 4])
def test_out_of_vocab_id_is_named(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(token_spans, "_SAMPLE_BLOCKS", 1)  # the constructor's sample: ids 0 and 1 only,
    monkeypatch.setattr(token_spans, "_SAMPLE_BLOCK", 2)  # so that the full scan must find the bad id
    if chunk is not None:  # the scan must find the maximum in a later chunk too
        monkeypatch.setattr(token_spans, "_SCAN_CHUNK", chunk)
    tokens = np.arange(30) % 7
    tokens[17] = 999
    path = _write(tmp_path / "tok.bin", tokens, "uint16")
    with pytest.raises(ValueError, match=r"token id 999 \(at position 17\).*vocab_size=500"):
        TokenFileDataset(path, seq_len=5, dtype="uint16", vocab_size=500)
    assert len(TokenFileDataset(path, seq_len=5, dtype="uint16", vocab_size=1000)) == 6


@pytest.mark.parametrize("chunk", [None, 3])
def test_documents_split_at_eos_and_long_ones_are_cut(tmp_path, monkeypatch, chunk):
    if chunk is not None:  # EOS positions found across scan-chunk boundaries
        monkeypatch.setattr(token_spans, "_SCAN_CHUNK", chunk)
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
    ds = TokenFileDataset(path, seq_len=3, dtype="uint16", eos_id=0)
    assert [ds[i]["input_ids"].tolist() for i in range(len(ds))] == _reference_pieces(tokens, 0, 3)


def test_bad_eos_id(tmp_path):
    path = _write(tmp_path / "tok.bin", [1, 2, 3, 4], "uint16")
    with pytest.raises(ValueError, match="eos_id=9 never occurs"):
        TokenFileDataset(path, seq_len=2, dtype="uint16", eos_id=9)
    with pytest.raises(ValueError, match="eos_id=20 is not a valid id.*vocab_size=10"):
        TokenFileDataset(path, seq_len=2, dtype="uint16", eos_id=20, vocab_size=10)
    with pytest.raises(ValueError, match="eos_id=70000 is not a valid id for dtype='uint16'"):
        TokenFileDataset(path, seq_len=2, dtype="uint16", eos_id=70000)


def test_pickling_does_not_carry_the_file(tmp_path):
    tokens = np.arange(4000) % 1000
    path = _write(tmp_path / "tok.bin", tokens, "uint16")
    ds = TokenFileDataset(path, seq_len=100, dtype="uint16")
    first = ds[0]["input_ids"]  # opens the memory map
    blob = pickle.dumps(ds)
    assert len(blob) < tokens.size  # far smaller than the 8000-byte file
    clone = pickle.loads(blob)
    assert torch.equal(clone[0]["input_ids"], first)
    assert clone[39]["input_ids"].tolist() == tokens[3900:].tolist()


@pytest.mark.parametrize("eos_id", [None, 1])
def test_empty_file_is_reported_as_empty(tmp_path, eos_id):
    path = tmp_path / "empty.bin"
    path.write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty.bin' is empty \(0 bytes\): it holds no tokens"):
        TokenFileDataset(path, seq_len=4, dtype="uint16", vocab_size=10, eos_id=eos_id)


def test_missing_path_directory_and_megatron_prefix_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"nope.bin' does not exist; pass a token file"):
        TokenFileDataset(tmp_path / "nope.bin", seq_len=4, dtype="uint16")
    with pytest.raises(ValueError, match="is a directory"):
        TokenFileDataset(tmp_path, seq_len=4, dtype="uint16")
    (tmp_path / "corpus.idx").write_bytes(b"")
    with pytest.raises(ValueError, match="does not exist.*prefix of a Megatron indexed dataset"):
        TokenFileDataset(tmp_path / "corpus", seq_len=4, dtype="uint16")


@pytest.mark.parametrize("name", ["corpus.bin", "corpus.idx"])
def test_one_file_of_a_megatron_dataset_is_refused(tmp_path, name):
    _write(tmp_path / "corpus.bin", np.arange(64), "uint16")
    (tmp_path / "corpus.idx").write_bytes(b"MMIDIDX")
    prefix = str(tmp_path / "corpus")
    with pytest.raises(ValueError, match=f"one of the two files of the Megatron .*path='{prefix}'"):
        TokenFileDataset(tmp_path / name, seq_len=4, dtype="uint16")


def test_without_a_sidecar_the_dtype_must_be_given(tmp_path):
    path = _write(tmp_path / "tok.bin", np.arange(100) % 50, "uint16")
    with pytest.raises(
        ValueError, match=r"no sidecar '.*tok.bin.json'.*pass dtype='uint16' or dtype='uint32'"
    ):
        TokenFileDataset(path, seq_len=10)


_RNG = np.random.default_rng(0)
_ZIPF = np.minimum(_RNG.zipf(1.3, size=20_000), 50_000)  # text-like ids: many small ones, a long tail


@pytest.mark.parametrize(
    "tokens", [_RNG.integers(0, 5, size=20_000), _RNG.integers(0, 50257, size=100_000), _ZIPF]
)
def test_uint32_file_read_as_uint16_is_refused(tmp_path, tokens):
    path = _write(tmp_path / "tok.bin", tokens, "uint32")
    with pytest.raises(ValueError, match=r"looks like a uint32 file.*Pass dtype='uint32'"):
        TokenFileDataset(path, seq_len=10, dtype="uint16")
    ds = TokenFileDataset(path, seq_len=10, dtype="uint32")
    assert ds[7]["input_ids"].tolist() == tokens[70:80].tolist()


def test_large_vocabulary_uint32_file_read_as_uint16_is_refused(tmp_path):
    tokens = _RNG.integers(0, 152064, size=50_000)  # high halves 0, 1 or 2
    path = _write(tmp_path / "tok.bin", tokens, "uint32")
    with pytest.raises(ValueError, match="looks like a uint32 file"):
        TokenFileDataset(path, seq_len=10, dtype="uint16")


@pytest.mark.parametrize(
    "tokens",
    [
        _RNG.integers(0, 2, size=20_000),
        _RNG.integers(0, 5, size=20_000),
        _RNG.integers(0, 65536, size=20_000),
        _ZIPF,
        np.arange(40) % 16,  # few pairs: every second id small, but no smaller than the others
    ],
)
def test_uint16_files_are_not_mistaken_for_uint32(tmp_path, tokens):
    path = _write(tmp_path / "tok.bin", tokens, "uint16")
    assert len(TokenFileDataset(path, seq_len=4, dtype="uint16")) == len(tokens) // 4


@pytest.mark.parametrize(
    ("vocab_size", "dtype"), [(300, "uint16"), (65536, "uint16"), (65537, "uint32"), (152064, "uint32")]
)
def test_write_token_file_records_the_dtype_in_a_sidecar(tmp_path, vocab_size, dtype):
    tokens = _RNG.integers(0, vocab_size, size=1000)
    tokens[-1] = vocab_size - 1
    path = tmp_path / "tok.bin"
    assert write_token_file(path, tokens, vocab_size=vocab_size, eos_id=0) == dtype
    sidecar = json.loads((tmp_path / "tok.bin.json").read_text())
    assert sidecar == {"dtype": dtype, "num_tokens": 1000, "vocab_size": vocab_size, "eos_id": 0}
    assert np.fromfile(path, dtype=dtype).tolist() == tokens.tolist()
    ds = TokenFileDataset(path, seq_len=100, vocab_size=vocab_size)  # the dtype comes from the sidecar
    assert ds.dtype == dtype
    assert torch.cat([ds[i]["input_ids"] for i in range(len(ds))]).tolist() == tokens.tolist()
    assert len(TokenFileDataset(path, seq_len=100, dtype=dtype)) == 10


def test_arguments_that_contradict_the_sidecar_are_refused(tmp_path):
    path = tmp_path / "tok.bin"
    write_token_file(path, np.arange(100) % 50, vocab_size=50, eos_id=49)
    with pytest.raises(
        ValueError, match=r"dtype='uint32' contradicts the sidecar '.*tok.bin.json'.*'uint16'"
    ):
        TokenFileDataset(path, seq_len=10, dtype="uint32")
    with pytest.raises(ValueError, match="vocab_size=40 is smaller than the vocab_size=50 recorded"):
        TokenFileDataset(path, seq_len=10, vocab_size=40)
    with pytest.raises(ValueError, match="eos_id=3 contradicts the eos_id=49 recorded"):
        TokenFileDataset(path, seq_len=10, eos_id=3)
    assert len(TokenFileDataset(path, seq_len=10, dtype="uint16", vocab_size=64)) == 10  # a padded vocabulary
    assert len(TokenFileDataset(path, seq_len=50, eos_id=49)) == 2


def test_a_sidecar_of_another_version_of_the_file_is_refused(tmp_path):
    path = tmp_path / "tok.bin"
    write_token_file(path, np.arange(100), vocab_size=100)
    np.arange(100, dtype=np.uint32).tofile(path)  # rewritten as uint32, sidecar left as it was
    with pytest.raises(
        ValueError, match=r"holds 200 uint16 tokens, but the sidecar .* records num_tokens=100"
    ):
        TokenFileDataset(path, seq_len=10)


@pytest.mark.parametrize(
    ("tokens", "kwargs", "match"),
    [
        ([1, 2, 300], {"vocab_size": 300}, r"holds id 300 \(at position 2\), outside \[0, vocab_size=300\)"),
        ([1, -2, 3], {"vocab_size": 300}, r"holds id -2 \(at position 1\)"),
        ([1, 2, 3], {"vocab_size": 300, "eos_id": 300}, r"eos_id=300 must be in \[0, vocab_size=300\)"),
        ([], {"vocab_size": 300}, "non-empty 1-D array of integer ids"),
        ([[1, 2]], {"vocab_size": 300}, "non-empty 1-D array"),
        ([1.0, 2.0], {"vocab_size": 300}, "of float64"),
        ([1, 2], {"vocab_size": (1 << 32) + 1}, r"vocab_size=4294967297 must be in \[1, 2\*\*32\]"),
    ],
)
def test_write_token_file_rejects_bad_input(tmp_path, tokens, kwargs, match):
    with pytest.raises(ValueError, match=match):
        write_token_file(tmp_path / "tok.bin", tokens, **kwargs)
    assert not (tmp_path / "tok.bin").exists()


def test_rewriting_replaces_the_sidecar(tmp_path):
    path = tmp_path / "tok.bin"
    write_token_file(path, np.arange(100), vocab_size=100, eos_id=99)
    write_token_file(path, np.arange(70_000, 70_010), vocab_size=70_010)
    assert json.loads((tmp_path / "tok.bin.json").read_text())["dtype"] == "uint32"
    assert TokenFileDataset(path, seq_len=10)[0]["input_ids"].tolist() == list(range(70_000, 70_010))


def test_an_interrupted_rewrite_leaves_no_stale_sidecar(tmp_path):
    path = tmp_path / "tok.bin"
    write_token_file(path, np.arange(100), vocab_size=100)
    path.unlink()
    path.mkdir()  # writing the ids now fails, after the old sidecar was removed and before the new one
    with pytest.raises(IsADirectoryError):
        write_token_file(path, np.arange(100), vocab_size=100)
    assert not (tmp_path / "tok.bin.json").exists()
