"""Broadcasting parameters and buffers, tensor subclasses included (the one way the package does it)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from lightning_cp.parallel.layout import ProcessGroup


def broadcast_tensors(tensors: Iterable[torch.Tensor], src: int, group: ProcessGroup | None) -> None:
    """Overwrite ``tensors`` in place with global rank ``src``'s, over ``group``.

    A tensor subclass that wraps plain tensors (``torchao``'s NF4 weight: its 4-bit codes and scales) is
    broadcast through them: a collective cannot take the wrapper itself.

    Communication: a broadcast per plain tensor over ``group``.
    """
    for tensor in tensors:
        for plain in _plain_tensors(tensor.data):
            dist.broadcast(plain, src=src, group=group)


def _plain_tensors(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    if not is_traceable_wrapper_subclass(tensor):
        yield tensor
        return
    names, _ = tensor.__tensor_flatten__()
    for name in names:
        yield from _plain_tensors(getattr(tensor, name))
