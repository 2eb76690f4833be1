"""A record's conversation as the chat template reads it: a list of ``{"role", "content", ...}`` messages.

Two layouts are read:

- ``{"role": ..., "content": ...}`` (OpenAI's, ``transformers``'): passed on as they are, other keys
  (``reasoning_content``, ``tool_calls``, ...) included;
- ShareGPT's ``{"from": ..., "value": ...}``: ``from`` mapped to the role (:data:`SHAREGPT_ROLES`:
  ``human`` -> ``user``, ``gpt`` -> ``assistant``, ``system`` -> ``system``) and ``value`` to the content;
  other keys are passed on.

A key whose value is ``None`` is dropped first: ``datasets`` fills the keys that other records' messages
have with ``None`` (one Arrow schema per file), and ``transformers`` drops them too before rendering. This
module imports nothing heavy, so a data module's constructor can check a file's first record with it.
"""

from __future__ import annotations

from typing import Any

SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}
"""ShareGPT's ``from`` value -> the chat template's role."""


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """``messages`` as ``{"role", "content", ...}`` dicts (ShareGPT's ``{"from", "value"}`` mapped).

    Raises:
        ValueError: ``messages`` is not a non-empty list of objects, a message has neither ``role`` nor
            ShareGPT's ``from``, or ``from`` is not one of :data:`SHAREGPT_ROLES`; the message says which
            message and what to write instead (no file or line: the caller adds them).
    """
    if not isinstance(messages, list) or not messages:
        found = "an empty list" if isinstance(messages, list) else _kind(messages)
        raise ValueError(
            f"the conversation is {found}, not a list of messages; write "
            '[{"role": "user", "content": ...}, {"role": "assistant", "content": ...}].'
        )
    normalized = []
    for number, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(  # noqa: TRY004 (a data error: the CLI reports ValueError)
                f"message {number} is {_kind(message)}, not an object; write "
                '{"role": "user" | "assistant" | "system", "content": ...}.'
            )
        message = {key: value for key, value in message.items() if value is not None}
        if "role" not in message and "from" in message:
            message = _from_sharegpt(number, message)
        if "role" not in message:
            raise ValueError(
                f"message {number} has no 'role' (its keys: {sorted(message)}); write "
                '{"role": "user" | "assistant" | "system", "content": ...} or ShareGPT\'s '
                '{"from": "human" | "gpt" | "system", "value": ...}.'
            )
        normalized.append(message)
    return normalized


def _from_sharegpt(number: int, message: dict[str, Any]) -> dict[str, Any]:
    sender = message.pop("from")
    if sender not in SHAREGPT_ROLES:
        known = ", ".join(f"{name!r} ({role})" for name, role in SHAREGPT_ROLES.items())
        raise ValueError(
            f"message {number} is from {sender!r}, which is not a ShareGPT sender TextDataModule knows ({known}); "
            'rename it to one of them, or write the messages as {"role": ..., "content": ...}.'
        )
    if "value" not in message:
        raise ValueError(
            f"message {number} (ShareGPT, from {sender!r}) has no 'value' (its keys: {sorted(message)}); put "
            "the message's text in 'value'."
        )
    return {"role": SHAREGPT_ROLES[sender], "content": message.pop("value"), **message}


def _kind(value: Any) -> str:
    return "null" if value is None else f"a {type(value).__name__}"
