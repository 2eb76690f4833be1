"""The log-prob directory of a rollout file, read and written in one place.

``lightning-cp predict`` with a :class:`~lightning_cp.data.RolloutDataModule` writes, through
:class:`~lightning_cp.callbacks.RolloutLogprobWriter`, one JSON-lines file per data-parallel rank ``r``,
``<dir>/logprobs.dp<r>.jsonl`` (a *part*), one line per rollout that rank predicted::

    {"rollout": 3, "tokens": [...], "logprobs": [...]}

``rollout`` is the rollout's row in its file (0-based), ``tokens`` every token id of the rollout (prompt then
completion) as the model read it, ``logprobs`` the log-probability of each completion token in order. A part
is written under ``<name>.partial`` and renamed when complete (:class:`LogprobPartWriter`), so a reader never
sees half of one, and a run that failed leaves only ``.partial`` files, which are never read.

:func:`read_entries` reads every line of every part back, checked against this schema;
``RolloutDataModule(old_logprobs=..., ref_logprobs=...)`` joins them to the rollouts of its file
(:mod:`lightning_cp.data.rollout_logprobs`). Nothing here imports the rest of the package: both the callback
and the data module (which DataLoader workers import) read the format from this module.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple, TextIO

PART_PATTERN = "logprobs.dp*.jsonl"
"""The parts of a log-prob directory (one per data-parallel rank of the run that wrote it)."""
_PART_NAME = "logprobs.dp{dp_rank}.jsonl"
_PARTIAL_SUFFIX = ".partial"


class LogprobEntry(NamedTuple):
    """One line of a part: a rollout's tokens and its completion's log-probabilities."""

    rollout: int
    """The rollout's row in its file (0-based)."""
    tokens: list[int]
    """Every token id of the rollout, prompt then completion."""
    logprobs: list[float]
    """The log-probability of each completion token, in order."""


def part_path(directory: str | Path, dp_rank: int) -> Path:
    """The part of data-parallel rank ``dp_rank`` in ``directory``."""
    return Path(directory) / _PART_NAME.format(dp_rank=dp_rank)


class LogprobPartWriter:
    """Writes one data-parallel rank's part, a line per :meth:`write`, under ``<part>.partial`` until
    :meth:`commit` names it (:func:`part_path`); :meth:`abandon` closes it unnamed. Creates ``directory``."""

    def __init__(self, directory: str | Path, dp_rank: int) -> None:
        self.path = part_path(directory, dp_rank)
        self._partial = self.path.with_name(self.path.name + _PARTIAL_SUFFIX)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO = open(self._partial, "w")  # noqa: SIM115 (open until commit / abandon)

    def write(self, entry: LogprobEntry) -> None:
        """Append ``entry`` as one line."""
        self._file.write(json.dumps(entry._asdict()) + "\n")

    def commit(self) -> None:
        """Close the part and give it its name (a reader never sees half a part)."""
        self._file.close()
        os.replace(self._partial, self.path)

    def abandon(self) -> None:
        """Close the part, left as ``.partial`` (which a reader does not read)."""
        self._file.close()


def check_logprob_dir(name: str, directory: str) -> list[Path]:
    """The parts of the log-prob directory ``directory`` (the argument ``name``), in name order.

    Raises:
        ValueError: it is not a directory, or holds no ``logprobs.dp<r>.jsonl``.
    """
    parts = sorted(Path(directory).glob(PART_PATTERN)) if os.path.isdir(directory) else []
    if not parts:
        raise ValueError(
            f"{name}={directory!r} is not a directory with {PART_PATTERN} files; run lightning-cp predict with "
            "this RolloutDataModule (and the reference or sampling model's weights) and pass the predictions "
            "directory it prints."
        )
    return parts


def read_entries(name: str, directory: str) -> Iterator[tuple[str, LogprobEntry]]:
    """Every line of every part of ``directory`` (the argument ``name``), parts in name order, blank lines
    skipped: ``(where, entry)``, ``where`` naming the argument, the part and the line for the caller's errors.

    Raises:
        ValueError: no parts (:func:`check_logprob_dir`), or a line that is not JSON or not an entry of the
            schema (module docstring), naming the part, the line and the fix.
    """
    for part in check_logprob_dir(name, directory):
        with open(part) as f:
            for number, line in enumerate(f, start=1):
                if line.strip():
                    where = f"{name}={directory!r}: {part.name} line {number}"
                    yield where, _entry(where, line)


def _entry(where: str, line: str) -> LogprobEntry:
    try:
        entry = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{where} is not JSON ({error.msg}); the file is damaged: run predict again."
        ) from None
    if (
        not isinstance(entry, dict)
        or not isinstance(entry.get("rollout"), int)
        or not isinstance(entry.get("tokens"), list)
        or not isinstance(entry.get("logprobs"), list)
    ):
        raise ValueError(  # noqa: TRY004 (a data error: the CLI reports ValueError)
            f"{where} is not a rollout's entry "
            '{"rollout": int, "tokens": [...], "logprobs": [...]}; pass a directory lightning-cp predict wrote.'
        )
    return LogprobEntry(entry["rollout"], entry["tokens"], entry["logprobs"])
