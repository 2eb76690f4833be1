"""A CUDA memory snapshot replayed: allocated and reserved memory over its trace, by what the blocks hold.

Reads the dictionary that ``torch.cuda.memory._snapshot()`` returns; needs only numpy.

What is counted: an allocation is live from its ``alloc`` event to its ``free_completed`` event,
which is the allocator's *active* memory (``free_requested`` only marks a block that another stream
may still use; the memory cannot be reused before ``free_completed``). On a single stream this equals
``torch.cuda.memory_allocated``. Reserved memory follows the ``segment_*`` events.

The trace is a ring buffer that may start after the oldest live allocation, so the memory already
allocated when the visible trace begins is reconstructed: a block freed in the trace without an
``alloc`` before it, or a block live in the snapshot's segments that the trace never allocated,
was allocated before the trace started.

What a block holds comes from the caller, as the byte ranges of known tensors (:mod:`.tensors`): a block
``[addr, addr + size)`` holds the tensors whose range lies inside it. Blocks live when the snapshot was
taken are matched against the tensors that existed then, and blocks allocated before the trace and freed
in it against the tensors that existed when recording started; a block allocated and freed within the
trace held none of them. Without a known tensor, a block allocated in the trace is counted as
``ACTIVATIONS`` and one allocated before it as ``OTHER``.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from lightning_cp.callbacks.memory.tensors import ACTIVATIONS, OTHER, TensorRanges

# Allocator events that grow / shrink the reserved memory (``segment_map`` / ``segment_unmap`` are
# what expandable segments emit instead of ``segment_alloc`` / ``segment_free``).
_SEGMENT_GROW = frozenset({"segment_alloc", "segment_map"})
_SEGMENT_SHRINK = frozenset({"segment_free", "segment_unmap"})


@dataclass(frozen=True)
class Allocation:
    """One allocator block of the trace.

    ``allocated_at`` / ``freed_at`` are trace event indices; ``None`` means before the trace started /
    still live at the snapshot. ``frames`` is the allocation stack, innermost first (empty when the
    block was allocated before recording started and freed within the trace). ``category`` is what the
    block holds and ``tensors`` the names of the known tensors in it, those of ``category`` first, in
    address order (see :func:`analyze`).
    """

    addr: int
    size: int
    frames: tuple[Mapping[str, Any], ...]
    allocated_at: int | None
    freed_at: int | None
    category: str = ACTIVATIONS
    tensors: tuple[str, ...] = ()

    def live_after(self, n_events: int) -> bool:
        """Whether the block is live once the first ``n_events`` events of the trace have happened."""
        allocated = self.allocated_at is None or self.allocated_at < n_events
        return allocated and (self.freed_at is None or self.freed_at >= n_events)


@dataclass(frozen=True)
class MemoryTimeline:
    """Allocated / reserved bytes of one device over the recorded trace.

    ``allocated[k]`` and ``reserved[k]`` (int64 arrays of length ``n_events + 1``) are the bytes after
    the first ``k`` events, i.e. after event ``k - 1`` (events are numbered from 0); index 0 is the state
    when the trace begins. ``by_category[c][k]`` is the part of ``allocated[k]`` in blocks of category
    ``c``; the categories are ordered by their bytes at the peak, largest first.
    """

    device: int
    allocated: np.ndarray
    reserved: np.ndarray
    allocations: tuple[Allocation, ...]
    ooms: tuple[tuple[int, Mapping[str, Any]], ...]
    by_category: Mapping[str, np.ndarray]

    @property
    def n_events(self) -> int:
        return len(self.allocated) - 1

    @property
    def peak_index(self) -> int:
        """The first position of the largest allocated value (an index into ``allocated``)."""
        return int(np.argmax(self.allocated))

    @property
    def peak_bytes(self) -> int:
        return int(self.allocated[self.peak_index])

    def live_at_peak(self) -> list[Allocation]:
        """The blocks live at the peak, largest first; their sizes sum to ``peak_bytes``."""
        live = [a for a in self.allocations if a.live_after(self.peak_index)]
        return sorted(live, key=lambda a: a.size, reverse=True)

    def peak_by_category(self) -> dict[str, int]:
        """Bytes of each category at the peak, largest first, without empty ones; they sum to ``peak_bytes``."""
        at_peak = {c: int(series[self.peak_index]) for c, series in self.by_category.items()}
        return {c: n for c, n in at_peak.items() if n}


def busiest_device(snapshot: Mapping[str, Any]) -> int | None:
    """The device index with the most trace events, or ``None`` when every trace is empty.

    Each Lightning process allocates on its own device only, so this is that device.
    """
    traces = snapshot.get("device_traces", [])
    lengths = [len(t) for t in traces]
    if not lengths or max(lengths) == 0:
        return None
    return int(np.argmax(lengths))


def analyze(
    snapshot: Mapping[str, Any],
    device: int,
    tensors: TensorRanges | None = None,
    tensors_at_start: TensorRanges | None = None,
) -> MemoryTimeline:
    """Replay the trace of ``device`` (an index into ``snapshot["device_traces"]``) and classify its blocks.

    Args:
        snapshot: what ``torch.cuda.memory._snapshot()`` returns.
        device: the CUDA device index whose trace is replayed.
        tensors: the tensors on that device when the snapshot was taken; they classify the blocks still
            live then.
        tensors_at_start: the tensors on that device when recording started; they classify the blocks
            allocated before the trace and freed in it (e.g. the previous step's gradients, freed by
            ``zero_grad``). If the ring buffer dropped the start of the recording, a block of the visible
            trace's beginning may have been reused since, so this is a best guess there.
    """
    events = snapshot["device_traces"][device]
    n = len(events)
    d_alloc = np.zeros(n, dtype=np.int64)
    d_reserved = np.zeros(n, dtype=np.int64)
    live: dict[int, Allocation] = {}
    done: list[Allocation] = []
    ooms: list[tuple[int, Mapping[str, Any]]] = []
    for i, event in enumerate(events):
        action = event["action"]
        if action == "alloc":
            live[event["addr"]] = Allocation(
                event["addr"], event["size"], tuple(event.get("frames", ())), i, None
            )
            d_alloc[i] = event["size"]
        elif action == "free_completed":
            d_alloc[i] = -event["size"]
            block = live.pop(event["addr"], None)
            if block is None:
                block = Allocation(event["addr"], event["size"], (), None, None)
            done.append(Allocation(block.addr, block.size, block.frames, block.allocated_at, i))
        elif action in _SEGMENT_GROW:
            d_reserved[i] = event["size"]
        elif action in _SEGMENT_SHRINK:
            d_reserved[i] = -event["size"]
        elif action == "oom":
            ooms.append((i, event))

    segments = [s for s in snapshot.get("segments", []) if s.get("device", device) == device]
    for segment in segments:
        for block in segment["blocks"]:
            if block["state"].startswith("active") and block["address"] not in live:
                live[block["address"]] = Allocation(
                    block["address"], block["size"], tuple(block.get("frames", ())), None, None
                )

    allocations = _classify(tuple(done) + tuple(live.values()), tensors or {}, tensors_at_start or {})
    allocated_before = sum(a.size for a in allocations if a.allocated_at is None)
    reserved_at_end = sum(s["total_size"] for s in segments)
    reserved_before = reserved_at_end - int(d_reserved.sum())
    allocated = np.concatenate([[allocated_before], allocated_before + np.cumsum(d_alloc)])
    return MemoryTimeline(
        device=device,
        allocated=allocated,
        reserved=np.concatenate([[reserved_before], reserved_before + np.cumsum(d_reserved)]),
        allocations=allocations,
        ooms=tuple(ooms),
        by_category=_by_category(allocations, n, int(np.argmax(allocated))),
    )


def _classify(
    allocations: tuple[Allocation, ...], tensors: TensorRanges, tensors_at_start: TensorRanges
) -> tuple[Allocation, ...]:
    """Set each block's category and tensor names (see the module docstring)."""
    # block index -> the (start, end, category, name) of the tensors in it
    held: dict[int, list[tuple[int, int, str, str]]] = defaultdict(list)
    live_at_end = [i for i, a in enumerate(allocations) if a.freed_at is None]
    freed_in_trace = [
        i for i, a in enumerate(allocations) if a.allocated_at is None and a.freed_at is not None
    ]
    for indices, ranges in ((live_at_end, tensors), (freed_in_trace, tensors_at_start)):
        # Blocks live at one moment never overlap, so the block holding a tensor is the last one starting
        # at or below the tensor's start, if the tensor ends inside it.
        indices.sort(key=lambda i: allocations[i].addr)
        starts = [allocations[i].addr for i in indices]
        for (start, end), (category, name) in ranges.items():
            k = bisect.bisect_right(starts, start) - 1
            if k >= 0 and end <= starts[k] + allocations[indices[k]].size:
                held[indices[k]].append((start, end, category, name))
    classified = []
    for i, block in enumerate(allocations):
        if i in held:
            category, names = _main_category(held[i])
            classified.append(replace(block, category=category, tensors=names))
        else:
            classified.append(replace(block, category=OTHER if block.allocated_at is None else ACTIVATIONS))
    return tuple(classified)


def _main_category(contents: list[tuple[int, int, str, str]]) -> tuple[str, tuple[str, ...]]:
    """The category with the most bytes among ``(start, end, category, name)``, and the names, its own first."""
    nbytes: dict[str, int] = defaultdict(int)
    for start, end, category, _ in sorted(contents):
        nbytes[category] += end - start
    main = max(nbytes, key=nbytes.__getitem__)
    ordered = sorted(contents, key=lambda t: (t[2] != main, t[0]))
    return main, tuple(name for _, _, _, name in ordered)


def _by_category(allocations: Sequence[Allocation], n_events: int, peak_index: int) -> dict[str, np.ndarray]:
    """Allocated bytes per category over the trace (as ``MemoryTimeline.allocated``), largest at the peak first."""
    deltas: dict[str, np.ndarray] = {}
    for block in allocations:
        delta = deltas.setdefault(block.category, np.zeros(n_events + 1, dtype=np.int64))
        delta[0 if block.allocated_at is None else block.allocated_at + 1] += block.size
        if block.freed_at is not None:
            delta[block.freed_at + 1] -= block.size
    series = {category: np.cumsum(delta) for category, delta in deltas.items()}
    return dict(sorted(series.items(), key=lambda item: (-int(item[1][peak_index]), item[0])))
