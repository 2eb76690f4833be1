"""A conversation's training samples for a chat template without ``{% generation %}`` blocks: each assistant
turn as the template renders it at inference.

At inference, assistant message ``i`` is generated after the prompt ``P_i``, the template's rendering of
messages ``[:i]`` with its generation prompt; the template's rendering of messages ``[:i + 1]``, ``F_i``,
starts with ``P_i`` as text, and the rest of it, ``F_i[len(P_i):]``, is what the model produces (its
reply, through its end-of-turn token). Each turn's target is that rest, tokenized on its own (as the model
generates it after the prompt), its context exactly the tokens of ``P_i``. A template may also rewrite the
history once the reply follows it (gpt-oss drops a tool call's analysis when the answer comes): then the
reply is the end of ``F_i`` after the generation prompt, as long as the reply rendered after the user's
question alone, checked to be exactly how ``F_i`` ends; otherwise the conversation is refused.

Samples (one or several per conversation):

- the whole conversation, one sample, where every ``P_i`` and ``F_i`` renders as a token prefix of the whole
  conversation's rendering (Llama 3's, Qwen 2.5's, Mistral's, ChatML templates): the targets are the spans
  ``[len(P_i), len(F_i))`` of the whole rendering;
- otherwise (a template that rewrites earlier turns: Qwen3's and Qwen3.5's strip the reasoning of turns
  before the last user message, gpt-oss's drops it and ends earlier turns with ``<|end|>`` instead of
  ``<|return|>``, GLM-4-MoE's strips it), a sample per turn: ``P_i``'s tokens then the reply's. A turn whose
  prompt's tokens start with the running sample's tokens (the template did not rewrite what came before:
  tool calls and their results after one user message) extends that sample instead, so each target still
  sees exactly ``P_i`` before it.

A turn's targets end with its end-of-turn token, the last *stop token* in its span (the tokenizer's EOS and
the model's ``generation_config.json`` ``eos_token_id``, :func:`~lightning_cp.data.tokenization.stop_tokens`);
the glue a template writes after it (ChatML's ``"\\n"``) is context, not a target. A span without a stop token
(GLM-4-MoE ends a turn with the next message's ``<|user|>`` or ``<|observation|>``, stop tokens of its
generation config) takes the token after it as its last target when that is a stop token, or, at the end
of its sample, the tokenizer's EOS appended, so that every turn teaches the model to stop.
"""

from __future__ import annotations

from typing import Any

Sample = tuple[list[int], list[int]]
"""``(input_ids, loss_mask)`` of one sample: int token ids and 0 / 1 targets, of equal length."""


def render_chat(tokenizer: Any, messages: list[dict], **options: Any) -> Any:
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


def turn_samples(
    tokenizer: Any, messages: list[dict], stops: frozenset[int], template_kwargs: dict[str, Any]
) -> list[Sample]:
    """The samples of one conversation, each assistant turn as the template renders it at inference (see
    the module docstring): the whole conversation where it is exact, else a sample per turn (turns whose
    prompts continue the running sample share it).

    Args:
        tokenizer: a ``transformers`` tokenizer whose chat template has no ``{% generation %}`` blocks.
        messages: ``{"role", "content", ...}`` dicts (:func:`~lightning_cp.data.chat_messages.normalize_messages`).
        stops: the token ids that end a turn (:func:`~lightning_cp.data.tokenization.stop_tokens`).
        template_kwargs: passed to every rendering (``enable_thinking``, ``reasoning_effort``, ...).

    Raises:
        ValueError: the conversation starts with an assistant message, or the template's generation prompt
            for a turn is not the start of its rendering of that turn (or that turn renders as nothing).
    """
    turns = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
    if turns and turns[0] == 0:
        raise ValueError(
            "its first message is the assistant's: nothing comes before it for the template to render as its "
            "prompt; start the conversation with a user (or system) message."
        )
    chat = _Renderings(tokenizer, messages, template_kwargs)
    prompts = [chat.text(messages[:i], prompt=True) for i in turns]
    fulls = [chat.text(messages[: i + 1], prompt=False) for i in turns]
    prompt_ids = [chat.encode(prompt) for prompt in prompts]
    whole = chat.encode(chat.text(messages, prompt=False))
    spans = []
    for prompt, full in zip(prompt_ids, fulls, strict=True):
        through = chat.encode(full)
        if whole[: len(prompt)] != prompt or whole[: len(through)] != through or len(through) <= len(prompt):
            break
        spans.append((len(prompt), len(through)))
    else:
        return [_with_targets(whole, spans, stops, tokenizer.eos_token_id)]
    samples: list[tuple[list[int], list[tuple[int, int]]]] = []
    for i, prompt_text, full_text, prompt in zip(turns, prompts, fulls, prompt_ids, strict=True):
        reply = chat.encode(chat.reply(i, prompt_text, full_text))
        if samples and prompt[: len(samples[-1][0])] == samples[-1][0]:
            ids, sample_spans = samples[-1]
            ids.extend(prompt[len(ids) :])
        else:
            ids, sample_spans = list(prompt), []
            samples.append((ids, sample_spans))
        sample_spans.append((len(ids), len(ids) + len(reply)))
        ids.extend(reply)
    return [_with_targets(ids, sample_spans, stops, tokenizer.eos_token_id) for ids, sample_spans in samples]


class _Renderings:
    """One conversation's renderings by the chat template (text) and their tokens."""

    def __init__(self, tokenizer: Any, messages: list[dict], template_kwargs: dict[str, Any]) -> None:
        self.tokenizer, self.messages, self.template_kwargs = tokenizer, messages, template_kwargs

    def text(self, messages: list[dict], prompt: bool) -> str:
        return render_chat(
            self.tokenizer, messages, tokenize=False, add_generation_prompt=prompt, **self.template_kwargs
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def reply(self, turn: int, prompt: str, full: str) -> str:
        """What the model produces after ``prompt`` (messages ``[:turn]`` and the generation prompt) for
        assistant message ``turn``, as ``full`` (messages ``[:turn + 1]``) renders it.

        Usually ``full`` starts with ``prompt`` and the reply is the rest. A template may rewrite the history
        once the reply follows it (gpt-oss drops a tool call's analysis when a final answer comes): then the
        reply is the end of ``full`` after the generation prompt, as long as the template renders it after
        the last user message alone, and checked to be exactly how ``full`` ends.
        """
        if full.startswith(prompt):
            if len(full) == len(prompt):
                raise ValueError(
                    f"the chat template renders assistant message {turn} as nothing after its generation prompt; "
                    "give the message its content."
                )
            return full[len(prompt) :]
        history = self.text(self.messages[:turn], prompt=False)
        users = [k for k in range(turn) if self.messages[k]["role"] == "user"]
        if users and prompt.startswith(history):
            question = self.messages[users[-1]]
            alone_prompt = self.text([question], prompt=True)
            alone = self.text([question, self.messages[turn]], prompt=False)
            reply = alone[len(alone_prompt) :]
            if alone.startswith(alone_prompt) and reply and full.endswith(prompt[len(history) :] + reply):
                return reply
        raise _prompt_mismatch(turn, prompt, full)


def _with_targets(
    ids: list[int], spans: list[tuple[int, int]], stops: frozenset[int], eos: int | None
) -> Sample:
    """``ids`` (with EOS appended where its last turn has no stop token) and 1 on each turn's targets: its
    span through its last stop token; a span without one through the stop token after it, if any."""
    ids, mask = list(ids), [0] * len(ids)
    for start, end in spans:
        last_stop = next((k for k in range(end - 1, start - 1, -1) if ids[k] in stops), None)
        if last_stop is not None:
            end = last_stop + 1
        elif end < len(ids) and ids[end] in stops:
            end += 1
        elif end == len(ids) and eos is not None:
            ids.append(eos)
            mask.append(0)
            end += 1
        mask[start:end] = [1] * (end - start)
    return ids, mask


def _prompt_mismatch(turn: int, prompt: str, reply: str) -> ValueError:
    same = next((k for k, (a, b) in enumerate(zip(prompt, reply)) if a != b), min(len(prompt), len(reply)))
    start = max(0, same - 20)
    return ValueError(
        f"the chat template's generation prompt for message {turn} ends {prompt[start:][:60]!r}, but it renders "
        f"that reply as {reply[start:][:60]!r}: the reply's tokens cannot be found after the prompt; set "
        "chat_template_kwargs so that they agree (for example enable_thinking: true for replies with "
        "reasoning), or mark the replies with {% generation %} blocks in chat_template.jinja."
    )
