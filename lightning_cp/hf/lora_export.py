"""The weights of a checkpoint as ``export_hf`` writes them, and a LoRA run's ``peft`` adapter directory.

A checkpoint of :class:`~lightning_cp.models.HFCausalLM` with ``lora=`` holds the frozen base under ``peft``'s
names (``...q_proj.base_layer.weight``) beside the adapters (``...q_proj.lora_A.default.weight``, ``lora_B``)
and their AdamW state, and names the base in its hyperparameters (``config``: the pretrained directory, and
``lora``: the settings). :class:`TrainedWeights` gives ``export_hf`` the weights under the names
``save_pretrained`` stores: a full fine-tuning run's as they are, a LoRA run's merged, ``W + (alpha / rank)
B A`` (an embedding's ``W + (alpha / rank) (B A)^T``), computed in fp32 and stored in ``W``'s dtype.
:func:`write_adapter` writes the adapters alone as ``peft``'s ``save_pretrained`` does (``adapter_config.json``,
``adapter_model.safetensors``), for ``PeftModel.from_pretrained(base, directory)``. One process, no process
group, one tensor (a merged one: three) in memory at a time.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_cp.checkpoint_format import Checkpoint
from lightning_cp.hf.lora import BASE_LAYER, LoRA, add_adapters, is_adapter, stored_name

ADAPTER = "default"
"""The adapter name ``peft`` gives the adapters ``HFCausalLM`` injects (a component of their names)."""
_DELTAS = {  # the adapter pair of a layer kind, and whether B A is transposed (an embedding's [vocab, dim])
    "weight": (f"lora_A.{ADAPTER}.weight", f"lora_B.{ADAPTER}.weight", False),
    "embedding": (f"lora_embedding_A.{ADAPTER}", f"lora_embedding_B.{ADAPTER}", True),
}


def lora_of(source: Checkpoint) -> LoRA | None:
    """The LoRA settings ``source`` was trained with (its ``lora`` hyperparameter), ``None`` for full fine-tuning."""
    return LoRA.of(source.hyper_parameters.get("lora"))


class TrainedWeights:
    """The ``transformers`` model's weights in ``source`` under ``prefix``, by the names ``save_pretrained``
    stores: :attr:`shapes` and :meth:`read`. With ``lora`` (the run's settings) ``peft``'s ``base_layer``
    components are left out of the names, the adapters are not listed, and an adapted weight reads merged.

    Raises:
        ValueError: a merge that would change what the trained model computes: an adapted input embedding of
            a model whose output head is tied to it (the head would take the update too; ``peft`` adapts the
            lookup only).
    """

    def __init__(self, source: Checkpoint, prefix: str, lora: LoRA | None, tied: bool) -> None:
        self.source = source
        self.scale = lora.alpha / lora.rank if lora is not None else 0.0
        self.names: dict[str, str] = {}
        """Stored name -> the checkpoint's name of the base weight."""
        self.shapes: dict[str, tuple[torch.Size, torch.dtype]] = {}
        for key, shape in source.shapes.items():
            if not key.startswith(prefix) or (lora is not None and is_adapter(key)):
                continue
            name = stored_name(key.removeprefix(prefix)) if lora is not None else key.removeprefix(prefix)
            self.names[name] = key
            self.shapes[name] = shape
        if tied and any(f".{_DELTAS['embedding'][0]}" in key for key in source.shapes):
            raise ValueError(
                f"export_hf({str(source.path)!r}): the run adapted the input embedding of a model whose output "
                "head is tied to it; merged, the head would change too: export the adapter directory instead "
                "(adapter=True, lightning-cp export-hf --adapter)."
            )

    def read(self, name: str) -> Tensor:
        """The weight stored as ``name``, whole, on the CPU, in the checkpoint's dtype: merged with its adapters
        (in fp32) when it has some."""
        key = self.names[name]
        weight = self.source.read(key)
        pair = self._delta_names(key)
        if pair is None:
            return weight
        a, b, transposed = pair
        delta = self.source.read(b).float() @ self.source.read(a).float()
        return (weight.float() + self.scale * (delta.T if transposed else delta)).to(weight.dtype)

    def _delta_names(self, key: str) -> tuple[str, str, bool] | None:
        """The checkpoint's names of the adapters of the base weight ``key``, if it has some."""
        layer, _, kind = key.rpartition(f".{BASE_LAYER}.")
        if not layer or kind != "weight":
            return None
        for a, b, transposed in _DELTAS.values():
            if f"{layer}.{a}" in self.source.shapes:
                return f"{layer}.{a}", f"{layer}.{b}", transposed
        return None


def write_adapter(
    source: Checkpoint,
    lora: LoRA,
    config: Any,
    pretrained: Path | None,
    output: Path,
    prefix: str,
    dtype: torch.dtype | None,
) -> None:
    """Write ``source``'s adapters into ``output`` as ``PeftModel.save_pretrained`` does: ``adapter_config.json``
    (``peft``'s ``LoraConfig`` of ``lora``, its targets resolved on the model of ``config`` built on ``meta``,
    ``base_model_name_or_path`` the pretrained directory) and ``adapter_model.safetensors`` (``peft``'s
    ``get_peft_model_state_dict`` names, cast to ``dtype`` if given).

    Raises:
        ValueError: ``source`` holds no adapter under ``prefix``.
    """
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    adapters = {
        key.removeprefix(prefix): key for key in source.shapes if key.startswith(prefix) and is_adapter(key)
    }
    if not adapters:
        raise ValueError(f"export_hf({str(source.path)!r}, adapter=True): no LoRA adapter under {prefix!r}.")
    with torch.device("meta"):
        model = add_adapters(AutoModelForCausalLM.from_config(config), replace(lora, quantize=None))
    state = {}
    for name, key in adapters.items():
        tensor = source.read(key)
        state[name] = (tensor.to(dtype) if dtype is not None else tensor).contiguous()
    peft_config = model.peft_config[ADAPTER]
    peft_config.base_model_name_or_path = str(pretrained) if pretrained is not None else None
    peft_config.task_type = "CAUSAL_LM"
    peft_config.inference_mode = True
    # peft picks the adapters by the tuner layers' module names, here the transformers model's; a PeftModel
    # stores them under its own, which wrap that model in "base_model.model.".
    adapter_state = get_peft_model_state_dict(model, state_dict=state, adapter_name=ADAPTER)
    if len(adapter_state) != len(state):
        raise ValueError(
            f"export_hf({str(source.path)!r}, adapter=True): peft recognizes {len(adapter_state)} of the "
            f"checkpoint's {len(state)} adapter tensors under {prefix!r} on {type(model).__name__}."
        )
    save_file(
        {f"base_model.model.{name}": tensor for name, tensor in adapter_state.items()},
        output / "adapter_model.safetensors",
        metadata={"format": "pt"},
    )
    peft_config.save_pretrained(output)
