"""A benchmark run's report: ratios to baseline cases, the table (aligned text or Markdown), the JSON file.

It works on the result rows of ``_harness``: dicts with ``case``, ``shape`` (a label) and ``status``, and
on measured rows (``status == "ok"``) ``peak_extra_bytes``, ``time_ms`` and ``cpu_ms`` from
``_probes.Measurement.summary``, plus whatever the benchmark adds. :func:`add_ratios` divides a row's
figures by those of a baseline case on the same shape (one call per baseline); the table is a list of
:class:`Column`, typically ``[CASE, shape_column(...), *measurement_columns(), ..., STATUS]``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from _probes import GIB, MIB

Row = dict[str, Any]

RATIOS = {"mem_ratio": "peak_extra_bytes", "time_ratio": "time_ms", "cpu_ratio": "cpu_ms"}
"""Default ratios of :func:`add_ratios` and :func:`measurement_columns`: the key a ratio is stored under,
and the measured figure it divides."""


@dataclass(frozen=True)
class Column:
    """One column of the table: a header and the row key it shows."""

    header: str
    key: str
    fmt: str = ""
    """Format spec of a number (``",.0f"``); text is shown as it is and a missing value (``None``) as ``-``."""
    scale: float = 1
    """A number is divided by it before formatting (:data:`_probes.MIB` shows bytes as MiB)."""
    align: str = ">"
    """``">"`` (numbers) or ``"<"`` (text)."""

    def cell(self, row: Row) -> str:
        value = row.get(self.key)
        if value is None:
            return "-"
        if isinstance(value, str):
            return value
        return format(value / self.scale, self.fmt)


CASE = Column("case", "case", align="<")
STATUS = Column("status", "status", align="<")


def shape_column(header: str) -> Column:
    """The shape label's column, e.g. ``shape_column("N x V x H")``."""
    return Column(header, "shape", align="<")


def ratio_column(key: str, header: str) -> Column:
    """A ratio stored by :func:`add_ratios` under ``key``, as ``1.23``."""
    return Column(header, key, ".2f")


def measurement_columns(ratio_header: str = "x plain") -> list[Column]:
    """Peak extra MiB, wall ms and CPU ms, each followed by its ratio (:data:`RATIOS`) to the baseline."""
    return [
        Column("peak extra MiB", "peak_extra_bytes", ",.0f", scale=MIB),
        ratio_column("mem_ratio", ratio_header),
        Column("time ms", "time_ms", ",.1f"),
        ratio_column("time_ratio", ratio_header),
        Column("cpu ms", "cpu_ms", ",.0f"),
        ratio_column("cpu_ratio", ratio_header),
    ]


def baseline_rows(rows: Sequence[Row], baseline: str) -> dict[str, Row]:
    """The measured rows of case ``baseline``, by shape label."""
    return {r["shape"]: r for r in rows if r["case"] == baseline and r["status"] == "ok"}


def add_ratios(rows: Sequence[Row], baseline: str, ratios: Mapping[str, str] = RATIOS) -> None:
    """Set ``row[key] = row[figure] / baseline's figure`` for each ``key: figure`` of ``ratios`` in every
    row, against the row of case ``baseline`` on the same shape; ``None`` where either was not measured
    (or the baseline's figure is 0)."""
    base = baseline_rows(rows, baseline)
    for row in rows:
        ref = base.get(row["shape"]) if row["status"] == "ok" else None
        for key, figure in ratios.items():
            row[key] = row[figure] / ref[figure] if ref and ref[figure] else None


def format_table(rows: Sequence[Row], columns: Sequence[Column], *, markdown: bool = False) -> str:
    """``rows`` as a table of ``columns``: space-aligned text, or a Markdown (GitHub) table."""
    header = [c.header for c in columns]
    cells = [[c.cell(row) for c in columns] for row in rows]
    if markdown:
        rule = ["---:" if c.align == ">" else "---" for c in columns]
        return "\n".join(f"| {' | '.join(line)} |" for line in [header, rule, *cells])
    widths = [max(len(line[i]) for line in [header, *cells]) for i in range(len(columns))]

    def line(texts: Sequence[str]) -> str:
        return "  ".join(f"{t:{c.align}{w}}" for t, c, w in zip(texts, columns, widths)).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(texts) for texts in cells)])


def machine_info(device: torch.device, packages: Sequence[str] = ()) -> dict[str, Any]:
    """What the numbers depend on: processor, cores, memory, device, Python, torch, and the installed
    versions of ``packages`` (PyPI names; ``None`` when not installed)."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        match = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE)
        cpu = match.group(1) if match else cpu

    def version(distribution: str) -> str | None:
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        **{name: version(name) for name in packages},
    }


def write_json(
    path: Path, *, args: argparse.Namespace, machine: Mapping[str, Any], wall_s: float, rows: Sequence[Row]
) -> None:
    """The whole run as JSON: ``machine`` (see :func:`machine_info`), the resolved ``args``, the run's
    wall time and every row."""
    report = {
        "machine": dict(machine),
        "args": {k: str(v) if isinstance(v, (Path, torch.device)) else v for k, v in vars(args).items()},
        "wall_s": wall_s,
        "results": list(rows),
    }
    path.write_text(json.dumps(report, indent=2))


def publish(
    rows: Sequence[Row],
    columns: Sequence[Column],
    *,
    args: argparse.Namespace,
    title: str,
    notes: str,
    wall_s: float,
    packages: Sequence[str],
) -> None:
    """Print ``title``, the table and ``notes``; write ``--json`` (every row, the machine) and
    ``--markdown`` (the table) when the common options ask for them."""
    print(f"\n{title}")
    print(format_table(rows, columns))
    print(f"\n{notes}")
    print(f"wall time {wall_s:.0f} s")
    if args.json:
        write_json(
            args.json, args=args, machine=machine_info(args.device, packages), wall_s=wall_s, rows=rows
        )
    if args.markdown:
        args.markdown.write_text(format_table(rows, columns, markdown=True) + "\n")
