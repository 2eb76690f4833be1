"""``turn_samples`` on the stock chat templates that rewrite earlier turns (Qwen3, Qwen3.5, gpt-oss,
GLM-4-MoE; trl's copies): each assistant turn's context is exactly the prompt ``apply_chat_template(...,
add_generation_prompt=True)`` gives at inference, and its targets are what that model must produce there,
written out here by hand from each model's format."""

from __future__ import annotations

import datetime

import pytest

from lightning_cp.data.chat_turns import turn_samples
from lightning_cp.data.tokenization import stop_tokens

USER_1 = {"role": "user", "content": "What is 2 plus 2?"}
USER_2 = {"role": "user", "content": "And 3 plus 3?"}
TOOL = {"role": "tool", "content": "5"}
ADD = [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]


def _samples(stock_chat_dir, name, messages, generation_config=True, **template_kwargs):
    from transformers import AutoTokenizer

    directory = stock_chat_dir(name, generation_config)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    return tokenizer, turn_samples(
        tokenizer, messages, stop_tokens(tokenizer, str(directory)), template_kwargs
    )


def _assert_samples(tokenizer, messages, samples, expected, **template_kwargs):
    """``expected``: per sample, its turns ``[(message index, target text), ...]`` and the text after the
    last target. Each target is one run of 1s, decoding to its text, after exactly the inference prompt."""
    assert len(samples) == len(expected), f"{len(samples)} samples, expected {len(expected)}"
    for (ids, mask), (turns, tail) in zip(samples, expected, strict=True):
        assert len(ids) == len(mask) and set(mask) <= {0, 1}
        starts = [k for k in range(len(mask)) if mask[k] and (k == 0 or not mask[k - 1])]
        ends = [k + 1 for k in range(len(mask)) if mask[k] and (k + 1 == len(mask) or not mask[k + 1])]
        assert len(starts) == len(turns), f"{len(starts)} target runs, expected {len(turns)}"
        for (turn, target), start, end in zip(turns, starts, ends, strict=True):
            prompt = tokenizer.apply_chat_template(
                messages[:turn], add_generation_prompt=True, return_dict=True, **template_kwargs
            )["input_ids"]
            assert ids[:start] == list(prompt), f"turn {turn}: the context is not the inference prompt"
            assert tokenizer.decode(ids[start:end]) == target, f"turn {turn}"
        assert tokenizer.decode(ids[ends[-1] :]) == tail


def test_qwen3_trains_each_turn_after_the_history_it_strips_and_one_sample_where_nothing_is_rewritten(
    stock_chat_dir,
):
    """Qwen3 drops the <think> block of turns before the last user message: a reply with reasoning, then a
    second question, gives two samples; the tool calls after that question share the second (its prompt
    keeps their reasoning); a single exchange is one sample."""
    reasoned = {"role": "assistant", "reasoning_content": "Add them.", "content": "4."}
    call = {"role": "assistant", "reasoning_content": "Use the tool.", "content": "", "tool_calls": ADD}
    messages = [USER_1, reasoned, USER_2, call, TOOL, {"role": "assistant", "content": "It is 5."}]
    tokenizer, samples = _samples(stock_chat_dir, "qwen3", messages)
    tool_call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    _assert_samples(
        tokenizer,
        messages,
        samples,
        [
            ([(1, "<think>\nAdd them.\n</think>\n\n4.<|im_end|>")], "\n"),
            (
                [
                    (3, f"<think>\nUse the tool.\n</think>\n\n{tool_call}<|im_end|>"),
                    (5, "<think>\n\n</think>\n\nIt is 5.<|im_end|>"),
                ],
                "\n",
            ),
        ],
    )
    history = tokenizer.decode(samples[1][0])
    assert "<|im_start|>assistant\n4.<|im_end|>" in history and "Add them." not in history  # as rewritten

    single = [USER_1, reasoned]
    tokenizer, samples = _samples(stock_chat_dir, "qwen3", single)
    _assert_samples(
        tokenizer, single, samples, [([(1, "<think>\nAdd them.\n</think>\n\n4.<|im_end|>")], "\n")]
    )


def test_qwen3_5_continues_after_its_think_prompt_and_a_no_thinking_default_needs_enable_thinking(
    stock_chat_dir,
):
    """Qwen3.5's generation prompt opens the <think> block, so the targets start inside it; the small
    models' template (thinking off by default) cannot be trained on reasoning until enable_thinking is set."""
    messages = [
        USER_1,
        {"role": "assistant", "reasoning_content": "Add them.", "content": "4."},
        USER_2,
        {"role": "assistant", "content": "6."},
    ]
    expected = [
        ([(1, "Add them.\n</think>\n\n4.<|im_end|>")], "\n"),
        ([(3, "\n</think>\n\n6.<|im_end|>")], "\n"),
    ]
    tokenizer, samples = _samples(stock_chat_dir, "qwen3_5_think", messages)
    _assert_samples(tokenizer, messages, samples, expected)

    with pytest.raises(ValueError, match=r"generation prompt for message 1 ends .* set chat_template_kwargs"):
        _samples(stock_chat_dir, "qwen3_5_nothink", messages)
    tokenizer, samples = _samples(stock_chat_dir, "qwen3_5_nothink", messages, enable_thinking=True)
    _assert_samples(tokenizer, messages, samples, expected, enable_thinking=True)
    plain = [USER_1, {"role": "assistant", "content": "4."}, USER_2, {"role": "assistant", "content": "6."}]
    tokenizer, samples = _samples(stock_chat_dir, "qwen3_5_nothink", plain)
    _assert_samples(tokenizer, plain, samples, [([(1, "4.<|im_end|>")], "\n"), ([(3, "6.<|im_end|>")], "\n")])


def test_gpt_oss_trains_every_turn_to_end_with_return_and_its_tool_calls_with_call(stock_chat_dir):
    """gpt-oss ends the last turn with <|return|> (what the model emits) but earlier ones with <|end|>, and
    drops their analysis: a sample per user question, each reply ending with <|return|>. A tool call ends
    with <|call|> (a stop token of its generation config); its analysis stays in the prompt of the answer
    that follows the tool's result (one sample), though the template drops it once that answer is added."""
    messages = [
        USER_1,
        {"role": "assistant", "thinking": "Add them.", "content": "4."},
        USER_2,
        {"role": "assistant", "thinking": "Use the tool.", "tool_calls": ADD},
        TOOL,
        {"role": "assistant", "content": "It is 5."},
    ]
    tokenizer, samples = _samples(stock_chat_dir, "gptoss", messages)
    tool_call = (
        '<|start|>assistant to=functions.add<|channel|>commentary json<|message|>{"a": 2, "b": 3}<|call|>'
    )
    _assert_samples(
        tokenizer,
        messages,
        samples,
        [
            (
                [
                    (
                        1,
                        "<|channel|>analysis<|message|>Add them.<|end|>"
                        + "<|start|>assistant<|channel|>final<|message|>4.<|return|>",
                    )
                ],
                "",
            ),
            (
                [
                    (3, "<|channel|>analysis<|message|>Use the tool.<|end|>" + tool_call),
                    (5, "<|channel|>final<|message|>It is 5.<|return|>"),
                ],
                "",
            ),
        ],
    )
    today = datetime.date.today().isoformat()
    assert f"Current date: {today}" in tokenizer.decode(samples[1][0])  # the system prompt, rendered today
    history = tokenizer.decode(samples[1][0])
    assert "<|channel|>final<|message|>4.<|end|>" in history and "Add them." not in history


def test_glm4_moe_turns_end_with_the_next_turns_stop_token_or_an_appended_eos(stock_chat_dir):
    """GLM-4-MoE writes no end-of-turn token: a turn ends with the next message's <|user|> or
    <|observation|> (stop tokens of its generation config) where the sample goes on, else with EOS
    appended; the reasoning it strips from earlier turns makes a sample per turn."""
    call = {"role": "assistant", "content": "", "tool_calls": ADD}
    messages = [USER_1, {"role": "assistant", "content": "4."}, USER_2, call, TOOL]
    messages.append({"role": "assistant", "content": "It is 5."})
    tokenizer, samples = _samples(stock_chat_dir, "glm4moe", messages)
    arguments = (
        "<arg_key>a</arg_key>\n<arg_value>2</arg_value>\n<arg_key>b</arg_key>\n<arg_value>3</arg_value>"
    )
    _assert_samples(
        tokenizer,
        messages,
        samples,
        [
            (
                [
                    (1, "\n<think></think>\n4.<|user|>"),
                    (3, f"\n<think></think>\n<tool_call>add\n{arguments}\n</tool_call><|observation|>"),
                    (5, "\n<think></think>\nIt is 5.<|endoftext|>"),
                ],
                "",
            )
        ],
    )

    reasoned = [USER_1, {"role": "assistant", "reasoning_content": "Add them.", "content": "4."}, USER_2]
    reasoned.append({"role": "assistant", "content": "6."})
    tokenizer, samples = _samples(stock_chat_dir, "glm4moe", reasoned)
    expected = [
        ([(1, "\n<think>Add them.</think>\n4.<|endoftext|>")], ""),
        ([(3, "\n<think></think>\n6.<|endoftext|>")], ""),
    ]
    _assert_samples(tokenizer, reasoned, samples, expected)
    tokenizer, samples = _samples(stock_chat_dir, "glm4moe", reasoned, generation_config=False)
    _assert_samples(tokenizer, reasoned, samples, expected)  # EOS needs no generation config


def test_a_conversation_that_opens_with_the_assistant_is_refused(stock_chat_dir):
    with pytest.raises(ValueError, match=r"its first message is the assistant's: nothing comes before it"):
        _samples(stock_chat_dir, "qwen3", [{"role": "assistant", "content": "Hello."}, USER_1])


def _numbered_replies(numbered: bool) -> str:
    """ChatML that renders a reply as '...' once a later reply follows it (so a prompt is no prefix of the
    next rendering, as gpt-oss drops a tool call's analysis once its answer comes), and, ``numbered``, the
    last reply with its message index, which the reply rendered alone cannot know."""
    suffix = " + ' (message ' + loop.index0 | string + ')'" if numbered else ""
    return (
        "{%- for message in messages -%}{{- '<|im_start|>' + message['role'] + '\\n' -}}"
        "{%- if message['role'] == 'assistant' -%}"
        "{%- set later = messages[loop.index0 + 1:] | selectattr('role', 'equalto', 'assistant') | list -%}"
        "{{- ('...' if later else message['content']" + suffix + ") + '<|im_end|>\\n' -}}"
        "{%- else -%}{{- message['content'] + '<|im_end|>\\n' -}}{%- endif -%}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )


def test_a_reply_after_a_rewritten_history_is_found_only_where_its_rendering_alone_is_exact(tiny_chat_dir):
    """Where the template rewrites the history once the reply follows it, the reply is taken from the end of
    the rendering, as long as the reply rendered after the user's question alone; a reply whose rendering
    depends on the history (its message index here) is refused, not guessed."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_dir)
    messages = [
        USER_1,
        {"role": "assistant", "content": "4."},
        USER_2,
        {"role": "assistant", "content": "6."},
    ]
    stops = frozenset({tokenizer.eos_token_id})
    tokenizer.chat_template = _numbered_replies(numbered=False)
    samples = turn_samples(tokenizer, messages, stops, {})
    _assert_samples(tokenizer, messages, samples, [([(1, "4.<|im_end|>"), (3, "6.<|im_end|>")], "\n")])
    tokenizer.chat_template = _numbered_replies(numbered=True)
    with pytest.raises(
        ValueError, match=r"generation prompt for message 3 ends .*: the reply's tokens cannot"
    ):
        turn_samples(tokenizer, messages, stops, {})


def test_stop_tokens_are_eos_and_the_generation_configs_and_a_bad_config_is_named(tiny_chat_dir, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_dir)
    assert stop_tokens(tokenizer, str(tmp_path)) == {tokenizer.eos_token_id}
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [0, 1]}')
    assert stop_tokens(tokenizer, str(tmp_path)) == {tokenizer.eos_token_id, 0, 1}
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": "<|im_end|>"}')
    with pytest.raises(
        ValueError, match=r"generation_config.json' has eos_token_id='<\|im_end\|>'; it must be"
    ):
        stop_tokens(tokenizer, str(tmp_path))
