"""Offline report of a CUDA memory snapshot: a PNG timeline and a markdown table of the peak.

PyTorch's own viewer (``torch.cuda._memory_viz.trace_plot`` / pytorch.org/memory_viz) loads its
JavaScript from a CDN, which compute nodes often cannot reach. This module reads the snapshot
dictionary that ``torch.cuda.memory._snapshot()`` returns and needs only numpy and matplotlib.

What is counted: an allocation is live from its ``alloc`` event to its ``free_completed`` event,
which is the allocator's *active* memory (``free_requested`` only marks a block that another stream
may still use; the memory cannot be reused before ``free_completed``). On a single stream this equals
``torch.cuda.memory_allocated``. Reserved memory follows the ``segment_*`` events.

The trace is a ring buffer that may start after the oldest live allocation, so the memory already
allocated when the visible trace begins is reconstructed: a block freed in the trace without an
``alloc`` before it, or a block live in the snapshot's segments that the trace never allocated,
was allocated before the trace started.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# Allocator events that grow / shrink the reserved memory (``segment_map`` / ``segment_unmap`` are
# what expandable segments emit instead of ``segment_alloc`` / ``segment_free``).
_SEGMENT_GROW = frozenset({"segment_alloc", "segment_map"})
_SEGMENT_SHRINK = frozenset({"segment_free", "segment_unmap"})
# Frames that every ``nn.Module`` call adds between two user frames; they only push user frames
# out of the few lines a table cell can show.
_NOISE_FRAMES = frozenset({("module.py", "_call_impl"), ("module.py", "_wrapped_call_impl")})
_MAX_FRAMES = 10


@dataclass(frozen=True)
class Allocation:
    """One allocator block of the trace.

    ``allocated_at`` / ``freed_at`` are trace event indices; ``None`` means before the trace started /
    still live at the snapshot. ``frames`` is the allocation stack, innermost first (empty when the
    block was allocated before recording started and freed within the trace).
    """

    addr: int
    size: int
    frames: tuple[Mapping[str, Any], ...]
    allocated_at: int | None
    freed_at: int | None

    def live_after(self, n_events: int) -> bool:
        """Whether the block is live once the first ``n_events`` events of the trace have happened."""
        allocated = self.allocated_at is None or self.allocated_at < n_events
        return allocated and (self.freed_at is None or self.freed_at >= n_events)


@dataclass(frozen=True)
class MemoryTimeline:
    """Allocated / reserved bytes of one device over the recorded trace.

    ``allocated[k]`` and ``reserved[k]`` (int64 arrays of length ``n_events + 1``) are the bytes after
    the first ``k`` events, i.e. after event ``k - 1`` (events are numbered from 0); index 0 is the state
    when the trace begins.
    """

    device: int
    allocated: np.ndarray
    reserved: np.ndarray
    allocations: tuple[Allocation, ...]
    ooms: tuple[tuple[int, Mapping[str, Any]], ...]

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


def busiest_device(snapshot: Mapping[str, Any]) -> int | None:
    """The device index with the most trace events, or ``None`` when every trace is empty.

    Each Lightning process allocates on its own device only, so this is that device.
    """
    traces = snapshot.get("device_traces", [])
    lengths = [len(t) for t in traces]
    if not lengths or max(lengths) == 0:
        return None
    return int(np.argmax(lengths))


def analyze(snapshot: Mapping[str, Any], device: int) -> MemoryTimeline:
    """Replay the trace of ``device`` (an index into ``snapshot["device_traces"]``)."""
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

    allocations = tuple(done) + tuple(live.values())
    allocated_before = sum(a.size for a in allocations if a.allocated_at is None)
    reserved_at_end = sum(s["total_size"] for s in segments)
    reserved_before = reserved_at_end - int(d_reserved.sum())
    return MemoryTimeline(
        device=device,
        allocated=np.concatenate([[allocated_before], allocated_before + np.cumsum(d_alloc)]),
        reserved=np.concatenate([[reserved_before], reserved_before + np.cumsum(d_reserved)]),
        allocations=allocations,
        ooms=tuple(ooms),
    )


def write_report(snapshot: Mapping[str, Any], stem: Path, title: str, top_k: int = 20) -> tuple[Path, Path]:
    """Write ``<stem>.png`` (memory over the trace) and ``<stem>.md`` (largest live blocks at the peak).

    Raises:
        ValueError: if every device trace of ``snapshot`` is empty (nothing was recorded).
    """
    device = busiest_device(snapshot)
    if device is None:
        raise ValueError(f"The snapshot for {title!r} has no trace events; record with enabled='all' first.")
    timeline = analyze(snapshot, device)
    png = stem.with_name(f"{stem.name}.png")
    md = stem.with_name(f"{stem.name}.md")
    _plot(timeline, title, png)
    md.write_text(_markdown(timeline, title, top_k))
    return png, md


def _unit(n_bytes: float) -> tuple[float, str]:
    return (2**30, "GiB") if n_bytes >= 2**30 else (2**20, "MiB")


def _fmt_bytes(n_bytes: float) -> str:
    scale, unit = _unit(abs(n_bytes))
    return f"{n_bytes / scale:.2f} {unit}"


def _plot(timeline: MemoryTimeline, title: str, path: Path) -> None:
    # Imported here: only writing a report needs matplotlib, and `import lightning_cp` must stay light.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # A Figure without pyplot: no global state, and the user's matplotlib backend stays untouched.
    fig = Figure(figsize=(10, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    scale, unit = _unit(max(int(timeline.reserved.max()), timeline.peak_bytes))
    x = np.arange(-1, timeline.n_events)  # x = -1: before the first event
    ax.plot(x, timeline.reserved / scale, label="reserved", color="tab:gray", drawstyle="steps-post")
    ax.plot(x, timeline.allocated / scale, label="allocated", color="tab:blue", drawstyle="steps-post")
    ax.scatter(
        [timeline.peak_index - 1],
        [timeline.peak_bytes / scale],
        color="tab:red",
        zorder=3,
        label=f"peak {_fmt_bytes(timeline.peak_bytes)}",
    )
    for i, (index, _) in enumerate(timeline.ooms):
        ax.axvline(index, color="tab:red", linestyle="--", label="OOM" if i == 0 else None)
    ax.set_xlabel("allocator event")
    ax.set_ylabel(unit)
    ax.set_title(f"{title} (cuda:{timeline.device})")
    ax.set_ylim(bottom=0)
    ax.legend(loc="best")
    fig.tight_layout()
    fig.savefig(path)


def _frame_text(frame: Mapping[str, Any]) -> str:
    filename = str(frame["filename"])
    # Site-packages paths repeat the interpreter prefix on every line; the package path is enough.
    filename = filename.split("site-packages/", 1)[-1]
    return f"{filename}:{frame['line']} {frame['name']}".replace("|", "\\|")


def _python_frames(frames: Sequence[Mapping[str, Any]]) -> list[str]:
    kept = [
        f
        for f in frames
        if (str(f["filename"]).endswith(".py") or str(f["filename"]).startswith("<"))
        and (Path(str(f["filename"])).name, f["name"]) not in _NOISE_FRAMES
    ]
    return [f"`{_frame_text(f)}`" for f in kept[:_MAX_FRAMES]]


def _markdown(timeline: MemoryTimeline, title: str, top_k: int) -> str:
    peak = timeline.peak_bytes
    live = timeline.live_at_peak()
    reached = f"at event {timeline.peak_index - 1}" if timeline.peak_index else "before the first event"
    lines = [
        f"# Memory snapshot: {title}",
        "",
        f"- device: cuda:{timeline.device}",
        f"- allocator events in the trace: {timeline.n_events}",
        f"- peak allocated: {_fmt_bytes(peak)} ({peak} bytes), reached {reached}",
        f"- reserved at the peak: {_fmt_bytes(int(timeline.reserved[timeline.peak_index]))}",
        f"- allocated when the trace starts: {_fmt_bytes(int(timeline.allocated[0]))}",
        f"- live blocks at the peak: {len(live)}",
    ]
    for index, event in timeline.ooms:
        lines.append(
            f"- OOM at event {index}: requested {_fmt_bytes(event.get('size', 0))}, "
            f"free on the device {_fmt_bytes(event.get('device_free', 0))}"
        )
    lines += [
        "",
        f"## Largest live allocations at the peak (top {min(top_k, len(live))})",
        "",
        "| # | size | bytes | share of peak | allocated at event | stack (innermost first) |",
        "|---:|---:|---:|---:|---:|---|",
    ]
    for rank, block in enumerate(live[:top_k], start=1):
        where = "before the trace" if block.allocated_at is None else str(block.allocated_at)
        stack = "<br>".join(_python_frames(block.frames)) or "(no stack recorded)"
        share = 100.0 * block.size / peak if peak else 0.0
        lines.append(
            f"| {rank} | {_fmt_bytes(block.size)} | {block.size} | {share:.1f}% | {where} | {stack} |"
        )
    rest = live[top_k:]
    if rest:
        lines += ["", f"{len(rest)} smaller live blocks: {_fmt_bytes(sum(a.size for a in rest))} in all."]
    return "\n".join(lines) + "\n"
