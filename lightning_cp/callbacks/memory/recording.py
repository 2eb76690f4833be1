"""The CUDA allocator's history recording of one process, and its out-of-memory observer.

``torch.cuda.memory._record_memory_history`` is process-wide: one recording at a time, whose trace
``torch.cuda.memory._snapshot()`` returns. PyTorch cannot detach an OOM observer, so the observer
attached here holds its target weakly and does nothing once the target is gone.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Literal

import torch


class AllocatorRecording:
    """Turns the allocator history on (:meth:`start`) and off (:meth:`stop`).

    Args:
        stacks: ``"python"`` (Python frames only: dumps take seconds) or ``"all"`` (adds C++ frames).
        max_entries: ring-buffer size of the trace: only the newest events are kept.
        on_oom: a bound method the allocator calls before it raises an out-of-memory error (also one
            that user code then catches); attached at the first :meth:`start` and held weakly, so the
            observer never keeps its object alive.
    """

    def __init__(
        self, stacks: Literal["python", "all"], max_entries: int, on_oom: Callable[[], None] | None
    ) -> None:
        self.stacks = stacks
        self.max_entries = max_entries
        self.on = False
        self._on_oom = None if on_oom is None else weakref.WeakMethod(on_oom)
        self._observer_attached = False

    def start(self) -> None:
        """Record from now on, without the events of an earlier recording (``clear_history``)."""
        torch.cuda.memory._record_memory_history(
            enabled="all", stacks=self.stacks, max_entries=self.max_entries, clear_history=True
        )
        self.on = True
        if self._on_oom is not None and not self._observer_attached:
            _attach_oom_observer(self._on_oom)
            self._observer_attached = True

    def stop(self) -> None:
        """Stop recording (the trace recorded so far is dropped at the next :meth:`start`)."""
        torch.cuda.memory._record_memory_history(enabled=None)
        self.on = False


def _attach_oom_observer(target: weakref.WeakMethod) -> None:
    """Attach an allocator OOM observer that calls ``target`` while its object exists."""

    def observer(device: int, alloc: int, device_allocated: int, device_free: int) -> None:
        method = target()
        if method is not None:
            method()

    torch._C._cuda_attach_out_of_memory_observer(observer)
