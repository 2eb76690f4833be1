"""Offline report of a CUDA memory snapshot: a PNG timeline and a markdown table of the peak.

PyTorch's own viewer (``torch.cuda._memory_viz.trace_plot`` / pytorch.org/memory_viz) loads its
JavaScript from a CDN, which compute nodes often cannot reach. This module reads the snapshot
dictionary that ``torch.cuda.memory._snapshot()`` returns and needs only numpy, plus matplotlib for the
PNG (the ``report`` extra; without it the markdown is still written).

What is counted: an allocation is live from its ``alloc`` event to its ``free_completed`` event,
which is the allocator's *active* memory (``free_requested`` only marks a block that another stream
may still use; the memory cannot be reused before ``free_completed``). On a single stream this equals
``torch.cuda.memory_allocated``. Reserved memory follows the ``segment_*`` events.

The trace is a ring buffer that may start after the oldest live allocation, so the memory already
allocated when the visible trace begins is reconstructed: a block freed in the trace without an
``alloc`` before it, or a block live in the snapshot's segments that the trace never allocated,
was allocated before the trace started.

What a block holds comes from the caller, as the byte ranges of known tensors (``{(start, end): (category,
name)}``, e.g. parameters, gradients, optimizer state): a block ``[addr, addr + size)`` holds the tensors
whose range lies inside it. Blocks live when the snapshot was taken are matched against the tensors that
existed then, and blocks allocated before the trace and freed in it against the tensors that existed when
recording started; a block allocated and freed within the trace held none of them. Without a known tensor, a
block allocated in the trace is counted as :data:`ACTIVATIONS` and one allocated before it as :data:`OTHER`.
"""

from __future__ import annotations

import bisect
import importlib.util
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

#: Known tensors by address: ``{(start, end): (category, name)}``, where ``[start, end)`` are the bytes a
#: tensor's elements occupy on the snapshot's device.
TensorRanges = Mapping[tuple[int, int], tuple[str, str]]

# Categories of blocks. The first four name the tensors the caller knows; the last two are what a block
# holding none of them is counted as.
PARAMETERS = "parameters"
GRADIENTS = "gradients"
OPTIMIZER_STATE = "optimizer state"
BUFFERS = "buffers"
ACTIVATIONS = "activations and temporaries"
OTHER = "other (allocated before the trace)"
_COLORS = {
    PARAMETERS: "tab:blue",
    GRADIENTS: "tab:orange",
    OPTIMIZER_STATE: "tab:green",
    BUFFERS: "tab:purple",
    ACTIVATIONS: "tab:red",
    OTHER: "tab:brown",
}

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


def can_plot() -> bool:
    """Whether matplotlib, which the PNG needs, is installed (it is not imported here)."""
    return importlib.util.find_spec("matplotlib") is not None


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


def write_report(
    snapshot: Mapping[str, Any],
    stem: Path,
    title: str,
    top_k: int = 20,
    tensors: TensorRanges | None = None,
    tensors_at_start: TensorRanges | None = None,
) -> tuple[Path | None, Path]:
    """Write ``<stem>.md`` (the peak by category and its largest live blocks) and ``<stem>.png`` (memory by
    category over the trace); ``tensors`` and ``tensors_at_start`` classify the blocks (see :func:`analyze`).

    Returns:
        The PNG's path, or ``None`` when matplotlib is not installed, and the markdown's path.

    Raises:
        ValueError: if every device trace of ``snapshot`` is empty (nothing was recorded).
    """
    device = busiest_device(snapshot)
    if device is None:
        raise ValueError(f"The snapshot for {title!r} has no trace events; record with enabled='all' first.")
    timeline = analyze(snapshot, device, tensors, tensors_at_start)
    md = stem.with_name(f"{stem.name}.md")
    md.write_text(_markdown(timeline, title, top_k))
    png = stem.with_name(f"{stem.name}.png")
    try:
        _plot(timeline, title, png)
    except ModuleNotFoundError as err:
        if (err.name or "").split(".")[0] != "matplotlib":
            raise
        return None, md
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
    # x = -1: before the first event; the state after the last event is held for one more unit of x,
    # so that step-post drawing shows it.
    x = np.arange(-1, timeline.n_events + 1)

    def held(series: np.ndarray) -> np.ndarray:
        return np.append(series, series[-1]) / scale

    at_peak = timeline.peak_by_category()
    categories = list(timeline.by_category)
    # Stacked in the order of the markdown table: the largest category at the peak at the bottom.
    ax.stackplot(
        x,
        *(held(timeline.by_category[c]) for c in categories),
        labels=[f"{c}: {_fmt_bytes(at_peak.get(c, 0))} at the peak" for c in categories],
        colors=[_COLORS.get(c, f"C{k}") for k, c in enumerate(categories)],
        step="post",
        linewidth=0,
    )
    ax.plot(x, held(timeline.reserved), label="reserved", color="tab:gray", drawstyle="steps-post")
    ax.scatter(
        [timeline.peak_index - 1],
        [timeline.peak_bytes / scale],
        color="black",
        zorder=3,
        label=f"peak allocated {_fmt_bytes(timeline.peak_bytes)}",
    )
    for i, (index, _) in enumerate(timeline.ooms):
        ax.axvline(index, color="black", linestyle="--", label="OOM" if i == 0 else None)
    ax.set_xlabel("allocator event")
    ax.set_ylabel(unit)
    ax.set_title(f"{title} (cuda:{timeline.device})")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
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


def _contents(block: Allocation) -> str:
    """The tensors a block holds, then its stack: ``model.head.weight (+3 more)<br>`model.py:12 forward```."""
    lines = _python_frames(block.frames)
    if block.tensors:
        more = f" (+{len(block.tensors) - 1} more)" if len(block.tensors) > 1 else ""
        lines.insert(0, f"{block.tensors[0]}{more}".replace("|", "\\|"))
    return "<br>".join(lines) or "(no stack recorded)"


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
        "## The peak by category",
        "",
        "| category | at the peak | bytes | share of peak |",
        "|---|---:|---:|---:|",
    ]
    for category, n_bytes in timeline.peak_by_category().items():
        lines.append(f"| {category} | {_fmt_bytes(n_bytes)} | {n_bytes} | {_share(n_bytes, peak)} |")
    lines += [
        f"| total | {_fmt_bytes(peak)} | {peak} | {_share(peak, peak)} |",
        "",
        f"## Largest live allocations at the peak (top {min(top_k, len(live))})",
        "",
        "| # | size | bytes | share of peak | allocated at event | category | tensors, then stack (innermost first) |",
        "|---:|---:|---:|---:|---:|---|---|",
    ]
    for rank, block in enumerate(live[:top_k], start=1):
        where = "before the trace" if block.allocated_at is None else str(block.allocated_at)
        lines.append(
            f"| {rank} | {_fmt_bytes(block.size)} | {block.size} | {_share(block.size, peak)} | {where} "
            f"| {block.category} | {_contents(block)} |"
        )
    rest = live[top_k:]
    if rest:
        lines += ["", f"{len(rest)} smaller live blocks: {_fmt_bytes(sum(a.size for a in rest))} in all."]
    return "\n".join(lines) + "\n"


def _share(n_bytes: int, peak: int) -> str:
    return f"{100.0 * n_bytes / peak if peak else 0.0:.1f}%"
