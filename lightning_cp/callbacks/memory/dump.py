"""The files of one memory snapshot: the pickle, the offline report and PyTorch's HTML, and their names.

The pickle is written under a temporary name and renamed, so a file of :data:`SNAPSHOT_FILENAME` is
always complete. The reports are extras: a failing one warns and the others are still written.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from lightning_cp.callbacks.memory import report
from lightning_cp.callbacks.memory.tensors import TensorRanges, TensorsByDevice
from lightning_cp.callbacks.memory.timeline import busiest_device
from lightning_cp.parallel.layout import current_layout

#: Name of a snapshot file. ``kind`` is ``step`` (a recorded step or window) or ``oom_step`` (a dump
#: at an out-of-memory error); ``steps`` is ``000010`` or, for a window, ``000010-000012``;
#: ``layout`` is this rank's ``.dp1-cp1-tp0`` in a distributed run and empty in a single process. The offline
#: report and PyTorch's HTML share the stem: ``.png``, ``.md``, ``.html``.
SNAPSHOT_FILENAME = "{kind}_{steps}.rank{rank:02d}{layout}.pickle"


def dump_snapshot(
    dirpath: Path,
    kind: str,
    first: int,
    last: int,
    rank: int,
    tensors: TensorsByDevice,
    tensors_at_start: TensorsByDevice,
) -> Path | None:
    """Take ``torch.cuda.memory._snapshot()`` and write it with its reports to ``dirpath``.

    Args:
        dirpath: an existing, writable folder.
        kind: ``"step"`` or ``"oom_step"`` (see :data:`SNAPSHOT_FILENAME`).
        first, last: the recorded global steps, inclusive.
        rank: this process's global rank.
        tensors, tensors_at_start: the known tensors now and when recording started (:mod:`.tensors`),
            which name what the blocks hold.

    Returns:
        The pickle's path, or ``None`` (with a warning) when the recording has no allocator events.
    """
    snapshot = torch.cuda.memory._snapshot()
    steps = f"{first:06d}" if first == last else f"{first:06d}-{last:06d}"
    index = busiest_device(snapshot)
    if index is None:
        warnings.warn(
            f"MemoryProfilerCallback: the recording of {kind} {steps} on rank {rank} has no "
            "allocator events (does the model run on this rank's CUDA device?); no snapshot written."
        )
        return None
    parallel = current_layout()
    path = dirpath / SNAPSHOT_FILENAME.format(
        kind=kind, steps=steps, rank=rank, layout=f".{parallel.tag()}" if parallel.world_size > 1 else ""
    )
    partial = path.with_name(f"{path.name}.partial")
    with open(partial, "wb") as f:
        pickle.dump(snapshot, f, protocol=4)  # protocol 4: what the memory_viz page reads
    os.replace(partial, path)
    device = snapshot_device(index)
    _write_reports(snapshot, path, tensors.get(device, {}), tensors_at_start.get(device, {}))
    return path


def snapshot_device(index: int) -> torch.device:
    """The device of ``snapshot["device_traces"][index]``: only tensors on it can be in its blocks."""
    return torch.device("cuda", index)


def writable_error(dirpath: Path) -> str | None:
    """Create ``dirpath`` and a file in it; the error text if that fails, else ``None``."""
    try:
        dirpath.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=dirpath):
            pass
    except OSError as err:
        return str(err)
    return None


def _write_reports(
    snapshot: Mapping[str, Any], path: Path, tensors: TensorRanges, tensors_at_start: TensorRanges
) -> None:
    """The offline report and PyTorch's HTML next to ``path``; a failure warns and training goes on."""
    stem = path.with_name(path.stem)
    try:
        report.write_report(
            snapshot, stem, title=path.stem, tensors=tensors, tensors_at_start=tensors_at_start
        )
    except Exception as err:  # noqa: BLE001
        warnings.warn(
            f"MemoryProfilerCallback: the offline report for {path.name} failed: {err!r}", stacklevel=2
        )
    try:
        from torch.cuda._memory_viz import trace_plot

        stem.with_name(f"{stem.name}.html").write_text(trace_plot(snapshot))
    except Exception as err:  # noqa: BLE001
        warnings.warn(
            f"MemoryProfilerCallback: PyTorch's HTML view of {path.name} failed: {err!r}", stacklevel=2
        )
