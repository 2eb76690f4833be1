"""Activation offload: what checkpointed layers keep between forward and backward, held in host memory.

Under non-reentrant activation checkpointing (``torch.distributed._composable.checkpoint``) a checkpointed
layer keeps only its inputs until its backward recomputes it; for a decoder layer that is the
``[B, S_local, d]`` hidden states, once per layer. :func:`offload_checkpointed` moves them to host memory
right after they are saved and brings them back ahead of need:

- **pack** (forward, when the checkpoint saves a call's positional tensor inputs): the tensor is copied to a
  host buffer (pinned, on CUDA: on a side stream after the compute stream's pending work, the device
  memory returned to the allocator once that copy ran), and autograd keeps the host copy instead;
- **prefetch** (backward): when the first saved input of a call is unpacked (its recomputation starts), the
  inputs of the call that ran just before it in the forward are copied back (on CUDA on a second side
  stream, overlapped with this call's recomputation and backward);
- **unpack**: the compute stream waits for the copy back (made now if no prefetch did).

Parameters, tensors of other types (``DTensor``) and tensors smaller than ``min_bytes`` stay where they are.
A tensor saved by several calls (GPT's RoPE tables) is copied once and brought back once, and stays on the
device until its last call's backward. On CPU the host is the device: the copies are real (so the logic
runs and the bytes it moves are counted) and the streams are absent. The values are copies, bit for bit:
losses and gradients are those of checkpointing alone. No communication.

Keyword tensor arguments are kept by the checkpoint itself, not saved through autograd: they stay on the
device (``transformers``' decoder layers get their hidden states positionally, their RoPE tables, shared by
every layer, as a keyword).
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed._composable import checkpoint

from lightning_cp.adaptation import add_hooks

MIN_OFFLOAD_BYTES = 2**16
"""Saved inputs smaller than this stay on the device: a copy costs more than it saves (default ``min_bytes``)."""

HOST_PAGE_BYTES = 2**26
"""An offloaded tensor is held on the host in pages of this many bytes (the last one shorter). PyTorch's
caching host allocator rounds every pinned block up to a power of two (torch 2.13:
``CachingHostAllocatorImpl``), so a 4.9 GiB layer input in one block would take 8 GiB; in 64 MiB pages (a
power of two, reused from the allocator's cache step after step) it takes its size and at most one rounded
page more. Each page is one copy of 64 MiB: large enough for the copy engines' full speed."""


@dataclass
class OffloadStats:
    """What an :class:`ActivationOffload` did since it was attached (or since :meth:`ActivationOffload.reset_stats`)."""

    offloaded_bytes: int = 0
    """Bytes copied to host memory (a tensor saved by several calls counted once)."""
    offloaded_tensors: int = 0
    """Tensors copied to host memory."""
    kept_bytes: int = 0
    """Bytes of saved inputs left on the device (parameters, other tensor types, below ``min_bytes``), per save."""
    prefetched_tensors: int = 0
    """Tensors brought back ahead of need: when the backward of the call after theirs started."""
    fetched_on_unpack_tensors: int = 0
    """Tensors brought back when unpacked (the last call's in the forward, which nothing precedes in backward)."""
    bytes_by_module: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """Offloaded bytes by the checkpointed module's qualified name."""


class _HostCopy:
    """One offloaded tensor: its bytes in host pages (:data:`HOST_PAGE_BYTES`), and its device copy while
    brought back."""

    __slots__ = ("device", "device_copy", "dtype", "pages", "ready", "shape", "uses")

    def __init__(self, pages: list[Tensor], like: Tensor, ready: Any) -> None:
        self.pages = pages  # uint8, in order: the tensor's bytes
        self.shape, self.dtype, self.device = like.shape, like.dtype, like.device
        self.ready = ready  # CUDA event after the copy to host; None on CPU
        self.device_copy: Tensor | None = None
        self.uses = 0  # saves not yet unpacked: the device copy is dropped after the last one


class _Group:
    """The saved inputs of one call of a checkpointed module, and the call before it in the forward."""

    __slots__ = ("__weakref__", "copies", "previous", "started")

    def __init__(self, previous: _Group | None) -> None:
        self.previous = weakref.ref(previous) if previous is not None else None
        self.copies: list[_HostCopy] = []
        self.started = False  # its backward started: its predecessor was prefetched


class _Saved:
    """What autograd keeps for one saved input: the host copy and its call."""

    __slots__ = ("copy", "group")

    def __init__(self, copy: _HostCopy, group: _Group) -> None:
        self.copy, self.group = copy, group


class ActivationOffload:
    """Keeps the saved inputs of checkpointed modules in host memory between forward and backward.

    Built by :func:`offload_checkpointed`; :attr:`stats` counts what it moved.

    Args:
        min_bytes: saved inputs smaller than this stay on the device (default :data:`MIN_OFFLOAD_BYTES`).
    """

    def __init__(self, min_bytes: int | None = None) -> None:
        self.min_bytes = MIN_OFFLOAD_BYTES if min_bytes is None else min_bytes
        if self.min_bytes < 0:
            raise ValueError(f"ActivationOffload(min_bytes={min_bytes}): use a number of bytes >= 0.")
        self.stats = OffloadStats()
        self.modules: list[str] = []
        self._last: weakref.ref[_Group] | None = None
        self._copies: dict[tuple[Any, ...], tuple[weakref.ref[Tensor], int, _HostCopy]] = {}
        self._streams: dict[torch.device, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}

    def reset_stats(self) -> None:
        """Start counting anew."""
        self.stats = OffloadStats()

    def attach(self, name: str, module: nn.Module) -> None:
        """Offload the saved inputs of ``module``, which ``checkpoint`` (composable) already recomputes.

        Hooks: a forward pre-hook that runs before the checkpoint's (so the inputs it saves are packed
        here) and a forward hook after the checkpoint's (so the hooks are left in the order they were
        entered). The recomputation in backward, where the checkpoint's hooks are off, is left alone.
        """
        if checkpoint.state(module) is None:
            raise ValueError(
                f"ActivationOffload.attach({name!r}): {type(module).__name__} is not checkpointed; apply "
                "torch.distributed._composable.checkpoint to it first."
            )
        entered: list[saved_tensors_hooks | None] = []

        def enter(module: nn.Module, args: tuple[Any, ...]) -> None:
            hooks = None
            if torch.is_grad_enabled() and checkpoint.state(module).enable_hook:
                group = _Group(self._last() if self._last is not None else None)
                self._last = weakref.ref(group)
                self._forget_dead_tensors()
                hooks = saved_tensors_hooks(lambda tensor: self._pack(tensor, group, name), self._unpack)
                hooks.__enter__()
            entered.append(hooks)

        def leave(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            hooks = entered.pop() if entered else None  # empty: an earlier pre-hook raised
            if hooks is not None:
                hooks.__exit__(None, None, None)

        if add_hooks(module, "offload", pre=enter, post=leave, prepend=True):
            self.modules.append(name)

    def _forget_dead_tensors(self) -> None:
        """Drop the dedupe entries of tensors that no longer exist (their storage may be reused)."""
        self._copies = {key: entry for key, entry in self._copies.items() if entry[0]() is not None}

    def _pack(self, tensor: Tensor, group: _Group, name: str) -> Tensor | _Saved:
        size = tensor.numel() * tensor.element_size()
        if type(tensor) is not Tensor or size < self.min_bytes or tensor.device.type not in ("cpu", "cuda"):
            self.stats.kept_bytes += size
            return tensor
        key = (
            tensor.device,
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tensor.stride(),
            tensor.dtype,
        )
        known = self._copies.get(key)
        if known is not None and known[0]() is tensor and known[1] == tensor._version:
            copy = known[2]
        else:
            copy = self._to_host(tensor)
            self._copies[key] = (weakref.ref(tensor), tensor._version, copy)
            self.stats.offloaded_bytes += size
            self.stats.offloaded_tensors += 1
            self.stats.bytes_by_module[name] += size
        copy.uses += 1
        group.copies.append(copy)
        return _Saved(copy, group)

    def _unpack(self, saved: Tensor | _Saved) -> Tensor:
        if isinstance(saved, Tensor):
            return saved
        copy, group = saved.copy, saved.group
        if not group.started:  # its recomputation starts: its own inputs first, then its predecessor's
            group.started = True
            self.stats.fetched_on_unpack_tensors += self._fetch_missing(group.copies)
            previous = group.previous() if group.previous is not None else None
            self.stats.prefetched_tensors += self._fetch_missing(
                previous.copies if previous is not None else []
            )
        if copy.device_copy is None:
            self.stats.fetched_on_unpack_tensors += self._fetch_missing([copy])
        tensor = copy.device_copy
        assert tensor is not None
        if tensor.is_cuda:
            stream = torch.cuda.current_stream(tensor.device)
            stream.wait_event(copy.ready)
            tensor.record_stream(stream)
        copy.uses -= 1
        if copy.uses <= 0:
            copy.device_copy = None
        return tensor

    def _fetch_missing(self, copies: list[_HostCopy]) -> int:
        """Start copying back those of ``copies`` not on the device; how many."""
        missing = [copy for copy in copies if copy.device_copy is None]
        for copy in missing:
            self._fetch(copy)
        return len(missing)

    def _to_host(self, tensor: Tensor) -> _HostCopy:
        """A host copy of ``tensor`` in pages; on CUDA pinned and asynchronous, on the offload stream."""
        source = _bytes_of(tensor.detach())
        pages = [
            torch.empty(len(part), dtype=torch.uint8, pin_memory=tensor.is_cuda)
            for part in source.split(HOST_PAGE_BYTES)
        ]
        if not tensor.is_cuda:
            for page, part in zip(pages, source.split(HOST_PAGE_BYTES), strict=True):
                page.copy_(part)
            return _HostCopy(pages, tensor, None)
        to_host, _ = self._side_streams(tensor.device)
        to_host.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(to_host):
            for page, part in zip(pages, source.split(HOST_PAGE_BYTES), strict=True):
                page.copy_(part, non_blocking=True)
            source.record_stream(to_host)  # its memory is reused only after these copies ran
        return _HostCopy(pages, tensor, to_host.record_event())

    def _fetch(self, copy: _HostCopy) -> None:
        """Start copying ``copy`` back to its device (on CUDA on the prefetch stream, after its copy to host)."""
        if copy.device.type != "cuda":
            copy.device_copy = self._from_pages(copy, non_blocking=False)
            return
        _, to_device = self._side_streams(copy.device)
        with torch.cuda.stream(to_device):  # allocated on this stream: no pending compute reads its memory
            to_device.wait_event(copy.ready)
            copy.device_copy = self._from_pages(copy, non_blocking=True)
            copy.ready = to_device.record_event()

    @staticmethod
    def _from_pages(copy: _HostCopy, non_blocking: bool) -> Tensor:
        """A new tensor on ``copy``'s device filled from its pages (on the current stream)."""
        tensor = torch.empty(copy.shape, dtype=copy.dtype, device=copy.device)
        for part, page in zip(_bytes_of(tensor).split(HOST_PAGE_BYTES), copy.pages, strict=True):
            part.copy_(page, non_blocking=non_blocking)
        return tensor

    def _side_streams(self, device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        if device not in self._streams:
            self._streams[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return self._streams[device]


def _bytes_of(tensor: Tensor) -> Tensor:
    """``tensor``'s elements as one flat ``uint8`` view (of a contiguous copy, when it is not contiguous)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def offload_checkpointed(
    model: nn.Module, min_bytes: int | None = None, layers: int | None = None
) -> ActivationOffload:
    """Keep the saved inputs of ``model``'s checkpointed modules in host memory between forward and backward.

    Every outermost submodule that ``torch.distributed._composable.checkpoint`` recomputes (what the
    strategies' ``activation_checkpointing`` applies) gets :meth:`ActivationOffload.attach`, or the first
    ``layers`` of them in the model's order. Call it after checkpointing and before training; the strategies
    do with ``offload_activations``.

    Args:
        model: a module with checkpointed submodules.
        min_bytes: saved inputs smaller than this stay on the device (default :data:`MIN_OFFLOAD_BYTES`).
        layers: offload only the first this many checkpointed modules' inputs (the earliest in the forward,
            the last back-propagated: the later ones' stay on the device, where their backward comes first),
            as ``lightning-cp plan`` chooses where host memory is the bound (``+offload:N``); ``None``: all.

    Returns:
        The :class:`ActivationOffload`, whose ``stats`` count the bytes moved.

    Raises:
        ValueError: when no submodule of ``model`` is checkpointed, or ``layers`` is not a positive integer.
    """
    if layers is not None and (isinstance(layers, bool) or not isinstance(layers, int) or layers < 1):
        raise ValueError(
            f"offload_checkpointed(layers={layers!r}): use a positive number of layers, or None."
        )
    offload = ActivationOffload(min_bytes)
    for name, module in model.named_modules():
        inside = any(name.startswith(f"{outer}.") for outer in offload.modules)
        if layers is not None and len(offload.modules) == layers:
            break
        if not inside and checkpoint.state(module) is not None:
            offload.attach(name, module)
    if not offload.modules:
        raise ValueError(
            f"offload_checkpointed: no submodule of {type(model).__name__} is checkpointed, so nothing is kept "
            "between forward and backward to offload; checkpoint its layers first "
            "(torch.distributed._composable.checkpoint, or the strategy's activation_checkpointing)."
        )
    return offload
