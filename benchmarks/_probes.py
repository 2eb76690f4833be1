"""What a benchmark's worker process measures: peak memory, wall and CPU time, under a memory budget.

One case runs in one fresh worker process (see ``_harness``). Inside it, :func:`measure` runs the case's
step ``warmup + repeat`` times and records per timed repetition:

- peak extra bytes: the high-water mark during the step, minus what was allocated just before it, minus
  what the step leaves behind by contract (``retained``: e.g. the gradients every implementation must
  produce, which are not its cost). CUDA: ``torch.cuda.max_memory_allocated`` after
  ``reset_peak_memory_stats``. CPU: the resident set's high-water mark (``VmHWM`` in ``/proc/self/status``),
  reset before each repetition by writing ``5`` to ``/proc/self/clear_refs`` (Linux >= 4.0); the worker
  runs with :data:`CPU_WORKER_ENV` so that freed tensors leave the resident set.
- wall time of the step (CUDA synchronized) and the process's CPU time over the same span (all threads),
  which on a CPU shared with other jobs is far steadier than wall time.

:func:`set_memory_budget` makes a worker that outgrows its budget fail its allocations (:func:`is_oom`
recognizes the error) instead of taking the machine down.
"""

from __future__ import annotations

import gc
import os
import re
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch

MIB = 2**20
GIB = 2**30

CPU_WORKER_ENV = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
"""Environment variables of a CPU worker. Setting glibc's mmap threshold turns off its dynamic threshold,
under which freed blocks up to 32 MiB stay resident in malloc's free lists and hide later allocations
from the resident-set measurement."""

_T = TypeVar("_T")


def indexed_device(device: torch.device) -> torch.device:
    """``device``, with the current CUDA device's index when it is a bare ``cuda``.

    Some ``torch.cuda`` memory functions (``set_per_process_memory_fraction``) reject a CUDA device
    without an index, which is what ``torch.device("cuda")`` and ``--device cuda`` give.
    """
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a no-op on CPU), so that a clock read after it is fair."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def total_memory_bytes(device: torch.device) -> int:
    """The GPU's memory for a CUDA ``device``, else the machine's physical RAM."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(indexed_device(device)).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _status_bytes(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``, ``VmSize``), in bytes."""
    match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {field} line (the CPU probes need Linux)")
    return int(match.group(1)) * 1024


def set_memory_budget(device: torch.device, budget_bytes: int) -> None:
    """Make this process's allocations fail once it would hold more than ``budget_bytes`` on ``device``.

    CPU: ``RLIMIT_AS`` becomes the current virtual size plus the headroom between the resident set and
    ``budget_bytes`` (raises ``MemoryError`` when there is none). CUDA: the caching allocator's
    per-process fraction of the device's memory (``torch.cuda.set_per_process_memory_fraction``, on the
    current device when ``device`` has no index). Either way the failure is an exception
    :func:`is_oom` recognizes, not the kernel's OOM killer.
    """
    if device.type == "cuda":
        device = indexed_device(device)
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget_bytes / total), device)
        return
    headroom = budget_bytes - _status_bytes("VmRSS")
    if headroom <= 0:
        raise MemoryError(f"the process already holds more than its budget ({budget_bytes / GIB:.2f} GiB)")
    soft = _status_bytes("VmSize") + headroom
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(
        resource.RLIMIT_AS, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard)
    )


def is_oom(err: BaseException) -> bool:
    """Whether ``err`` is an allocation failure (CPU or CUDA), as :func:`set_memory_budget` provokes."""
    return isinstance(err, (MemoryError, torch.OutOfMemoryError)) or "allocate memory" in str(err)


class MemoryProbe(Protocol):
    """The high-water mark of one device's memory over a span of this process."""

    def start(self) -> int:
        """Reset the high-water mark; the bytes held now."""

    def peak(self) -> int:
        """The high-water mark since ``start``, in bytes."""


class _RssProbe:
    """This process's resident set (Linux)."""

    def start(self) -> int:
        # "5" resets VmHWM to the current VmRSS, so that every repetition gets its own peak.
        Path("/proc/self/clear_refs").write_text("5")
        return _status_bytes("VmRSS")

    def peak(self) -> int:
        return _status_bytes("VmHWM")


class _CudaProbe:
    """The bytes torch's caching allocator hands out on one CUDA device (not its reserved cache)."""

    def __init__(self, device: torch.device) -> None:
        self.device = indexed_device(device)

    def start(self) -> int:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_allocated(self.device)

    def peak(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)


def memory_probe(device: torch.device) -> MemoryProbe:
    """The probe for ``device``: allocated CUDA memory, or this process's resident set on CPU."""
    return _CudaProbe(device) if device.type == "cuda" else _RssProbe()


@dataclass(frozen=True)
class Measurement:
    """The timed repetitions of one case in one worker, in the order they ran."""

    peak_bytes: list[int]
    """Peak extra bytes of each repetition (see the module docstring)."""
    wall_ms: list[float]
    """Wall time of each repetition, in milliseconds."""
    cpu_ms: list[float]
    """CPU time of the process (all threads) over each repetition, in milliseconds."""

    def summary(self) -> dict[str, Any]:
        """The figures a result row reports: the largest peak and the median times, plus every value."""
        return {
            "peak_extra_bytes": max(self.peak_bytes),
            "peak_extra_bytes_all": self.peak_bytes,
            "time_ms": statistics.median(self.wall_ms),
            "times_ms": self.wall_ms,
            "cpu_ms": statistics.median(self.cpu_ms),
            "cpu_ms_all": self.cpu_ms,
            "threads": torch.get_num_threads(),
        }


def measure(
    run: Callable[[], _T],
    device: torch.device,
    *,
    warmup: int,
    repeat: int,
    reset: Callable[[], None] | None = None,
    retained: Callable[[], int] | None = None,
) -> tuple[Measurement, _T]:
    """Run ``run`` ``warmup + repeat`` times on ``device``; the last ``repeat`` runs' measurements.

    Args:
        run: one repetition of the case (e.g. forward + backward). Its return value is dropped before
            the next repetition starts, so that it does not count as memory held before it; the last
            one is returned (keep it small: a loss, not an activation).
        device: where ``run`` allocates; selects the memory probe and the synchronization.
        warmup: untimed repetitions first (allocator caches, kernel compilation, one-time workspaces).
        repeat: timed repetitions after them, at least 1.
        reset: called before every repetition, untimed (e.g. drop the previous gradients).
        retained: bytes ``run`` leaves allocated by contract, subtracted from its peak.

    Returns:
        The measurements, and what the last repetition returned.
    """
    if repeat < 1:
        raise ValueError(f"measure: repeat={repeat}; it must be at least 1")
    probe = memory_probe(device)
    peaks: list[int] = []
    wall_ms: list[float] = []
    cpu_ms: list[float] = []
    for rep in range(warmup + repeat):
        output = None
        if reset is not None:
            reset()
        gc.collect()
        base = probe.start()
        begin, begin_cpu = time.perf_counter(), time.process_time()
        output = run()
        synchronize(device)
        elapsed, elapsed_cpu = time.perf_counter() - begin, time.process_time() - begin_cpu
        if rep >= warmup:
            peaks.append(probe.peak() - base - (retained() if retained is not None else 0))
            wall_ms.append(elapsed * 1e3)
            cpu_ms.append(elapsed_cpu * 1e3)
    return Measurement(peak_bytes=peaks, wall_ms=wall_ms, cpu_ms=cpu_ms), output
