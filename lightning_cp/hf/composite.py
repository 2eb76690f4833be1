"""Multimodal composite checkpoints (Qwen3.5, Gemma-3, Gemma-4, Llama-4): their text model is what trains.

A real Qwen3.5, Gemma-3 (4B and up), Gemma-4 or Llama-4 checkpoint is a composite: a ``*ForConditionalGeneration``
whose ``config.json`` holds a ``text_config`` beside a ``vision_config`` (and an audio one), and whose
safetensors hold the language model under a prefix of its own (``model.language_model.``, or the older
``language_model.model.``) beside the vision tower and the projector. Long-context training is of the text
model, so :func:`~lightning_cp.load_pretrained` builds the text causal LM of ``text_config``
(``Qwen3_5ForCausalLM``, ``Gemma3ForCausalLM``, ...) and reads its tensors from the composite's files under
their stored names (:class:`StoredNames`); the other towers are not loaded (not in the module, not trained,
no memory). :func:`~lightning_cp.export_hf` writes the composite back: every tensor of the input checkpoint,
the trained text weights in place of the stored ones and the rest byte for byte as they were, with the
composite's ``config.json``, so ``transformers`` loads the result into the composite class.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def text_config(config: Any) -> Any:
    """The config of the causal LM to build and train: ``config`` itself, or a composite's text config."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def is_composite(config: Any) -> bool:
    """Whether ``config`` is a composite's (its text model is a sub-config)."""
    return text_config(config) is not config


def stored_tensor_names(directory: Path) -> list[str]:
    """Every tensor name of the safetensors of ``directory`` (the index's, else each file's header)."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return list(json.loads(index.read_text())["weight_map"])
    from safetensors import safe_open

    names = []
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            names += list(handle.keys())
    return names


class StoredNames:
    """Where the text model's tensors are in a checkpoint: ``stored(name)`` for a parameter ``name`` of the
    text causal LM (``model.layers.0...``, ``lm_head.weight``). The identity for a plain causal-LM checkpoint.

    For a composite, the body's prefix is where the input embedding is stored (``model.language_model.`` for
    Qwen3.5 and Gemma-4, ``language_model.model.`` for Gemma-3 and Llama-4), and the head is ``lm_head.weight``
    or the language model's own (``language_model.lm_head.weight``); a tied head is not stored.

    Raises:
        ValueError: a composite checkpoint without a language model's input embedding.
    """

    def __init__(self, directory: Path, composite: bool) -> None:
        self.composite = composite
        self.names = set(stored_tensor_names(directory))
        self.body = "model."
        self.head = "lm_head.weight"
        if not composite:
            return
        embedding = sorted(
            n for n in self.names if n.endswith(".embed_tokens.weight") and ("language" in n or "text" in n)
        )
        if not embedding:
            raise ValueError(
                f"{directory} has a composite config but no language model's embed_tokens.weight among its "
                "tensors: it is not a checkpoint transformers' save_pretrained wrote for this config."
            )
        self.body = embedding[0].removesuffix("embed_tokens.weight")
        candidates = ("lm_head.weight", self.body.removesuffix("model.") + "lm_head.weight")
        self.head = next((c for c in candidates if c in self.names), "lm_head.weight")

    def __call__(self, name: str) -> str:
        if name == "lm_head.weight":
            return self.head
        return self.body + name.removeprefix("model.") if name.startswith("model.") else name

    def others(self, text_names: set[str]) -> list[str]:
        """The stored tensors that are not the text model's (``text_names`` stored names): the other towers."""
        return sorted(self.names - text_names)
