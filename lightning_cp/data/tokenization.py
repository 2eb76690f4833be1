"""Text documents and chat conversations to token ids and target masks, with a local ``transformers`` tokenizer.

- ``text``: each document is tokenized as the tokenizer does by default (its BOS where it adds one) and
  ends with EOS (appended unless it is already the last token); every token is a target.
- ``chat``: each conversation (a list of ``{"role", "content"}`` messages) is rendered with the
  tokenizer's chat template and tokenized (``apply_chat_template``); the targets are the assistant's turns
  (:data:`ChatTargets`): the tokens the template marks as generated (``{% generation %}`` ...
  ``{% endgeneration %}`` blocks, ``return_assistant_tokens_mask=True``), or, for a template without such
  blocks (Llama 3's, Qwen 2.5's, Mistral's), the tokens each assistant message adds to the rendering, found
  by rendering the conversation's prefixes and checked to be exact for every conversation.

``transformers`` is imported lazily, so the ``data`` package stays light for DataLoader workers.
"""

from __future__ import annotations

import os
import re
from typing import Any, Literal

from lightning_cp.data.chat_messages import normalize_messages

TextFormat = Literal["text", "chat"]

ChatTargets = Literal["generation", "turns"]
"""How the assistant's tokens of a conversation are found:

- ``"generation"``: the template's ``{% generation %}`` blocks mark them;
- ``"turns"`` (a template without such blocks): assistant message ``i``'s targets are the tokens between
  the rendering of messages ``[:i]`` with the generation prompt and the rendering of messages ``[:i + 1]``,
  up to and including the tokenizer's EOS (the end-of-turn token of an instruct tokenizer) where the span
  holds one. Both renderings must be token prefixes of the whole conversation's; a template that rewrites
  earlier turns (one that drops past reasoning, say) fails that check and the conversation is refused.
"""

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
    tokenizer: Any, conversations: list[Any], targets: ChatTargets, indices: list[int]
) -> dict[str, list[list[int]]]:
    """``input_ids`` and ``loss_mask`` (1 on the assistant's tokens, found as ``targets`` says) of every
    conversation (its messages read by :func:`~lightning_cp.data.chat_messages.normalize_messages`: ShareGPT's
    ``{"from", "value"}`` too); ``indices`` number them in their file, for errors. A ``datasets``
    batched-map body.

    Raises:
        RecordError: a conversation that is no list of messages, that the chat template fails on, or
            (``"turns"``) whose prefixes the template does not render as prefixes of the whole; naming the
            reason and what to change.
    """
    ids, masks = [], []
    for index, conversation in zip(indices, conversations, strict=True):
        try:
            messages = normalize_messages(conversation)
            if targets == "generation":
                encoded = _apply_template(
                    tokenizer, messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
                )
                ids.append(list(encoded["input_ids"]))
                masks.append(list(encoded["assistant_masks"]))
            else:
                ids.append(_render(tokenizer, messages, prompt=False))
                masks.append(_turn_mask(tokenizer, messages, ids[-1]))
        except ValueError as error:
            raise RecordError(index, str(error)) from None
    return {"input_ids": ids, "loss_mask": masks}


def _apply_template(tokenizer: Any, messages: list[dict], **options: Any) -> Any:
    """``tokenizer.apply_chat_template(messages, **options)``; a template that fails on the messages (a
    missing key, its own ``raise_exception``) raises a one-line ``ValueError`` saying so."""
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, **options)
    except (TemplateError, TypeError, KeyError) as error:
        detail = " ".join(str(error).split()) or "no message"
        raise ValueError(
            f"the chat template fails on it ({type(error).__name__}: {detail}); check the messages' keys and "
            "roles against the template (chat_template.jinja in the tokenizer directory)."
        ) from error


def _render(tokenizer: Any, messages: list[dict], prompt: bool) -> list[int]:
    return list(
        _apply_template(tokenizer, messages, tokenize=True, return_dict=True, add_generation_prompt=prompt)[
            "input_ids"
        ]
    )


def _turn_mask(tokenizer: Any, messages: list[dict], ids: list[int]) -> list[int]:
    """1 on each assistant message's tokens in ``ids``, the rendered conversation (``"turns"``)."""
    mask = [0] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(before := _render(tokenizer, messages[:i], prompt=True))
        end = len(through := _render(tokenizer, messages[: i + 1], prompt=False))
        if ids[:start] != before or ids[:end] != through or end <= start:
            raise ValueError(
                f"the chat template does not render its first {i + 1} messages as a "
                "prefix of the whole conversation (it rewrites earlier turns), so the assistant's tokens "
                "cannot be found from the rendering; mark them with {% generation %}...{% endgeneration %} "
                "around the assistant message's content and end-of-turn token in chat_template.jinja."
            )
        span = ids[start:end]
        if tokenizer.eos_token_id in span:  # the turn ends with its end-of-turn token: glue after it is not
            end = start + len(span) - span[::-1].index(tokenizer.eos_token_id)
        mask[start:end] = [1] * (end - start)
    return mask
