"""What the blocks of a snapshot hold: the categories, and the byte ranges of the tensors the callback knows.

Blocks allocated before recording started (the parameters, usually) have no stack in the trace, so the
report names what they hold instead: :func:`known_tensors` reads the address range of the
``LightningModule``'s parameters, their ``.grad`` and its buffers, and of the optimizers' state. A block
``[addr, addr + size)`` holds the tensors whose range lies inside it (see :mod:`.timeline`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

import torch
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

# Categories of blocks. The first four name the tensors the callback knows; the last two are what a block
# holding none of them is counted as.
PARAMETERS = "parameters"
GRADIENTS = "gradients"
OPTIMIZER_STATE = "optimizer state"
BUFFERS = "buffers"
ACTIVATIONS = "activations and temporaries"
OTHER = "other (allocated before the trace)"

TensorRanges = Mapping[tuple[int, int], tuple[str, str]]
"""Known tensors of one device by address: ``{(start, end): (category, name)}``, where ``[start, end)`` are
the bytes a tensor's elements occupy."""

TensorsByDevice = dict[torch.device, dict[tuple[int, int], tuple[str, str]]]
"""``{device: TensorRanges}``."""


def known_tensors(module: torch.nn.Module, optimizers: Sequence[Optimizer]) -> TensorsByDevice:
    """The byte ranges of ``module``'s parameters, gradients and buffers and of the optimizers' state.

    Returns ``{device: {(start, end): (category, name)}}``; a name is the parameter's
    (``model.head.weight``), or for optimizer state the key and the parameter (``exp_avg of
    model.head.weight``). A range listed twice keeps its first category, in the order parameters,
    gradients, buffers, optimizer state. A DTensor counts as its local shard, the memory of this rank.
    Reads addresses only: nothing is allocated or synchronized.
    """
    by_device: TensorsByDevice = defaultdict(dict)

    def add(tensor: torch.Tensor, category: str, name: str) -> None:
        if isinstance(tensor, DTensor):
            tensor = tensor.to_local()
        if tensor.layout != torch.strided or tensor.numel() == 0:
            return
        try:
            start = tensor.data_ptr()
        except RuntimeError:  # wrapper subclasses (e.g. quantized weights) have no storage of their own
            return
        # The elements span up to the last one's offset; a view may skip bytes in between.
        extent = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
        span = (start, start + extent * tensor.element_size())
        by_device[tensor.device].setdefault(span, (category, name))

    names: dict[int, str] = {}
    for name, param in module.named_parameters():
        names[id(param)] = name
        add(param, PARAMETERS, name)
        if param.grad is not None:
            add(param.grad, GRADIENTS, name)
    for name, buffer in module.named_buffers():
        add(buffer, BUFFERS, name)
    for optimizer in optimizers:
        for param, state in optimizer.state.items():
            owner = names.get(id(param), f"a {tuple(param.shape)} parameter outside the module")
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    add(value, OPTIMIZER_STATE, f"{key} of {owner}")
    return dict(by_device)
