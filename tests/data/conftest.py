"""A tiny chat model directory (``examples/make_tiny_hf_model.py``) shared by the text-data tests."""

from __future__ import annotations

import importlib.util
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
