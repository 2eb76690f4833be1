"""The offline report of a CUDA memory snapshot: a markdown table of the peak and a PNG timeline.

PyTorch's own viewer (``torch.cuda._memory_viz.trace_plot`` / pytorch.org/memory_viz) loads its
JavaScript from a CDN, which compute nodes often cannot reach. This report needs only numpy, plus
matplotlib for the PNG (the ``report`` extra; without it the markdown is still written). matplotlib is
imported here only, when a PNG is drawn, so that ``import lightning_cp`` stays light.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lightning_cp.callbacks.memory.tensors import (
    ACTIVATIONS,
    BUFFERS,
    GRADIENTS,
    OPTIMIZER_STATE,
    OTHER,
    PARAMETERS,
    TensorRanges,
)
from lightning_cp.callbacks.memory.timeline import Allocation, MemoryTimeline, analyze, busiest_device

_COLORS = {
    PARAMETERS: "tab:blue",
    GRADIENTS: "tab:orange",
    OPTIMIZER_STATE: "tab:green",
    BUFFERS: "tab:purple",
    ACTIVATIONS: "tab:red",
    OTHER: "tab:brown",
}
# Frames that every ``nn.Module`` call adds between two user frames; they only push user frames
# out of the few lines a table cell can show.
_NOISE_FRAMES = frozenset({("module.py", "_call_impl"), ("module.py", "_wrapped_call_impl")})
_MAX_FRAMES = 10


def can_plot() -> bool:
    """Whether matplotlib, which the PNG needs, is installed (it is not imported here)."""
    return importlib.util.find_spec("matplotlib") is not None


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
