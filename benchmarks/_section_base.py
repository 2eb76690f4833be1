"""What every section of the GPU proof shares: its verdict, its needs, the target lines, running a command.

A section (:class:`SectionSpec`, listed in ``_sections.SECTIONS``) is a function of the device that returns a
:class:`Section`; :func:`targets_verdict` turns the target cells of a benchmark's rows into one.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]

Row = dict[str, Any]

ERROR_RATIO = 2.0
"""Ours' relative error at most this times PyTorch's own in the same dtype, plus the doctor's floor (its
rule, without its 1% cap: a bf16 Gated DeltaNet's own error is about 1%)."""


@dataclass(frozen=True)
class Section:
    """A section's verdict."""

    status: str
    """``PASS``, ``FAIL`` or ``SKIP``."""
    summary: str
    """One line: what was found, or why it did not run."""
    body: str = ""
    """Markdown: the tables and output behind the summary."""


@dataclass(frozen=True)
class SectionSpec:
    """A section: what it needs (checked first, cheaply, before any process starts) and what it runs."""

    run: Callable[[torch.device], Section]
    needs: Callable[[torch.device], str | None] = lambda device: None
    """Why the section cannot run on ``device`` here (its SKIP line), or ``None``."""


def needs_cuda(why: str, *modules: tuple[str, str]) -> Callable[[torch.device], str | None]:
    """The needs of a section that runs on CUDA (``why``) with the importable ``(module, what to install)``
    pairs ``modules``."""

    def check(device: torch.device) -> str | None:
        if device.type != "cuda":
            return f"no CUDA device: {why}"
        missing = [what for module, what in modules if importlib.util.find_spec(module) is None]
        return f"{', '.join(missing)} not installed" if missing else None

    return check


def verdict(value: float | None, limit: float) -> str | None:
    """``PASS 0.93 <= 0.95`` / ``FAIL ...``, or ``None`` without a value."""
    return None if value is None else f"{'PASS' if value <= limit else 'FAIL'} {value:.2f} <= {limit:g}"


def error_ratio(error: float, torch_error: float, dtype: torch.dtype) -> float:
    """``error`` over its limit, :data:`ERROR_RATIO` x PyTorch's own error in ``dtype`` plus the doctor's floor
    (at most 1 passes)."""
    from lightning_cp.doctor._compare import tolerance

    return error / (ERROR_RATIO * torch_error + tolerance(dtype, 0.0))


def targets_verdict(rows: Sequence[Row], ours: Sequence[str], keys: Sequence[str], what: str) -> Section:
    """PASS when every row of the cases ``ours`` was measured and each of its target ``keys`` that has a
    verdict passes; FAIL naming the first misses (case and shape); SKIP when no target could be judged
    (nothing to compare with)."""
    mine = [row for row in rows if row["case"] in ours]
    if not mine or any(not row["status"].startswith("ok") for row in mine):
        return Section("FAIL", f"{', '.join(ours)} not measured: {mine[0]['status'] if mine else 'no row'}")
    verdicts = [
        (f"{row['case']} {row['shape']}", key, row[key]) for row in mine for key in keys if row.get(key)
    ]
    missed = [f"{where}: {key} {value}" for where, key, value in verdicts if value.startswith("FAIL")]
    if missed:
        return Section("FAIL", f"{what}: {'; '.join(missed)}")
    if not verdicts:
        others = {row["case"]: row["status"] for row in rows if row["case"] not in ours}
        why = "; ".join(f"{case}: {status}" for case, status in others.items())
        return Section("SKIP", f"nothing to compare {', '.join(ours)} with ({why})")
    return Section("PASS", f"{what}: {'; '.join(f'{key} {value}' for _, key, value in verdicts)}")


def run_streamed(command: Sequence[str], cwd: Path = ROOT) -> tuple[int, str]:
    """Run ``command``, echoing its output to this process's stdout as it comes (the section's log, which the
    report shows when the section runs out of time); its exit status and output."""
    proc = subprocess.Popen(
        list(command), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        lines.append(line)
    return proc.wait(), "".join(lines)


def code_block(text: str, last: int | None = None) -> str:
    """``text`` (its ``last`` lines) as a Markdown code block."""
    lines = text.rstrip().splitlines()
    if last is not None and len(lines) > last:
        lines = [f"... ({len(lines) - last} lines before)", *lines[-last:]]
    return "```\n" + "\n".join(lines) + "\n```"
