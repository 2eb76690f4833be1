"""The per-token log-probabilities of a rollout file that ``lightning-cp predict`` writes, read back.

:class:`~lightning_cp.callbacks.RolloutLogprobWriter` writes one JSON-lines file per data-parallel rank,
``<dir>/logprobs.dp<r>.jsonl``, one line per rollout that rank predicted::

    {"rollout": 3, "tokens": [...], "logprobs": [...]}

``rollout`` is the rollout's row in its file (0-based), ``tokens`` every token id of the rollout (prompt then
completion) as the model read it, ``logprobs`` the log-probability of each completion token in order.
:func:`read_logprob_dir` joins every part to the rollouts of a file by ``rollout`` and refuses a directory
that misses a rollout, holds one twice, was written for other tokens (another file, tokenizer or chat
template: ``tokens`` differ) or whose lists are not log-probabilities of the completions.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from lightning_cp.data.rollout_records import logprob_problem

PART_PATTERN = "logprobs.dp*.jsonl"
"""The files of a log-prob directory (one per data-parallel rank of the run that wrote it)."""


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


def read_logprob_dir(
    name: str,
    directory: str,
    path: str,
    token_ids: Callable[[int], list[int]],
    prompt_lengths: np.ndarray,
) -> list[np.ndarray]:
    """The log-probabilities of the completions of the rollouts of ``path``, from ``directory``.

    Args:
        name: the data module's argument (``old_logprobs`` / ``ref_logprobs``), for errors.
        directory: the predictions directory (:func:`check_logprob_dir`).
        path: the rollout file, for errors.
        token_ids: rollout ``i``'s token ids as tokenized here (prompt then completion).
        prompt_lengths: ``[N]``, every rollout's prompt length.

    Returns:
        ``N`` float32 arrays, rollout ``i``'s of its completion's length.

    Raises:
        ValueError: a line that is not such a JSON object, a rollout index outside the file's, one written
            twice, tokens that differ from the file's, a list that is not the completion's log-probabilities
            (:func:`~lightning_cp.data.rollout_records.logprob_problem`), or rollouts that no line covers; naming
            the file, the line and the fix.
    """
    count = len(prompt_lengths)
    found: list[np.ndarray | None] = [None] * count
    for part in check_logprob_dir(name, directory):
        with open(part) as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"{name}={directory!r}: {part.name} line {number}"
                index, tokens, values = _entry(where, line)
                if not 0 <= index < count:
                    raise ValueError(
                        f"{where} is rollout {index}, but path={path!r} has {count} rollouts: the directory was "
                        "written for another file; run lightning-cp predict on this one."
                    )
                if found[index] is not None:
                    raise ValueError(
                        f"{where} writes rollout {index} a second time: the directory holds parts of several "
                        "runs; pass the predictions directory of one lightning-cp predict run."
                    )
                expected = token_ids(index)
                if tokens != expected:
                    raise ValueError(
                        f"{where}: rollout {index} was predicted on other tokens ({len(tokens)}) than path={path!r} "
                        f"gives it ({len(expected)}): another file, tokenizer or chat template; run lightning-cp "
                        "predict again on this file with this data module's settings."
                    )
                problem = logprob_problem(values, len(expected) - int(prompt_lengths[index]))
                if problem is not None:
                    raise ValueError(f"{where}: rollout {index}: {problem}")
                found[index] = np.asarray(values, dtype=np.float32)
    missing = [index for index, values in enumerate(found) if values is None]
    if missing:
        raise ValueError(
            f"{name}={directory!r} has no log-probabilities for {len(missing)} of the {count} rollouts of "
            f"path={path!r} (the first: rollout {missing[0]}); a data-parallel rank's part is missing or the run "
            "stopped early: run lightning-cp predict on the whole file again."
        )
    return found  # type: ignore[return-value]


def _entry(where: str, line: str) -> tuple[int, list, list]:
    """``(rollout, tokens, logprobs)`` of one line of a part."""
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
    return entry["rollout"], entry["tokens"], entry["logprobs"]
