"""The per-step peak memory that :class:`~lightning_cp.callbacks.MemoryProfilerCallback` logs.

With CUDA, ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` since the last
``torch.cuda.reset_peak_memory_stats`` (the callback resets them at every batch start). Without CUDA,
the process's peak resident set size since it started: the OS cannot reset it per step.
"""

from __future__ import annotations

import sys

import torch

#: Keys logged with ``log_peak``: GiB, the maximum over all ranks of each rank's peak in the step.
PEAK_ALLOCATED_KEY = "memory/peak_allocated_gib"
PEAK_RESERVED_KEY = "memory/peak_reserved_gib"
#: Without CUDA: the process's peak resident set size since it started (the OS cannot reset it per step).
PEAK_RSS_KEY = "memory/peak_rss_gib"

_GIB = float(2**30)


def peak_metrics(cuda: bool) -> dict[str, float]:
    """This process's peaks in GiB: allocated and reserved CUDA memory, or without ``cuda`` the peak RSS."""
    if cuda:
        return {
            PEAK_ALLOCATED_KEY: torch.cuda.max_memory_allocated() / _GIB,
            PEAK_RESERVED_KEY: torch.cuda.max_memory_reserved() / _GIB,
        }
    return {PEAK_RSS_KEY: _peak_rss_bytes() / _GIB}


def _peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux and macOS)."""
    import resource  # POSIX only; imported here so the module still imports on Windows

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux
