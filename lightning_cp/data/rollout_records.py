"""One rollout record of a file to its token ids, its score and its per-token values, every field checked.

A record is one prompt and one sampled completion, in one of two forms (:data:`RolloutForm`, the file's
columns decide):

- ``"ids"``: ``prompt_ids`` and ``completion_ids``, lists of token ids, used as they are;
- ``"text"``: ``prompt``, a list of chat messages (as :func:`~lightning_cp.data.chat_messages.normalize_messages`
  reads them, ShareGPT's too), and ``completion``, the assistant's text. The sample is the conversation as the
  tokenizer's chat template renders it at inference (:func:`~lightning_cp.data.chat_turns.turn_samples`): the
  prompt's messages with the generation prompt, then the completion through its end-of-turn token; the
  completion's tokens are the assistant turn's tokens after the generation prompt.

and with a score, ``reward`` or ``advantage`` (exactly one of them, a finite number), optional
``old_logprobs`` / ``ref_logprobs`` (one log-probability per completion token, finite and at most 0) and an
optional ``group`` (the prompt's id; without it the prompt's token ids are its group).

Everything here is per record and raises a ``ValueError`` that says what is wrong and what to write instead;
the data module adds the file and the line.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from lightning_cp.constants import INPUT_IDS, OLD_LOGPROBS, REF_LOGPROBS
from lightning_cp.data.chat_messages import normalize_messages
from lightning_cp.data.chat_turns import turn_samples

RolloutForm = Literal["ids", "text"]
"""``"ids"``: ``prompt_ids`` + ``completion_ids``; ``"text"``: ``prompt`` (chat messages) + ``completion``."""

FORM_COLUMNS: dict[RolloutForm, tuple[str, str]] = {
    "ids": ("prompt_ids", "completion_ids"),
    "text": ("prompt", "completion"),
}
"""The prompt and completion columns of each form."""
LOGPROB_KEYS = (OLD_LOGPROBS, REF_LOGPROBS)
"""The optional per-completion-token columns, named as the batch keys they become."""
LOGPROB_TOLERANCE = 1e-6
"""A log-probability above this is refused (a probability above 1: not a log-probability, or another sign)."""
PROMPT_LENGTH = "prompt_length"
SCORE = "score"
IS_REWARD = "is_reward"
GROUP = "group"
"""The columns a tokenized rollout has besides ``input_ids`` and the log-prob columns it carries."""


@dataclass(frozen=True)
class ChatRendering:
    """What the ``"text"`` form renders a record with.

    Attributes:
        tokenizer: a ``transformers`` tokenizer with a chat template.
        stops: the token ids that end a turn (:func:`~lightning_cp.data.tokenization.stop_tokens`).
        template_kwargs: variables of every rendering (``enable_thinking``, ...).
    """

    tokenizer: Any
    stops: frozenset[int]
    template_kwargs: dict[str, Any]


def rollout_form(columns: Collection[str], name: str, file: str) -> RolloutForm:
    """The form of a file with ``columns`` (the argument ``name``): ``"ids"`` or ``"text"``.

    Raises:
        ValueError: the columns of both forms, or of neither.
    """
    found = [form for form, pair in FORM_COLUMNS.items() if any(column in columns for column in pair)]
    if len(found) == 1:
        return found[0]
    what = "both" if found else "neither"
    raise ValueError(
        f"{name}={file!r} has {what} of prompt_ids / completion_ids (token ids) and prompt / completion (chat "
        f"messages and text) (its columns: {sorted(columns)}); write every rollout in one form, e.g. "
        '{"prompt_ids": [...], "completion_ids": [...], "reward": 1.0}.'
    )


def rollout_row(
    record: Mapping[str, Any],
    form: RolloutForm,
    vocab_size: int | None,
    chat: ChatRendering | None,
    logprob_keys: Sequence[str],
) -> dict[str, Any]:
    """The tokenized rollout of ``record``: ``input_ids`` (prompt then completion), ``prompt_length``,
    ``score`` and ``is_reward`` (a reward, or an advantage used as is), ``group`` (a string: the record's
    ``group``, else a digest of the prompt's token ids) and the ``logprob_keys`` lists (one per completion token).

    Args:
        record: the file's record (a ``datasets`` row: absent keys are ``None``).
        form: the file's :data:`RolloutForm`.
        vocab_size: every id must be below it (the tokenizer's size); ``None``: unchecked.
        chat: how ``"text"`` records are rendered (``None`` for ``"ids"``).
        logprob_keys: which of :data:`LOGPROB_KEYS` the file's records must carry.

    Raises:
        ValueError: a missing field, an empty prompt or completion, ids that are not non-negative ints below
            ``vocab_size``, a score that is not exactly one finite ``reward`` or ``advantage``, a log-prob list
            whose length is not the completion's or that holds a value that is not finite or above 0; the
            message says what to write instead.
    """
    prompt_column, completion_column = FORM_COLUMNS[form]
    for column in (prompt_column, completion_column):
        if record.get(column) is None:
            present = sorted(key for key, value in record.items() if value is not None)
            raise ValueError(f"it has no {column!r} (its keys: {present}); give every rollout its {column}.")
    if form == "ids":
        prompt = _token_ids(prompt_column, record[prompt_column], vocab_size)
        completion = _token_ids(completion_column, record[completion_column], vocab_size)
        input_ids, prompt_length = prompt + completion, len(prompt)
    else:
        if chat is None:
            raise ValueError(
                "its prompt is chat messages, which need a tokenizer; pass tokenizer (a directory)."
            )
        input_ids, prompt_length = _rendered(chat, record[prompt_column], record[completion_column])
    completion_length = len(input_ids) - prompt_length
    score, is_reward = _score(record)
    row: dict[str, Any] = {
        INPUT_IDS: input_ids,
        PROMPT_LENGTH: prompt_length,
        SCORE: score,
        IS_REWARD: is_reward,
        GROUP: _group(record.get(GROUP), input_ids[:prompt_length]),
    }
    for key in logprob_keys:
        if record.get(key) is None:
            raise ValueError(
                f"it has no {key!r}, which other rollouts of the file have; give every rollout its {key} or none."
            )
        problem = logprob_problem(record[key], completion_length)
        if problem is not None:
            raise ValueError(f"{key}: {problem}")
        row[key] = [float(value) for value in record[key]]
    return row


def logprob_problem(values: Any, completion_length: int) -> str | None:
    """Why ``values`` are not the log-probabilities of a completion of ``completion_length`` tokens (a list of
    as many finite numbers, each at most :data:`LOGPROB_TOLERANCE`), or ``None``."""
    if not isinstance(values, list):
        return f"it is {_kind(values)}, not a list; write one log-probability per completion token."
    other = next((value for value in values if not _is_number(value)), _NOTHING)
    if other is not _NOTHING:
        return f"it holds {_kind(other)}, not a number; write one log-probability per completion token."
    if len(values) != completion_length:
        return (
            f"{len(values)} log-probabilities for a completion of {completion_length} tokens; write one per "
            "completion token (for text rollouts, per token as the chat template renders the completion, "
            "through its end-of-turn token)."
        )
    array = np.asarray(values, dtype=np.float64)
    bad = np.flatnonzero(~np.isfinite(array) | (array > LOGPROB_TOLERANCE))
    if len(bad):
        return (
            f"completion token {int(bad[0])} has the log-probability {values[bad[0]]!r}, which is not finite or "
            "above 0; write log p(token), a finite number <= 0."
        )
    return None


def _token_ids(column: str, ids: Any, vocab_size: int | None) -> list[int]:
    if not isinstance(ids, list):
        raise ValueError(  # noqa: TRY004 (a data error: the CLI reports ValueError)
            f"{column} is {_kind(ids)}, not a list; write the token ids as a list of JSON integers."
        )
    other = next((i for i in ids if not _is_id(i)), _NOTHING)
    if other is not _NOTHING:
        raise ValueError(
            f"{column} holds {_kind(other)}, not a token id; write the token ids as JSON integers."
        )
    ids = [int(i) for i in ids]
    if not ids:
        raise ValueError(f"{column} is empty; a rollout needs at least one prompt and one completion token.")
    limit = f" below the tokenizer's {vocab_size}" if vocab_size is not None else ""
    bad = [i for i in ids if i < 0 or (vocab_size is not None and i >= vocab_size)]
    if bad:
        raise ValueError(f"{column} holds the id {bad[0]}; token ids are >= 0{limit}.")
    return ids


def _rendered(chat: ChatRendering, prompt: Any, completion: Any) -> tuple[list[int], int]:
    """The token ids of prompt + completion as rendered at inference, and the prompt's length."""
    try:
        messages = normalize_messages(prompt)
    except ValueError as error:
        raise ValueError(f"prompt: {error}") from None
    if messages[-1]["role"] == "assistant":
        raise ValueError(
            "its prompt ends with an assistant message; the completion is the assistant's next turn: end the "
            "prompt with the user's (or a tool's) message."
        )
    if not isinstance(completion, str) or not completion:
        raise ValueError(
            f"completion is {_kind(completion)}; write the assistant's reply as a non-empty string."
        )
    reply = {"role": "assistant", "content": completion}
    ids, mask = turn_samples(chat.tokenizer, [*messages, reply], chat.stops, chat.template_kwargs)[-1]
    end = len(mask) - mask[::-1].index(1)
    start = end
    while start > 0 and mask[start - 1]:
        start -= 1
    return ids[:end], start


def _score(record: Mapping[str, Any]) -> tuple[float, bool]:
    reward, advantage = record.get("reward"), record.get("advantage")
    if (reward is None) == (advantage is None):
        found = "both" if reward is not None else "neither"
        raise ValueError(
            f"it has {found} of 'reward' and 'advantage'; give each rollout one: its reward (advantages then "
            "come from its group's rewards) or its advantage (used as is)."
        )
    name, value = ("reward", reward) if reward is not None else ("advantage", advantage)
    if not _is_number(value) or not math.isfinite(value):
        raise ValueError(f"its {name} is {value!r}; write a finite number.")
    return float(value), reward is not None


def _group(group: Any, prompt_ids: list[int]) -> str:
    """The key of the rollout's group: its ``group`` value, else its prompt's token ids."""
    if group is not None:
        return "group:" + json.dumps(group, sort_keys=True, default=repr)
    return "prompt:" + hashlib.sha256(np.asarray(prompt_ids, dtype=np.int64).tobytes()).hexdigest()


def _is_id(value: Any) -> bool:
    """An int, or a float of an integral value (``datasets`` reads a file's ids as floats when one is)."""
    return (isinstance(value, int) and not isinstance(value, bool)) or (
        isinstance(value, float) and value.is_integer()
    )


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


_NOTHING = object()


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, str):
        return f"the string {value[:40]!r}" if value else "an empty string"
    if isinstance(value, (int, float)):
        return f"{value!r} (a {type(value).__name__})"
    return f"a {type(value).__name__}"
