"""Module classes a strategy argument names (``fsdp_wrap``, ``activation_checkpointing``), and checkpointing them.

Both arguments take classes or class names, so that a YAML config can name a Hugging Face decoder layer
(``"LlamaDecoderLayer"``) without importing it.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from lightning_cp.memory.offload import ActivationOffload, offload_checkpointed

ModuleSpec = str | type[nn.Module]
"""A module class, or its class name (``type(module).__name__``), e.g. ``"LlamaDecoderLayer"``."""


def default_layer_classes(model: nn.Module) -> tuple[str, ...]:
    """The classes of ``model``'s layers as the strategies take them by default (FSDP's units when ``fsdp_wrap``
    is not given; what ``activation_checkpointing`` names for the memory plan): the ``_no_split_modules`` the
    model's modules declare, of the classes it holds.

    Hugging Face models declare their decoder layers there, and so does the package's GPT; the text model of
    a multimodal composite also declares its vision tower's blocks, which it does not hold (left out). Empty
    when no module declares any: everything is then in the root unit.
    """
    present = {type(module).__name__ for module in model.modules()}
    names: list[str] = []
    for module in model.modules():
        for name in getattr(module, "_no_split_modules", None) or ():
            if name not in names and name in present:
                names.append(name)
    return tuple(names)


def check_module_specs(
    owner: str, argument: str, value: Sequence[ModuleSpec] | None
) -> tuple[ModuleSpec, ...] | None:
    """``value`` as a tuple of class names / classes, or a ``TypeError`` naming ``owner(argument=...)``."""
    if value is None:
        return None
    if isinstance(value, (str, type)):
        value = [value]
    specs = tuple(value)
    for spec in specs:
        if not (isinstance(spec, str) or (isinstance(spec, type) and issubclass(spec, nn.Module))):
            raise TypeError(
                f"{owner}({argument}={value!r}): {spec!r} is neither a module class nor a class name; pass "
                'e.g. ["LlamaDecoderLayer"] or [torch.nn.TransformerEncoderLayer].'
            )
    return specs


def resolve_classes(
    owner: str, argument: str, specs: Sequence[ModuleSpec], model: nn.Module
) -> tuple[type[nn.Module], ...]:
    """The module classes ``specs`` names in ``model``; a ``ValueError`` for a spec that matches no module."""
    present = {type(module).__name__: type(module) for module in model.modules()}
    classes: list[type[nn.Module]] = []
    for spec in specs:
        if isinstance(spec, str):
            found = present.get(spec)
        else:
            found = spec if any(isinstance(module, spec) for module in model.modules()) else None
        if found is None:
            name = spec if isinstance(spec, str) else spec.__qualname__
            raise ValueError(
                f"{owner}({argument}=...): {name!r} matches no module of {type(model).__name__}. Its module "
                f"classes are: {', '.join(sorted(present))}."
            )
        classes.append(found)
    return tuple(classes)


def apply_checkpointing(
    module: nn.Module, classes: Sequence[type[nn.Module]], offload: bool | int = False
) -> ActivationOffload | None:
    """Recompute the activations of every submodule of one of ``classes`` in backward, in place.

    Non-reentrant (``torch.distributed._composable.checkpoint``): parameter names do not change, and it
    composes with ``fully_shard`` and DDP. With ``offload``, the inputs the checkpointed modules keep until
    their backward are held in host memory (:func:`lightning_cp.memory.offload_checkpointed`; a number: the
    first that many modules' only), which is returned.
    """
    from torch.distributed._composable import checkpoint

    for submodule in module.modules():
        if isinstance(submodule, tuple(classes)):
            checkpoint(submodule)
    if offload is False:
        return None
    return offload_checkpointed(module, layers=None if offload is True else offload)
