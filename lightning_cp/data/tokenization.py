"""Text documents and chat conversations to token ids and target masks, with a local ``transformers`` tokenizer.

- ``text``: each document is tokenized as the tokenizer does by default (its BOS where it adds one) and
  ends with EOS (appended unless it is already the last token); every token is a target.
- ``chat``: each conversation (a list of ``{"role", "content"}`` messages, or ShareGPT's) is rendered with
  the tokenizer's chat template and tokenized; the targets are the assistant's turns (:data:`ChatTargets`):
  the tokens the template marks as generated (``{% generation %}`` ... ``{% endgeneration %}`` blocks,
  ``return_assistant_tokens_mask=True``), or, for a template without such blocks, each assistant turn as
  the template renders it at inference (:mod:`lightning_cp.data.chat_turns`).

``transformers`` is imported lazily, so the ``data`` package stays light for DataLoader workers.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Any, Literal

from lightning_cp.data.chat_messages import normalize_messages
from lightning_cp.data.chat_turns import render_chat, turn_samples

TextFormat = Literal["text", "chat"]

ChatTargets = Literal["generation", "turns"]
"""How the assistant's tokens of a conversation are found:

- ``"generation"``: the template's ``{% generation %}`` blocks mark them, in the whole conversation's
  rendering (one sample per conversation);
- ``"turns"`` (a template without such blocks): each assistant turn as the template renders it at
  inference, after its generation prompt, through its end-of-turn token
  (:func:`~lightning_cp.data.chat_turns.turn_samples`): the whole conversation as one sample where the
  template renders its prefixes as prefixes of it, else a sample per turn (a template that rewrites
  earlier turns: Qwen3's, gpt-oss's, GLM-4-MoE's).
"""

_TOKENIZER_FILE_PREFIXES = (
    "tokenizer",
    "special_tokens_map",
    "added_tokens",
    "vocab",
    "merges",
    "chat_template",
    "generation_config",
)
"""Files of a tokenizer directory whose content is part of the cache fingerprint."""

_GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")
"""How ``transformers`` recognizes a template that can mark the assistant's tokens."""


def load_tokenizer(path: str, format: TextFormat) -> Any:
    """The ``AutoTokenizer`` of a local directory (``local_files_only=True``: nothing is downloaded).

    Raises:
        ImportError: ``transformers`` is not installed.
        ValueError: ``path`` is not a directory, ``transformers`` cannot load a tokenizer from it, or it has
            no EOS token (``text``). Its chat template (``chat``) is :func:`chat_targets`'s to check.
    """
    if not os.path.isdir(path):
        raise ValueError(
            f"tokenizer={path!r} is not a directory; pass a local tokenizer directory (written by "
            "save_pretrained, e.g. the model's own directory)."
        )
    try:
        from transformers import AutoTokenizer
    except ImportError as error:
        raise ImportError(
            "TextDataModule needs transformers: pip install 'lightning-cp[hf,data]'."
        ) from error
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(
            f"tokenizer={path!r}: transformers cannot load a tokenizer from it ({first_line}); pass a "
            "directory with tokenizer.json or the tokenizer's own files."
        ) from error
    if format == "text" and tokenizer.eos_token_id is None:
        raise ValueError(
            f"tokenizer={path!r} has no eos_token, which ends every document of format='text'; set "
            "eos_token in its tokenizer_config.json."
        )
    return tokenizer


def chat_targets(tokenizer: Any, path: str) -> ChatTargets:
    """How ``tokenizer``'s default chat template lets the assistant's tokens be found (:data:`ChatTargets`).

    Raises:
        ValueError: the tokenizer (of directory ``path``) has no default chat template.
    """
    template = tokenizer.chat_template
    if isinstance(template, dict):  # named templates: apply_chat_template renders the "default" one
        template = template.get("default")
    if template is None:
        raise ValueError(
            f"tokenizer={path!r} has no (default) chat template, which format='chat' renders conversations "
            "with; use the instruct model's tokenizer, or set tokenizer.chat_template and save_pretrained it."
        )
    return "generation" if _GENERATION_BLOCK.search(template) else "turns"


def stop_tokens(tokenizer: Any, path: str) -> frozenset[int]:
    """The tokens that end an assistant turn: the tokenizer's EOS and, where the tokenizer directory ``path``
    holds the model's ``generation_config.json``, its ``eos_token_id`` (Llama 3's ``<|eot_id|>``, gpt-oss's
    ``<|call|>``, GLM-4-MoE's ``<|user|>`` and ``<|observation|>``).

    Raises:
        ValueError: ``generation_config.json`` is not JSON, or its ``eos_token_id`` is not an id or a list.
    """
    stops = set() if tokenizer.eos_token_id is None else {tokenizer.eos_token_id}
    config = os.path.join(path, "generation_config.json")
    if os.path.isfile(config):
        try:
            with open(config) as f:
                eos = json.load(f).get("eos_token_id")
        except (ValueError, AttributeError) as error:
            raise ValueError(f"{config!r} is not a JSON object ({error}); fix or remove it.") from None
        ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
        if not all(isinstance(token, int) for token in ids):
            raise ValueError(f"{config!r} has eos_token_id={eos!r}; it must be a token id or a list of them.")
        stops.update(ids)
    return frozenset(stops)


def cache_fingerprint(tokenizer: str | None, *parts: str) -> str:
    """The key under which ``datasets`` caches a file's tokenized rows: ``parts`` (the file's ``datasets``
    fingerprint, the options, the cache version of the module), and, for a tokenizer directory
    ``tokenizer``, the ``transformers`` release and the content of the tokenizer's files (the generation
    config's stop tokens included). The same on every rank."""
    digest = hashlib.sha256("|".join(parts).encode())
    if tokenizer is not None:
        import transformers

        digest.update(f"|{transformers.__version__}".encode())
        for name in sorted(os.listdir(tokenizer)):
            if name.startswith(_TOKENIZER_FILE_PREFIXES):
                with open(os.path.join(tokenizer, name), "rb") as f:
                    digest.update(name.encode() + f.read())
    return digest.hexdigest()[:32]


class RecordError(ValueError):
    """A record of a file that cannot be tokenized; the data module names the file and the line.

    Attributes:
        index: the record's index in its file, as ``datasets`` numbers it (0-based, blank lines skipped).
        reason: why, and what to change.
    """

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(f"record {index}: {reason}")
        self.index, self.reason = index, reason


def not_a_document(value: Any) -> str:
    """Why ``value``, a ``format="text"`` record's column, is no document (it is not a string)."""
    kind = "null" if value is None else f"a {type(value).__name__}"
    return f"the document is {kind}, not a string; write the text as a JSON string."


def tokenize_texts(tokenizer: Any, texts: list[Any], indices: list[int]) -> dict[str, list[list[int]]]:
    """``input_ids`` of every document, each ending with EOS; ``indices`` number them in their file, for
    errors. A ``datasets`` batched-map function body.

    Raises:
        RecordError: a document that is not a string.
    """
    for index, text in zip(indices, texts, strict=True):
        if not isinstance(text, str):
            raise RecordError(index, not_a_document(text))
    eos = tokenizer.eos_token_id
    ids = tokenizer(texts)["input_ids"]
    return {"input_ids": [doc if doc and doc[-1] == eos else [*doc, eos] for doc in ids]}


def tokenize_conversations(
    tokenizer: Any,
    conversations: list[Any],
    indices: list[int],
    targets: ChatTargets,
    stops: frozenset[int],
    template_kwargs: dict[str, Any],
) -> dict[str, list[Any]]:
    """The samples of every conversation (its messages read by
    :func:`~lightning_cp.data.chat_messages.normalize_messages`: ShareGPT's ``{"from", "value"}`` too): a
    ``datasets`` batched-map body, returning one row per sample.

    Args:
        tokenizer: the ``transformers`` tokenizer whose default chat template renders the conversations.
        conversations: the file's records' message lists.
        indices: their indices in the file, for errors.
        targets: how the assistant's tokens are found (:data:`ChatTargets`).
        stops: the tokens that end a turn (:func:`stop_tokens`), for ``"turns"``.
        template_kwargs: passed to every rendering (``enable_thinking``, ``reasoning_effort``, ...).

    Returns:
        ``input_ids`` and ``loss_mask`` (1 on the assistant's tokens) of each sample, and ``conversation``, the
        index of the conversation it comes from: one sample per conversation with ``"generation"``, one or
        more with ``"turns"`` (:func:`~lightning_cp.data.chat_turns.turn_samples`).

    Raises:
        RecordError: a conversation that is no list of messages, that the chat template fails on, or
            (``"turns"``) whose turns cannot be found after their generation prompts; naming the reason and
            what to change.
    """
    out: dict[str, list[Any]] = {"input_ids": [], "loss_mask": [], "conversation": []}
    for index, conversation in zip(indices, conversations, strict=True):
        try:
            messages = normalize_messages(conversation)
            if targets == "generation":
                encoded = render_chat(
                    tokenizer,
                    messages,
                    tokenize=True,
                    return_dict=True,
                    return_assistant_tokens_mask=True,
                    **template_kwargs,
                )
                samples = [(list(encoded["input_ids"]), list(encoded["assistant_masks"]))]
            else:
                samples = turn_samples(tokenizer, messages, stops, template_kwargs)
        except ValueError as error:
            raise RecordError(index, str(error)) from None
        for ids, mask in samples:
            out["input_ids"].append(ids)
            out["loss_mask"].append(mask)
            out["conversation"].append(index)
    return out
