"""The sidecar schema of a flat token file: what is written, what is read, what is refused."""

import json

import numpy as np
import pytest

from lightning_cp.data import TokenFileDataset
from lightning_cp.data.token_file_sidecar import TokenFileSidecar


def test_a_written_record_reads_back_and_optional_keys_may_be_left_out(tmp_path):
    path = tmp_path / "tok.bin"
    assert TokenFileSidecar.read(path) is None
    record = TokenFileSidecar(dtype="uint32", num_tokens=7, vocab_size=70_000, eos_id=3)
    record.write(path)
    assert json.loads((tmp_path / "tok.bin.json").read_text()) == {
        "dtype": "uint32",
        "num_tokens": 7,
        "vocab_size": 70_000,
        "eos_id": 3,
    }
    assert TokenFileSidecar.read(path) == record
    (tmp_path / "tok.bin.json").write_text(json.dumps({"num_tokens": 5, "dtype": "uint16"}))
    assert TokenFileSidecar.read(path) == TokenFileSidecar(dtype="uint16", num_tokens=5)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("{not json", "is not valid JSON"),
        (json.dumps({"dtype": "uint16"}), r"has keys \['dtype'\]; it needs \['dtype', 'num_tokens'\]"),
        (json.dumps({"dtype": "uint16", "num_tokens": 50, "vocab": 5}), "'vocab'.*nothing else"),
        (json.dumps([1, 2]), "has keys list"),
        (
            json.dumps({"dtype": "int32", "num_tokens": 50}),
            "dtype='int32', which must be 'uint16' or 'uint32'",
        ),
        (json.dumps({"dtype": "uint16", "num_tokens": "50"}), "num_tokens='50', which must be an integer"),
        (
            json.dumps({"dtype": "uint16", "num_tokens": 50, "eos_id": -1}),
            "eos_id=-1, which must be null or >= 0",
        ),
    ],
)
def test_malformed_sidecars_are_named(tmp_path, content, match):
    path = tmp_path / "tok.bin"
    np.arange(50, dtype=np.uint16).tofile(path)
    (tmp_path / "tok.bin.json").write_text(content)
    with pytest.raises(ValueError, match=r"The sidecar '.*tok.bin.json' of path=.*" + match):
        TokenFileDataset(path, seq_len=10)
