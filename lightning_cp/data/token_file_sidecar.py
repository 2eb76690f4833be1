"""The sidecar of a flat token file: ``<path>.json``, which records how the raw array was written.

A raw array of token ids does not say its dtype, and a ``uint32`` file read as ``uint16`` is still a
valid array (ids interleaved with zeros) on which a model trains without any error, so
:func:`~lightning_cp.data.write_token_file` writes this record beside the file::

    {"dtype": "uint16", "num_tokens": 259874, "vocab_size": 1024, "eos_id": 1023}

``dtype`` (``"uint16"`` or ``"uint32"``) and ``num_tokens`` are required, ``vocab_size`` (every id is
below it) and ``eos_id`` (the end-of-document id, or ``null``) optional; no other key is allowed.
:meth:`TokenFileSidecar.read` validates the record and :meth:`TokenFileSidecar.check` holds a file and a
reader's arguments against it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Literal

TokenDType = Literal["uint16", "uint32"]

TOKEN_DTYPES: tuple[TokenDType, ...] = ("uint16", "uint32")

_FIX = "rewrite the file with lightning_cp.data.write_token_file or correct the sidecar"


@dataclasses.dataclass(frozen=True)
class TokenFileSidecar:
    """The content of ``<path>.json``: how the token file ``path`` was written."""

    dtype: TokenDType
    """The integer type of the ids, ``"uint16"`` or ``"uint32"``."""
    num_tokens: int
    """How many ids the file holds (its size is ``num_tokens * itemsize``)."""
    vocab_size: int | None = None
    """Every id is below it; ``None``: not recorded."""
    eos_id: int | None = None
    """The end-of-document id the file was written with; ``None``: none."""

    @staticmethod
    def path_of(path: str | os.PathLike) -> Path:
        """Where the sidecar of the token file ``path`` lives: ``<path>.json``."""
        return Path(f"{os.fspath(path)}.json")

    def write(self, path: str | os.PathLike) -> None:
        """Write this record as the sidecar of the token file ``path``."""
        self.path_of(path).write_text(json.dumps(dataclasses.asdict(self), indent=2) + "\n")

    @classmethod
    def read(cls, path: str | os.PathLike) -> TokenFileSidecar | None:
        """The validated sidecar of the token file ``path``, or ``None`` when there is none.

        Raises:
            ValueError: if the sidecar is not JSON, has missing or unknown keys, or a value of the wrong
                type or range; the message names the key and the value.
        """
        sidecar = cls.path_of(path)
        if not sidecar.is_file():
            return None
        where = f"The sidecar {str(sidecar)!r} of path={os.fspath(path)!r}"
        try:
            record = json.loads(sidecar.read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"{where} is not valid JSON ({error}); {_FIX}.") from error
        fields = {field.name for field in dataclasses.fields(cls)}
        required = {"dtype", "num_tokens"}
        if not isinstance(record, dict) or not required <= set(record) <= fields:
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise ValueError(
                f"{where} has keys {keys}; it needs {sorted(required)} and may also have "
                f"{sorted(fields - required)}, nothing else; {_FIX}."
            )
        checks = (
            ("dtype", record["dtype"] in TOKEN_DTYPES, "'uint16' or 'uint32'"),
            ("num_tokens", _is_int(record["num_tokens"], minimum=0), "an integer >= 0"),
            (
                "vocab_size",
                record.get("vocab_size") is None or _is_int(record["vocab_size"], 1),
                "null or >= 1",
            ),
            ("eos_id", record.get("eos_id") is None or _is_int(record["eos_id"], 0), "null or >= 0"),
        )
        for key, valid, expected in checks:
            if not valid:
                raise ValueError(f"{where} has {key}={record[key]!r}, which must be {expected}; {_FIX}.")
        return cls(**record)

    def check(self, path: str, num_tokens: int, vocab_size: int | None, eos_id: int | None) -> None:
        """Hold the file ``path`` of ``num_tokens`` ids and a reader's ``vocab_size`` / ``eos_id`` against
        this record.

        Raises:
            ValueError: if the file's size differs from ``num_tokens`` (the sidecar of another version of
                the file), ``vocab_size`` is below the recorded one, or ``eos_id`` differs from it.
        """
        where = f"the sidecar {str(self.path_of(path))!r}"
        if num_tokens != self.num_tokens:
            raise ValueError(
                f"path={path!r} holds {num_tokens} {self.dtype} tokens, but {where} records "
                f"num_tokens={self.num_tokens}: the sidecar belongs to another version of the file; rewrite "
                "both with lightning_cp.data.write_token_file."
            )
        if vocab_size is not None and self.vocab_size is not None and vocab_size < self.vocab_size:
            raise ValueError(
                f"vocab_size={vocab_size} is smaller than the vocab_size={self.vocab_size} recorded in "
                f"{where}: ids up to {self.vocab_size - 1} may occur; pass the tokenizer's vocabulary size."
            )
        if eos_id is not None and self.eos_id is not None and eos_id != self.eos_id:
            raise ValueError(
                f"eos_id={eos_id} contradicts the eos_id={self.eos_id} recorded in {where}; pass "
                f"eos_id={self.eos_id} for documents, or eos_id=None for fixed windows."
            )


def _is_int(value: object, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum
