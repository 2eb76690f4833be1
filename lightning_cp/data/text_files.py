"""The files ``TextDataModule`` and ``RolloutDataModule`` read: checked where they are built, read and
tokenized once with ``datasets`` (:func:`tokenize_records`, the one path of both), records located.

``datasets`` reports a JSON file's mistakes without the file or the line (an empty file raises a bare
``StopIteration``, a byte that is not UTF-8 a ``UnicodeDecodeError`` of its own buffer, a line that is not
JSON a ``DatasetGenerationError``). :func:`load_records` finds the first such line when ``datasets`` fails
and names the file, the line and the fix; :func:`check_first_record` reads only the first record of a
JSON-lines file, cheaply enough for a constructor, so that a file of the wrong shape fails before launch;
:func:`record_location` turns a record's index into the line (or row) a message names.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from lightning_cp.constants import INPUT_IDS
from lightning_cp.data.chat_messages import normalize_messages
from lightning_cp.data.tokenization import RecordError, cache_fingerprint, not_a_document

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
"""File extension -> the ``datasets`` builder that reads it."""
LENGTH = "length"
"""The column of a tokenized file that holds each row's number of tokens (:func:`tokenize_records`)."""


def check_file(name: str, file: str) -> None:
    """``file`` (the argument ``name``) exists and has an extension of :data:`BUILDERS`.

    Raises:
        ValueError: it does not exist, or has another extension.
    """
    if not os.path.isfile(file):
        raise ValueError(f"{name}={file!r} does not exist; pass a .jsonl, .json, .parquet or .arrow file.")
    extension = os.path.splitext(file)[1]
    if extension not in BUILDERS:
        raise ValueError(
            f"{name}={file!r} has the extension {extension!r}; pass a {', '.join(BUILDERS)} file."
        )


def check_first_record(name: str, file: str, column: str, chat: bool) -> None:
    """The first record of a JSON-lines ``file`` holds ``column``, a document (a string) or, ``chat``, a
    conversation (:func:`~lightning_cp.data.chat_messages.normalize_messages`). A ``.parquet`` / ``.arrow``
    file or a ``.json`` array is left to :func:`load_records` (its first record is not cheap to read).

    Raises:
        ValueError: the file is empty, its first non-blank line is not UTF-8 or not a JSON object, or that
            record lacks ``column`` or holds something else; naming the file, the line and the fix.
    """
    first = first_json_record(name, file)
    if first is None:
        return
    location, record = first
    if record.get(column) is None:
        keys = sorted(key for key, value in record.items() if value is not None)
        raise ValueError(
            f"{name}={file!r} {location} has no {column!r} (its keys: {keys}); set column to the one holding "
            f"the {'conversations' if chat else 'documents'}."
        )
    try:
        if chat:
            normalize_messages(record[column])
        elif not isinstance(record[column], str):
            raise ValueError(not_a_document(record[column]))
    except ValueError as error:
        raise ValueError(f"{name}={file!r} {location}: {error}") from None


def first_json_record(name: str, file: str) -> tuple[str, dict[str, Any]] | None:
    """``(location, record)`` of the first record of a JSON-lines ``file`` (the argument ``name``), read alone;
    ``None`` for a ``.parquet`` / ``.arrow`` file or a ``.json`` array, whose first record is not cheap to read.

    Raises:
        ValueError: the file is empty, or its first non-blank line is not UTF-8 or not a JSON object.
    """
    if BUILDERS[os.path.splitext(file)[1]] != "json" or _first_byte(file) == b"[":
        return None
    first = next(_json_records(name, file), None)
    if first is None:
        raise _empty(name, file)
    return first


def file_columns(name: str, file: str) -> list[str] | None:
    """The columns of ``file`` (the argument ``name``) without reading its records: the keys with a value of
    a JSON-lines file's first record, the schema of a ``.parquet`` / ``.arrow`` file; ``None`` for a ``.json``
    array (its first record is not cheap to read).

    Raises:
        ValueError: as :func:`first_json_record`.
    """
    builder = BUILDERS[os.path.splitext(file)[1]]
    if builder == "parquet":
        import pyarrow.parquet

        return list(pyarrow.parquet.read_schema(file).names)
    if builder == "arrow":
        import pyarrow

        with open(file, "rb") as f:
            try:  # datasets writes the stream format; the file format is read too
                return list(pyarrow.ipc.open_stream(f).schema.names)
            except pyarrow.ArrowInvalid:
                f.seek(0)
                return list(pyarrow.ipc.open_file(f).schema.names)
    first = first_json_record(name, file)
    return None if first is None else [key for key, value in first[1].items() if value is not None]


def load_records(name: str, file: str, cache_dir: str | None) -> Any:
    """``file`` as a ``datasets.Dataset`` (``datasets.load_dataset``; cached in ``cache_dir``).

    Raises:
        ValueError: the file holds no record, or (a JSON file ``datasets`` fails on) its first line that is
            not UTF-8 or not a JSON object (:func:`check_json_lines`). Other failures of ``datasets`` are
            raised as they are.
    """
    import datasets

    try:
        records = datasets.load_dataset(
            BUILDERS[os.path.splitext(file)[1]], data_files=file, split="train", cache_dir=cache_dir
        )
    except Exception:  # datasets' own exceptions, StopIteration included, name neither file nor line
        check_json_lines(name, file)
        raise
    if len(records) == 0:
        raise _empty(name, file) from None
    return records


def tokenize_records(
    name: str,
    file: str,
    raw: Any,
    tokenize: Callable[[Any, list[int]], dict[str, list]],
    *,
    tokenizer: str | None,
    key: Sequence[str],
    description: str,
    column: str | None = None,
) -> Any:
    """``raw``, the records of ``file`` (the argument ``name``; :func:`load_records`), tokenized once: a batched
    ``datasets`` map of ``tokenize(values, indices)`` (``values``: the records' ``column``, or without one the
    records as a dict of columns; ``indices``: their indices in the file), whose rows hold ``input_ids``, plus
    each row's length (:data:`LENGTH`). ``datasets`` caches the result under
    :func:`~lightning_cp.data.tokenization.cache_fingerprint` of ``tokenizer``, the file's fingerprint and
    ``key`` (every option the rows depend on, and the caller's cache version), so that every rank, and a later
    run, reads back what an equal file, tokenizer and options gave.

    Raises:
        ValueError: a record ``tokenize`` refuses (a :class:`~lightning_cp.data.tokenization.RecordError`),
            naming the file, the record's line and the reason; a JSON line that is not UTF-8 (pyarrow keeps
            such a byte unchecked, and only the map fails on it), naming its line.
    """

    def rows(values: Any, indices: list[int]) -> dict[str, list]:
        out = tokenize(values, indices)
        out[LENGTH] = [len(ids) for ids in out[INPUT_IDS]]
        return out

    try:
        return raw.map(
            rows,
            input_columns=column,
            with_indices=True,
            batched=True,
            remove_columns=raw.column_names,
            new_fingerprint=cache_fingerprint(tokenizer, raw._fingerprint, *key),
            desc=f"Tokenizing {os.path.basename(file)} ({description})",
        )
    except RecordError as error:
        raise ValueError(
            f"{name}={file!r} {record_location(name, file, error.index)}: {error.reason}"
        ) from None
    except UnicodeDecodeError:
        check_json_lines(name, file)
        raise


def check_json_lines(name: str, file: str) -> None:
    """Every record of a JSON ``file`` is UTF-8 and a JSON object, and there is one; nothing for another
    format. For a failure of ``datasets`` that names neither file nor line: ``pyarrow`` reads a byte that is
    not UTF-8 into a string column unchecked, and only converting it to Python fails.

    Raises:
        ValueError: the file holds no record, or its first line (or record) that is not UTF-8 or not a JSON
            object; naming the file, the line and the fix.
    """
    if BUILDERS[os.path.splitext(file)[1]] != "json":
        return
    if next(_json_records(name, file), None) is None:
        raise _empty(name, file) from None
    for _ in _json_records(name, file):  # raises at the first line that is not a JSON object
        pass


def record_location(name: str, file: str, index: int) -> str:
    """Where record ``index`` (0-based, as ``datasets`` numbers it) of ``file`` is: ``"line N"`` in a
    JSON-lines file (blank lines counted, as an editor shows them), ``"record N"`` (1-based) in a ``.json``
    array, ``"row N"`` (0-based) in a ``.parquet`` / ``.arrow`` file."""
    if BUILDERS[os.path.splitext(file)[1]] == "json":
        for position, (location, _) in enumerate(_json_records(name, file)):
            if position == index:
                return location
    return f"row {index} (counting from 0)"


def _json_records(name: str, file: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(location, record)`` of every record of a JSON file: one JSON object per non-blank line, or a JSON
    array of objects (a file whose first non-blank byte is ``[``).

    Raises:
        ValueError: a line (or the array) that is not UTF-8, not JSON, or a record that is not an object.
    """
    if _first_byte(file) == b"[":
        with open(file, "rb") as f:
            content = f.read()
        try:
            records = json.loads(_decoded(name, file, content, first_line=1))
        except json.JSONDecodeError as error:
            raise ValueError(
                f"{name}={file!r} line {error.lineno} is not JSON ({error.msg}, at column {error.colno}); "
                "fix the JSON there (a .json file holds one JSON array of objects, or one object per line)."
            ) from None
        for number, record in enumerate(records if isinstance(records, list) else [records], start=1):
            yield _checked_object(name, file, f"record {number}", record)
        return
    with open(file, "rb") as f:
        for number, raw in enumerate(f, start=1):
            line = _decoded(name, file, raw, first_line=number)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"{name}={file!r} line {number} is not JSON ({error.msg}, at column {error.colno}); write one "
                    'JSON object per line, e.g. {"messages": [...]} or {"text": "..."}.'
                ) from None
            yield _checked_object(name, file, f"line {number}", record)


def _decoded(name: str, file: str, raw: bytes, first_line: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = first_line + raw.count(b"\n", 0, error.start)
        column = error.start - (raw.rfind(b"\n", 0, error.start) + 1) + 1
        raise ValueError(
            f"{name}={file!r} line {line}: byte {column} of the line ({raw[error.start : error.start + 1]!r}) is "
            "not UTF-8; re-encode the file as UTF-8 (for example iconv -f latin1 -t utf-8)."
        ) from None


def _checked_object(name: str, file: str, location: str, record: Any) -> tuple[str, dict[str, Any]]:
    if not isinstance(record, dict):
        raise ValueError(  # noqa: TRY004 (a data error: the CLI reports ValueError)
            f"{name}={file!r} {location} is a JSON {type(record).__name__}, not an object; write one object "
            'per record, e.g. {"messages": [...]} or {"text": "..."}.'
        ) from None
    return location, record


def _first_byte(file: str) -> bytes:
    """The file's first byte that is not white space (``b""`` for a file of white space only)."""
    with open(file, "rb") as f:
        while chunk := f.read(1 << 16):
            if stripped := chunk.lstrip():
                return stripped[:1]
    return b""


def _empty(name: str, file: str) -> ValueError:
    return ValueError(f"{name}={file!r} holds no record (it is empty); pass a file with at least one record.")
