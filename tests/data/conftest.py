"""A tiny chat model directory (``examples/make_tiny_hf_model.py``) shared by the text-data tests, and its
tokenizer with the stock chat templates of models whose templates rewrite earlier turns."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "make_tiny_hf_model.py"


@pytest.fixture(scope="session")
def tiny_chat_dir(tmp_path_factory) -> Path:
    """Model, tokenizer (chat template with generation blocks), ``chat.jsonl`` and ``text.jsonl``."""
    pytest.importorskip("transformers")
    pytest.importorskip("datasets")
    spec = importlib.util.spec_from_file_location("make_tiny_hf_model", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path_factory.mktemp("tiny_chat")
    module.write_tiny_chat_model(out, num_conversations=120)
    return out


STOCK_TEMPLATES = {
    # name: (file in trl/chat_templates, added special tokens, added plain tokens, EOS, generation-config EOS)
    "qwen3": ("qwen3.jinja", [], ["<think>", "</think>"], "<|im_end|>", ["<|im_end|>", "<|endoftext|>"]),
    "qwen3_5_think": (
        "qwen3_5_think.jinja",
        [],
        ["<think>", "</think>"],
        "<|im_end|>",
        ["<|im_end|>", "<|endoftext|>"],
    ),
    "qwen3_5_nothink": (
        "qwen3_5_nothink.jinja",
        [],
        ["<think>", "</think>"],
        "<|im_end|>",
        ["<|im_end|>", "<|endoftext|>"],
    ),
    "gptoss": (
        "gptoss.jinja",
        ["<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|return|>", "<|call|>"],
        [],
        "<|return|>",
        ["<|return|>", "<|endoftext|>", "<|call|>"],
    ),
    "glm4moe": (
        "glm4moe.jinja",
        ["[gMASK]", "<sop>", "<|user|>", "<|assistant|>", "<|system|>", "<|observation|>"],
        ["<think>", "</think>"],
        "<|endoftext|>",
        ["<|endoftext|>", "<|user|>", "<|observation|>"],
    ),
}
"""The stock chat templates that rewrite earlier turns, with the tokens, EOS and generation config's stop
tokens of their models (Qwen3 / Qwen3.5, gpt-oss, GLM-4.5)."""


@pytest.fixture(scope="session")
def stock_chat_dir(tiny_chat_dir, tmp_path_factory):
    """``stock_chat_dir(name, generation_config=True)``: a copy of the tiny tokenizer and data with the
    model's own chat template ``name`` (trl's copy, read without importing trl; skipped without trl), its
    special tokens and EOS, and its ``generation_config.json`` stop tokens (unless ``False``)."""
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("trl")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the stock chat templates come with trl (pip install -e '.[test]')")
    templates = Path(spec.submodule_search_locations[0]) / "chat_templates"
    made = {}

    def make(name: str, generation_config: bool = True) -> Path:
        if (name, generation_config) not in made:
            file, special, plain, eos, stops = STOCK_TEMPLATES[name]
            tokenizer = AutoTokenizer.from_pretrained(tiny_chat_dir)
            tokenizer.add_tokens(special, special_tokens=True)
            tokenizer.add_tokens(plain)
            tokenizer.eos_token = eos
            tokenizer.chat_template = (templates / file).read_text()
            out = tmp_path_factory.mktemp(f"{name}_tokenizer")
            tokenizer.save_pretrained(out)
            if generation_config:
                ids = tokenizer.convert_tokens_to_ids(stops)
                (out / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}))
            made[name, generation_config] = out
        return made[name, generation_config]

    return make
