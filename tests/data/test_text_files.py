"""``text_files``: a record's line as an editor shows it, and the line or record a bad JSON file fails at."""

from __future__ import annotations

import json

import pytest

from lightning_cp.data.text_files import check_first_record, load_records, record_location

datasets = pytest.importorskip("datasets")


def test_a_record_is_located_at_its_line_blank_lines_counted(tmp_path):
    file = tmp_path / "data.jsonl"
    file.write_text('{"text": "a"}\n\n   \n{"text": "b"}\n{"text": "c"}\n')
    records = load_records("path", str(file), str(tmp_path / "cache"))
    assert records["text"] == ["a", "b", "c"]  # datasets skips the blank lines: index 1 is "b", on line 4
    assert [record_location("path", str(file), index) for index in range(3)] == ["line 1", "line 4", "line 5"]


def test_json_arrays_are_located_by_record_and_their_syntax_errors_by_line(tmp_path):
    file = tmp_path / "data.json"
    file.write_text('[\n  {"text": "a"},\n  {"text": "b"}\n]\n')
    assert load_records("path", str(file), str(tmp_path / "cache"))["text"] == ["a", "b"]
    assert record_location("path", str(file), 1) == "record 2"
    check_first_record(
        "path", str(file), "messages", chat=True
    )  # an array's first record is left to datasets

    file = tmp_path / "missing_comma.json"
    file.write_text('[\n  {"text": "a"}\n  {"text": "b"}\n]\n')
    with pytest.raises(
        ValueError, match=r"comma.json' line 3 is not JSON \(Expecting ',' delimiter, at column 3\)"
    ):
        load_records("path", str(file), str(tmp_path / "cache"))
    file = tmp_path / "latin1.json"
    file.write_bytes(b'[\n  {"text": "a"},\n  {"text": "\xff"}\n]\n')
    with pytest.raises(ValueError, match=r"line 3: byte 13 of the line \(b'\\xff'\) is not UTF-8"):
        load_records("path", str(file), str(tmp_path / "cache"))


def test_parquet_rows_are_located_from_zero(tmp_path):
    file = tmp_path / "data.parquet"
    datasets.Dataset.from_list([{"text": "a"}, {"text": "b"}]).to_parquet(str(file))
    assert record_location("val_path", str(file), 1) == "row 1 (counting from 0)"


def test_the_first_record_is_checked_in_the_format_it_is_read(tmp_path):
    file = tmp_path / "data.jsonl"
    file.write_text(json.dumps({"text": ["not", "a", "string"]}) + "\n")
    with pytest.raises(ValueError, match=r"line 1: the document is a list, not a string; write the text as"):
        check_first_record("path", str(file), "text", chat=False)
    file.write_text("\n" + json.dumps({"messages": [{"content": "hi"}]}) + "\n")
    with pytest.raises(
        ValueError, match=r"line 2: message 0 has no 'role' \(its keys: \['content'\]\); write"
    ):
        check_first_record("path", str(file), "messages", chat=True)
