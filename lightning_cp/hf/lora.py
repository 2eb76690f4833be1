"""LoRA adapters on a ``transformers`` causal LM, through ``peft``: the settings, the injection, the checks.

:class:`LoRA` is what :class:`~lightning_cp.models.HFCausalLM` takes as ``lora=``; :func:`add_adapters`
injects ``peft``'s LoRA layers into the model in place (``peft.inject_adapter_in_model``: the model keeps its
class, its ``get_decoder()``, its output head and its parameter names, plus ``base_layer`` / ``lora_A`` /
``lora_B`` components), after the base is built or loaded and before tiling or checkpointing wrap its modules.
Only the adapters require a gradient; the base is frozen as it was built (never upcast, never copied per
step). With ``LoRA(quantize="nf4")`` the decoder's linear weights become ``torchao`` NF4 tensors first
(:mod:`lightning_cp.hf.qlora`).

LoRA on a linear layer computes each token from that token alone (``x W^T + s * x A^T B^T``), so under
context parallelism each rank's tokens give their share of every adapter gradient, and the strategy's
average over DP x CP gives the unsharded model's: nothing changes in the step. What cannot be kept exact is
refused at setup (:func:`check_adapters`): dropout on the adapters' input under ``cp > 1`` (each rank would
draw its own masks for its tokens; the unsharded model draws them for the whole sequence at once: set
``dropout=0``, as long-context recipes do), DoRA (its magnitude is not part of what the tests compare), and
an adapter on anything but ``nn.Linear`` / ``nn.Embedding`` (a token mixer's convolution, whose
context-parallel forward reads the base weight only, would drop it).

Pretrained models under :class:`~lightning_cp.MegatronCPFSDPStrategy` are built on the ``meta`` device;
``peft`` puts the adapters of a layer on its base weight's device, so they would be ``meta`` too.
:func:`materialize_adapters` (the ``transformers`` integration's ``prepare``, before sharding) allocates them
and runs ``peft``'s own initialization; the strategy then broadcasts them from the first rank like every
parameter that is not on ``meta``, and the loader (:mod:`lightning_cp.hf.loading`) reads the base weights
under their stored names (``peft``'s ``base_layer`` component left out).

``peft`` (and ``torchao`` for QLoRA) is an optional dependency: ``pip install 'lightning-cp[lora]'``.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

INSTALL = "pip install 'lightning-cp[lora]'"
"""What the errors for a missing ``peft`` or ``torchao`` say to run."""

BASE_LAYER = "base_layer"
"""The name ``peft``'s layers give the layer they wrap: a component of the base weights' names that the
pretrained checkpoint does not have."""


@dataclass(frozen=True)
class LoRA:
    """The LoRA adapters of :class:`~lightning_cp.models.HFCausalLM` (``lora=LoRA(rank=16)``; in YAML its fields'
    dict). The update of a targeted ``W`` is ``(alpha / rank) * B A``, ``A`` random, ``B`` zero at the start
    (``peft``'s initialization).

    Raises:
        ValueError: a rank that is not a positive integer, an ``alpha`` that is not positive and finite, a
            dropout outside ``[0, 1)``, no target module, a ``quantize`` other than ``None`` or ``"nf4"``, NF4
            block sizes that are not positive.
    """

    rank: int = 16
    """Rank ``r`` of ``A [r, in]`` and ``B [out, r]``."""
    alpha: float = 32.0
    """Scale numerator: the update is multiplied by ``alpha / rank``."""
    dropout: float = 0.0
    """Dropout on the adapters' input; must be 0 under ``cp > 1`` (refused at setup otherwise)."""
    target_modules: str | list[str] = "all-linear"
    """``"all-linear"``: every ``nn.Linear`` but the output head (not a mixture of experts' fused expert weights
    or its router); or module names / suffixes (``["q_proj", "v_proj"]``), as ``peft.LoraConfig`` takes them."""
    quantize: Literal["nf4"] | None = None
    """``"nf4"``: QLoRA, the decoder's frozen linear weights stored as ``torchao`` NF4 (4-bit, about 0.52 bytes
    per weight with the block scales); ``None``: the base in ``HFCausalLM``'s ``dtype``."""
    nf4_block_size: int = 64
    """NF4: weights per absmax block (QLoRA's 64). Every quantized weight's size (its shard's, under FSDP) must
    be a multiple of ``nf4_block_size * nf4_scaler_block_size``."""
    nf4_scaler_block_size: int = 256
    """NF4: block scales per block of the scales' own 8-bit quantization (QLoRA's 256)."""

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRA(rank={self.rank!r}) must be a positive integer (16 is common).")
        if not (isinstance(self.alpha, int | float) and math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"LoRA(alpha={self.alpha!r}) must be a positive number (often 2 * rank).")
        if not (isinstance(self.dropout, int | float) and 0.0 <= self.dropout < 1.0):
            raise ValueError(f"LoRA(dropout={self.dropout!r}) must be in [0, 1).")
        if not self.target_modules or not isinstance(self.target_modules, str | list | tuple):
            raise ValueError(
                f"LoRA(target_modules={self.target_modules!r}): give 'all-linear' or a list of module names."
            )
        if self.quantize not in (None, "nf4"):
            raise ValueError(f"LoRA(quantize={self.quantize!r}) must be None or 'nf4'.")
        for name in ("nf4_block_size", "nf4_scaler_block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LoRA({name}={value!r}) must be a positive integer.")

    @classmethod
    def of(cls, value: LoRA | Mapping[str, Any] | None) -> LoRA | None:
        """``value`` as settings: itself, or built from its fields' dict (LightningCLI, a checkpoint's
        hyperparameters); ``None`` stays ``None``."""
        return cls(**value) if isinstance(value, Mapping) else value


def require_peft() -> None:
    """Raise the ``ImportError`` that says how to install ``peft``, if it is missing."""
    if importlib.util.find_spec("peft") is None:
        raise ImportError(f"LoRA needs peft: {INSTALL}.")


def add_adapters(model: nn.Module, settings: LoRA) -> nn.Module:
    """Inject ``settings``' LoRA layers into ``model`` (a ``transformers`` causal LM) in place and return it.

    With ``quantize="nf4"`` the decoder's linear weights are quantized first
    (:func:`~lightning_cp.hf.qlora.quantize_linear_weights`: on a ``meta`` build, the loader quantizes them as
    it reads them). Afterwards only the adapters require a gradient, in fp32 (or the base weights' dtype
    where wider; on a ``meta`` build on ``meta``: :func:`materialize_adapters` allocates them). No
    communication.

    Raises:
        ImportError: ``peft`` (or, for NF4, ``torchao``) is not installed.
        ValueError: ``target_modules`` matches no module of ``model``; NF4 block sizes that do not divide a
            weight.
    """
    require_peft()
    from peft import LoraConfig, inject_adapter_in_model

    if settings.quantize == "nf4":
        from lightning_cp.hf.qlora import quantize_linear_weights

        quantize_linear_weights(model, settings.nf4_block_size, settings.nf4_scaler_block_size)
    targets = settings.target_modules
    config = LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=_all_linear(model) if targets == "all-linear" else targets,
        bias="none",
    )
    try:
        with _targets_as_given():
            inject_adapter_in_model(config, model)
    except ValueError as error:  # peft: "Target modules ... not found in the base model"
        first = str(error).splitlines()[0]
        raise ValueError(
            f"LoRA(target_modules={settings.target_modules!r}): {first} ({type(model).__name__}'s linear layers "
            f"are named {', '.join(sorted(_linear_names(model)))})."
        ) from None
    _adapters_in_fp32(model)
    return model


_PEFT_CONVERSION = "peft.utils.transformers_weight_conversion"
"""Where ``peft`` (0.18 and later, under ``transformers`` 5) rewrites a mixture-of-experts model's LoRA targets."""


@contextmanager
def _targets_as_given() -> Iterator[None]:
    """Inside, ``peft`` adapts the modules its config names, as named.

    For model types whose experts ``transformers`` 5 fuses (DeepSeek-V2/V3, GLM-4.x MoE, Qwen2/3-MoE, Mixtral...),
    ``peft`` rewrites every target named like an expert's projection (``gate_proj``, ``up_proj``, ``down_proj``,
    ``w1``...) into the fused experts' parameters, so that adapters trained under ``transformers`` 4 load: a dense
    MLP's and the shared experts' ``nn.Linear`` layers are then left out and the fused experts adapted instead,
    which :func:`check_adapters` refuses. The targets here are ``nn.Linear`` modules by name, so the rewrite is
    turned off for the injection (a ``peft`` without it has nothing to turn off)."""
    try:
        conversion = importlib.import_module(_PEFT_CONVERSION)
    except ImportError:
        yield
        return
    original = conversion.convert_peft_config_for_transformers
    conversion.convert_peft_config_for_transformers = lambda *args, **kwargs: None
    try:
        yield
    finally:
        conversion.convert_peft_config_for_transformers = original


def _adapters_in_fp32(model: nn.Module) -> None:
    """The adapters of a bf16 / fp16 base in fp32: the trained weights' master copy (AdamW's updates of a
    rank-16 adapter are far below bf16's resolution), while the frozen base stays as it was built. Under
    ``bf16-mixed`` autocast runs them in bf16; ``bf16-true`` casts the whole module afterwards."""
    for _, layer in adapter_layers(model):
        for kind in layer.adapter_layer_names:
            for parameter in getattr(layer, kind).parameters():
                if parameter.dtype in (torch.bfloat16, torch.float16):
                    parameter.data = parameter.data.float()


def _all_linear(model: nn.Module) -> list[str]:
    """What ``"all-linear"`` means here: the names of every ``nn.Linear`` of ``model`` but its output head. Given
    ``"all-linear"`` itself, ``peft`` also adapts a mixture of experts' fused ``[experts, out, in]`` weights and
    its router through ``target_parameters`` (Qwen3-MoE under ``transformers`` 5), which are not ``nn.Linear``:
    :func:`check_adapters` would refuse them, and ``lightning-cp plan`` counts the linear layers only."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return [
        name for name, module in model.named_modules() if isinstance(module, nn.Linear) and module is not head
    ]


def _linear_names(model: nn.Module) -> set[str]:
    return {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def adapter_layers(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """The ``peft`` tuner layers in ``module`` (a layer that wraps a base layer with adapters), by name; none
    when ``peft`` was never imported."""
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    if tuners is None:
        return
    for name, child in module.named_modules():
        if isinstance(child, tuners.BaseTunerLayer):
            yield name, child


@contextmanager
def adapters_off(module: nn.Module) -> Iterator[None]:
    """Inside, every ``peft`` tuner layer in ``module`` computes its base layer alone: ``module`` is the
    frozen base model (the reference policy of RL with LoRA), as ``PeftModel.disable_adapter()`` makes it
    for a model that ``peft`` wraps (through the same ``enable_adapters`` of each layer, which also turns the
    adapters' ``requires_grad`` off inside and back on on exit: call it without a graph)."""
    layers = [layer for _, layer in adapter_layers(module) if not layer.disable_adapters]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def materialize_adapters(module: nn.Module) -> None:
    """Allocate, in host memory, the adapters of every ``peft`` LoRA layer in ``module`` that are on the
    ``meta`` device (a pretrained model built on ``meta`` for the FSDP strategy), with ``peft``'s own
    initialization of each adapter (``reset_lora_parameters``, with the ``init_lora_weights`` of its config
    where a ``peft`` model holds one; default: ``A`` Kaiming-uniform, ``B`` zero). The strategy broadcasts
    them from the first rank before sharding. No communication."""
    configs: dict[str, Any] = {}
    for child in module.modules():
        configs.update(getattr(child, "peft_config", None) or {})
    for _, layer in adapter_layers(module):
        reset = getattr(layer, "reset_lora_parameters", None)
        for adapter in getattr(layer, "active_adapters", ()):
            parts = [
                getattr(layer, kind)[adapter]
                for kind in layer.adapter_layer_names
                if adapter in getattr(layer, kind)
            ]
            if not any(p.is_meta for part in parts for p in _tensors(part)):
                continue
            for part in parts:
                if isinstance(part, nn.Module):
                    part.to_empty(device="cpu")
            for kind in layer.adapter_layer_names:  # a ParameterDict entry (embedding adapters)
                table = getattr(layer, kind)
                if isinstance(table, nn.ParameterDict) and adapter in table and table[adapter].is_meta:
                    table[adapter] = nn.Parameter(torch.empty_like(table[adapter], device="cpu"))
            if reset is not None:
                init = getattr(configs.get(adapter), "init_lora_weights", True)
                reset(adapter, init)


def _tensors(part: Any) -> list[torch.Tensor]:
    return list(part.parameters()) if isinstance(part, nn.Module) else [part]


def check_adapters(model: nn.Module, where: str, cp: int) -> None:
    """Refuse the ``peft`` adapters of ``model`` (a ``transformers`` model of the module, named ``where``) that
    would not train as the unsharded model does under ``cp`` ranks per sequence: dropout on an adapter's input
    under ``cp > 1``, DoRA, an adapter on a layer that is not ``nn.Linear`` or ``nn.Embedding``. Reads the
    modules only (a ``meta`` build will do). Local, no communication.

    Raises:
        ValueError: naming ``where``, the layer, what it does and what to set instead.
    """
    name = f"{where} ({type(model).__name__})"
    for layer_name, layer in adapter_layers(model):
        base = layer.get_base_layer()
        if not isinstance(base, nn.Linear | nn.Embedding):
            raise ValueError(  # noqa: TRY004 - the setup's refusals are all ValueErrors
                f"{name}: {layer_name} puts a LoRA adapter on a {type(base).__name__}; lightning_cp trains "
                "adapters on nn.Linear and nn.Embedding layers only (a token mixer's own layers run their "
                "context-parallel forward without it): leave it out of target_modules."
            )
        if len(getattr(layer, "lora_magnitude_vector", None) or {}):
            raise ValueError(
                f"{name}: {layer_name} is a DoRA adapter (use_dora=True), which lightning_cp does not check "
                "against the unsharded model: use plain LoRA (use_dora=False)."
            )
        dropouts = getattr(layer, "lora_dropout", None) or {}
        rates = [m.p for m in dropouts.values() if isinstance(m, nn.Dropout) and m.p > 0]
        if cp > 1 and rates:
            raise ValueError(
                f"{name}: {layer_name} has LoRA dropout {rates[0]}; under context parallelism (cp={cp}) each rank "
                "would draw the masks of its own tokens from its own generator (peft's nn.Dropout), not those the "
                "unsharded model draws for the whole sequence, so the run would not be the unsharded model's: "
                "set the LoRA dropout to 0 (LoRA(dropout=0.0), LoraConfig(lora_dropout=0.0)), or cp=1."
            )


def stored_name(name: str) -> str:
    """The checkpoint's name of the parameter or buffer ``name`` of a model with ``peft`` adapters: without
    :data:`BASE_LAYER` components (``...q_proj.base_layer.weight`` is stored as ``...q_proj.weight``)."""
    return ".".join(part for part in name.split(".") if part != BASE_LAYER)


def is_adapter(name: str) -> bool:
    """Whether ``name`` is the name of a ``peft`` LoRA adapter's tensor (``lora_A``, ``lora_B``, ...)."""
    return any(part.startswith("lora_") for part in name.split("."))
