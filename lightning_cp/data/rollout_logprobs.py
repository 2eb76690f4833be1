"""The log-prob directory ``lightning-cp predict`` wrote for a rollout file, joined to the file's rollouts.

The directory's format (its parts ``logprobs.dp<r>.jsonl``, their lines ``{"rollout", "tokens", "logprobs"}``)
is :mod:`lightning_cp.rollout_logprob_format`'s, which reads it; :func:`read_logprob_dir` joins every entry to
the rollouts of a file by ``rollout`` and refuses a directory that misses a rollout, holds one twice, was
written for other tokens (another file, tokenizer or chat template: ``tokens`` differ) or whose lists are
not log-probabilities of the completions.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from lightning_cp.data.rollout_records import logprob_problem
from lightning_cp.rollout_logprob_format import read_entries


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
        directory: the predictions directory (:func:`~lightning_cp.rollout_logprob_format.check_logprob_dir`).
        path: the rollout file, for errors.
        token_ids: rollout ``i``'s token ids as tokenized here (prompt then completion).
        prompt_lengths: ``[N]``, every rollout's prompt length.

    Returns:
        ``N`` float32 arrays, rollout ``i``'s of its completion's length.

    Raises:
        ValueError: a directory without parts or a line that is not an entry
            (:func:`~lightning_cp.rollout_logprob_format.read_entries`), a rollout index outside the file's,
            one written twice, tokens that differ from the file's, a list that is not the completion's
            log-probabilities (:func:`~lightning_cp.data.rollout_records.logprob_problem`), or rollouts that
            no line covers; naming the file, the line and the fix.
    """
    count = len(prompt_lengths)
    found: list[np.ndarray | None] = [None] * count
    for where, (index, tokens, values) in read_entries(name, directory):
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
