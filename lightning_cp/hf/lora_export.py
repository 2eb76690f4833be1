"""The weights of a checkpoint as ``export_hf`` writes them, and a LoRA run's ``peft`` adapter directory.

A checkpoint of :class:`~lightning_cp.models.HFCausalLM` with ``lora=`` on a pretrained directory holds the
adapters (``...q_proj.lora_A.default.weight``, ``lora_B``) and their AdamW state, and names its frozen base
(:mod:`lightning_cp.hf.lora_checkpoint`), which :class:`PretrainedBase` reads back from the directory; on a
config dict it holds the base too, under ``peft``'s names (``...q_proj.base_layer.weight``).
:class:`TrainedWeights` gives ``export_hf`` the weights under the names ``save_pretrained`` stores: a full
fine-tuning run's as they are, a LoRA run's merged, ``W + (alpha / rank) B A`` (an embedding's ``W + (alpha /
rank) (B A)^T``), computed in fp32 and stored in ``W``'s dtype.
:func:`write_adapter` writes the adapters alone as ``peft``'s ``save_pretrained`` does (``adapter_config.json``,
``adapter_model.safetensors``), for ``PeftModel.from_pretrained(base, directory)``. One process, no process
group, one tensor (a merged one: three) in memory at a time.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_cp.checkpoint_format import FROZEN_BASE, Checkpoint
from lightning_cp.hf.lora import LoRA, add_adapters, is_adapter, stored_name
from lightning_cp.hf.lora_checkpoint import base_record, check_base

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
    With ``base`` (a checkpoint of the adapters alone) the frozen base is read from its pretrained directory.

    Raises:
        ValueError: a merge that would change what the trained model computes: an adapted input embedding of
            a model whose output head is tied to it (the head would take the update too; ``peft`` adapts the
            lookup only).
    """

    def __init__(
        self,
        source: Checkpoint,
        prefix: str,
        lora: LoRA | None,
        tied: bool,
        base: PretrainedBase | None = None,
    ) -> None:
        self.source = source
        self.prefix = prefix
        self.base = base
        self.scale = lora.alpha / lora.rank if lora is not None else 0.0
        self.names: dict[str, str] = {}
        """Stored name -> the checkpoint's name of the base weight (none when ``base`` holds them)."""
        self.shapes: dict[str, tuple[torch.Size, torch.dtype]] = dict(base.shapes) if base is not None else {}
        for key, shape in source.shapes.items() if base is None else ():
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
        """The weight stored as ``name``, whole, on the CPU, in the checkpoint's dtype (the run's base dtype):
        merged with its adapters (in fp32) when it has some."""
        weight = self.base.read(name) if self.base is not None else self.source.read(self.names[name])
        pair = self._delta_names(name)
        if pair is None:
            return weight
        a, b, transposed = pair
        delta = self.source.read(b).float() @ self.source.read(a).float()
        return (weight.float() + self.scale * (delta.T if transposed else delta)).to(weight.dtype)

    def _delta_names(self, name: str) -> tuple[str, str, bool] | None:
        """The checkpoint's names of the adapters of the weight stored as ``name``, if it has some."""
        layer, _, kind = name.rpartition(".")
        if not layer or kind != "weight":
            return None
        for a, b, transposed in _DELTAS.values():
            if f"{self.prefix}{layer}.{a}" in self.source.shapes:
                return f"{self.prefix}{layer}.{a}", f"{self.prefix}{layer}.{b}", transposed
        return None


class PretrainedBase:
    """The frozen base of a checkpoint that holds a LoRA run's adapters alone
    (:mod:`~lightning_cp.hf.lora_checkpoint`), read from the pretrained ``directory`` as the run computed with
    it: by the text model's names (``names``: the save_pretrained names of ``config``'s causal LM), in the
    run's dtype (``record["dtype"]``), and under QLoRA each weight the run quantized dequantized from its NF4
    quantization (the weights the trained model's logits came from). :attr:`shapes` and :meth:`read`, one
    tensor at a time.

    Raises:
        ValueError: ``directory`` is not the base ``record`` names (:func:`~lightning_cp.hf.lora_checkpoint.
            check_base`), or lacks one of ``names``.
    """

    def __init__(
        self, directory: Path, config: Any, names: list[str], record: Mapping[str, Any], checkpoint: Path
    ) -> None:
        from lightning_cp.hf.composite import StoredNames, is_composite, text_config
        from lightning_cp.hf.qlora import files_by_name, quantize_linear_weights

        self.directory = directory
        self.lora = LoRA(**record["lora"])
        self.dtype: torch.dtype = getattr(torch, record["dtype"])
        found = base_record(directory, self.dtype, self.lora)
        check_base(record, found, checkpoint, "export_hf")
        self.stored = StoredNames(directory, is_composite(config))
        self.files = files_by_name(directory)
        missing = [name for name in names if self.stored(name) not in found["tensors"]]
        if missing:
            raise ValueError(
                f"export_hf: the base {str(directory)!r} does not store {self.stored(missing[0])}."
            )
        self.shapes = {
            name: (torch.Size(found["tensors"][self.stored(name)][0]), self.dtype) for name in names
        }
        self.quantized: set[str] = set()
        if self.lora.quantize is not None:
            from transformers import AutoModelForCausalLM

            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(text_config(config))
            lora = self.lora
            self.quantized = set(
                quantize_linear_weights(model, lora.nf4_block_size, lora.nf4_scaler_block_size)
            )

    @classmethod
    def of(
        cls, source: Checkpoint, directory: Path | None, config: Any, names: list[str], given: bool
    ) -> PretrainedBase | None:
        """The frozen base of ``source`` in ``directory`` (``given`` by the caller, or the one it names);
        ``None`` for a checkpoint that holds its whole model.

        Raises:
            ValueError: a directory ``given`` for a checkpoint that names no base; as the class.
        """
        record = source.metadata.get(FROZEN_BASE)
        if record is None and given:
            raise ValueError(
                f"export_hf({str(source.path)!r}, base={str(directory)!r}): the checkpoint holds its whole model "
                "(it names no frozen base to read from a directory): leave base out."
            )
        return None if record is None else cls(directory, config, names, record, source.path)

    def read(self, name: str) -> Tensor:
        """The base weight ``name`` in the run's dtype, as the run computed with it."""
        from safetensors import safe_open

        key = self.stored(name)
        with safe_open(str(self.directory / self.files[key]), "pt") as handle:
            weight = handle.get_tensor(key).to(self.dtype)
        if name not in self.quantized:
            return weight
        from torchao.quantization import to_nf4

        return to_nf4(weight, self.lora.nf4_block_size, self.lora.nf4_scaler_block_size).get_original_weight()


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
