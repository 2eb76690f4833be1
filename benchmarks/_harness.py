"""The frame a benchmark script stands in: its cases, its command line, one worker process per measurement.

A benchmark script (``loss_memory.py``) runs as the parent, which walks the grid of shapes x cases and
prints the report, and once per (shape, case) as a worker: the same file run again with
``--worker SPEC_JSON``, so that one case's allocator caches, one-time workspaces and crashes cannot leak
into the next. The script brings:

- its cases, as :class:`Case` objects (a name, a ``build`` function, a memory ``estimate``, its
  ``needs``), chosen with :func:`select_cases` and listed with :func:`format_case_list`;
- its command line: its own options, then :func:`parse_arguments` (the common options, its grids);
- in the parent, a function making one row for (shape, case), which calls :func:`run_case`, handed to
  :func:`run_grid`;
- in the worker, a ``measure(spec) -> dict`` built on ``_probes.measure``, handed to :func:`worker_main`.

A result row is a JSON-ready dict with at least ``case``, ``shape`` (the shape's label) and ``status``:
``"ok"`` when measured (the row then has ``_probes.Measurement.summary()``'s keys and what ``measure``
added), else why not: a missing need, ``skipped: estimate ...``, ``OOM``, ``error: ...``, ``died: ...``.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch
from _probes import CPU_WORKER_ENV, GIB, MIB, is_oom, total_memory_bytes

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""``--dtype`` choices."""
WORKER_FLAG = "--worker"

Need = Callable[[torch.device], "str | None"]
"""Checks one thing a case needs on a device: ``None`` when it is there, else why not (the row's status)."""

_Problem = TypeVar("_Problem")
_Sizes = TypeVar("_Sizes")
_Shape = TypeVar("_Shape")


def needs_cuda(device: torch.device) -> str | None:
    """:data:`Need` of a case that runs on CUDA only."""
    return None if device.type == "cuda" else "needs CUDA"


def needs_module(module: str, distribution: str) -> Need:
    """:data:`Need` of the importable ``module`` (e.g. ``liger_kernel``) from the PyPI ``distribution``."""

    def check(device: torch.device) -> str | None:
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # a missing parent package of a dotted name
            found = False
        return None if found else f"{distribution} not installed"

    return check


@dataclass(frozen=True)
class Case(Generic[_Problem, _Sizes]):
    """One implementation a benchmark measures. Its types are the benchmark's: the problem (the inputs,
    on the device, built in the worker) and the sizes its estimate is written in."""

    name: str
    """Unique; what ``--cases`` matches, and the table's first column."""
    description: str
    """One line for ``--list-cases`` and the JSON report."""
    build: Callable[[_Problem], Callable[[], Any]]
    """From the problem, the step one repetition runs (the benchmark decides what the step returns and
    what its worker does with it, e.g. call ``backward`` on a loss). Runs in the worker, untimed."""
    estimate: Callable[[_Sizes], int]
    """Rough upper bound of the peak extra bytes (what the table measures), checked against
    ``--max-mem-gib`` before a worker starts."""
    needs: tuple[Need, ...] = ()
    """Checked in the parent before a worker starts; a case that lacks any is not run."""
    context: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext
    """Process-wide setup the case needs around its steps (entered in the worker, untimed)."""

    def unavailable(self, device: torch.device) -> str | None:
        """Why this case cannot run on ``device`` here (every missing need), or ``None`` when it can."""
        return "; ".join(reason for need in self.needs if (reason := need(device))) or None


_CaseT = TypeVar("_CaseT", bound=Case)


def select_cases(cases: Sequence[_CaseT], patterns: Sequence[str] | None) -> list[_CaseT]:
    """The ``cases`` named by ``patterns`` (``--cases``): exact names, which may contain ``[``, or
    shell-style patterns; all of them for none. Exits with the list of names when a pattern matches none."""
    if not patterns:
        return list(cases)

    def hits(pattern: str) -> list[_CaseT]:
        return [c for c in cases if c.name == pattern or fnmatch.fnmatchcase(c.name, pattern)]

    unmatched = [pattern for pattern in patterns if not hits(pattern)]
    if unmatched:
        raise SystemExit(
            f"--cases {' '.join(unmatched)} matches no case; the cases are: "
            f"{', '.join(c.name for c in cases)} (shell-style patterns such as 'torch_lce*' work)"
        )
    chosen = {c.name for pattern in patterns for c in hits(pattern)}
    return [c for c in cases if c.name in chosen]


def format_case_list(cases: Sequence[Case], device: torch.device) -> str:
    """One line per case for ``--list-cases``: name, description, and why it cannot run on ``device``."""
    width = max(len(c.name) for c in cases) + 2
    lines = []
    for case in cases:
        reason = case.unavailable(device)
        note = f"  [not run on {device.type}: {reason}]" if reason else ""
        lines.append(f"{case.name:{width}}{case.description}{note}")
    return "\n".join(lines)


def _add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every benchmark has: device, dtype, repetitions, case selection, budget, outputs."""
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        help="of the inputs and weights (default: fp32 on CPU, bf16 on CUDA)",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    parser.add_argument("--repeat", type=int, help="timed runs per case; the median is reported (default 3)")
    parser.add_argument("--warmup", type=int, help="untimed runs before them (default 1)")
    parser.add_argument(
        "--cases", nargs="+", metavar="PATTERN", help="shell-style patterns of case names (default: all)"
    )
    parser.add_argument(
        "--max-mem-gib",
        type=float,
        help="memory budget of one case's process (default: 2/3 of RAM or the GPU's memory)",
    )
    parser.add_argument(
        "--json", type=Path, metavar="PATH", help="write every measurement and the machine info here"
    )
    parser.add_argument("--markdown", type=Path, metavar="PATH", help="write the table as Markdown here")
    parser.add_argument(
        "--list-cases", action="store_true", help="print the cases, and why any cannot run here, and exit"
    )
    parser.add_argument(WORKER_FLAG, metavar="SPEC_JSON", help=argparse.SUPPRESS)


def _finish_common_arguments(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    presets: Callable[[torch.device], Mapping[str, Any]],
) -> None:
    """Resolve the defaults of :func:`_add_common_arguments`'s options in ``args``, and check them.

    ``args.device`` becomes a ``torch.device``; every option still ``None`` whose name is in
    ``presets(device)`` (the benchmark's grid, ``repeat``, ``warmup``, ...) takes the preset's value;
    ``repeat`` and ``warmup`` default to 3 and 1, ``dtype`` to bf16 on CUDA and fp32 on CPU, and
    ``max_mem_gib`` to 2/3 of the device's memory. Errors go through ``parser.error``.
    """
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here; use --device cpu")
    for key, value in {"repeat": 3, "warmup": 1, **presets(args.device)}.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.dtype = args.dtype or ("bf16" if args.device.type == "cuda" else "fp32")
    if args.max_mem_gib is None:
        args.max_mem_gib = round(total_memory_bytes(args.device) * 2 / 3 / GIB, 1)
    require_positive(parser, args, ("repeat", "max_mem_gib"))
    if args.warmup < 0:
        parser.error(f"--warmup {args.warmup}: must be >= 0")


def parse_arguments(
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    *,
    cpu: Mapping[str, Any],
    cuda: Mapping[str, Any],
    quick: Mapping[str, Any],
    positive: Sequence[str],
) -> argparse.Namespace:
    """A script's command line: ``parser`` (its own options, ``--quick`` among them) and the common ones.

    Parses ``argv``; options left unset take the script's grid for the device (``cpu`` or ``cuda``), over
    which ``quick`` goes when ``--quick`` is given, then the common defaults
    (:func:`_finish_common_arguments`); the ``positive`` options must be > 0.
    """
    _add_common_arguments(parser)
    args = parser.parse_args(argv)

    def presets(device: torch.device) -> dict[str, Any]:
        return {**(cuda if device.type == "cuda" else cpu), **(quick if args.quick else {})}

    _finish_common_arguments(parser, args, presets)
    require_positive(parser, args, positive)
    return args


@dataclass(frozen=True)
class ModelShape:
    """A whole model on one sequence: the model's name (a key of the script's configurations) and length."""

    model: str
    tokens: int

    def label(self) -> str:
        return f"{self.model} T={self.tokens}"


def require_positive(parser: argparse.ArgumentParser, args: argparse.Namespace, names: Sequence[str]) -> None:
    """``parser.error`` for the first of ``names`` whose value, or any value of a list option, is <= 0;
    an option left unset (``None``) passes."""
    for name in names:
        value = getattr(args, name)
        values = value if isinstance(value, list) else [value]
        if any(v is not None and v <= 0 for v in values):
            parser.error(f"--{name.replace('_', '-')} {value}: must be positive")


def run_grid(
    shapes: Sequence[_Shape], cases: Sequence[_CaseT], row: Callable[[_Shape, _CaseT], dict[str, Any]]
) -> list[dict[str, Any]]:
    """``row(shape, case)`` for every shape and, within it, every case; one progress line each on stderr."""
    rows: list[dict[str, Any]] = []
    total = len(shapes) * len(cases)
    for shape in shapes:
        for case in cases:
            rows.append(row(shape, case))
            done = rows[-1]
            summary = (
                f"{done['peak_extra_bytes'] / MIB:,.0f} MiB, {done['time_ms']:,.1f} ms"
                if done["status"] == "ok"
                else done["status"]
            )
            print(f"[{len(rows)}/{total}] {done['case']} {done['shape']}: {summary}", file=sys.stderr)
    return rows


def run_case(
    script: Path, case: Case, args: argparse.Namespace, spec: Mapping[str, Any], estimate_bytes: int
) -> dict[str, Any]:
    """Measure ``case`` in a fresh worker (``script --worker``), unless it cannot run or would not fit.

    Args:
        script: the benchmark script (its ``__file__``).
        case: what to run; its needs are checked first, on ``args.device``.
        args: the finished common options: ``device``, ``warmup``, ``repeat``, ``max_mem_gib``.
        spec: what the worker's ``measure`` needs besides them (shape, dtype, ...); JSON-serializable.
        estimate_bytes: the case's whole-process estimate; above ``--max-mem-gib`` the case is skipped.

    Returns:
        The worker's result (``status`` and measurements) or ``{"status": why it did not run}``. The
        worker receives ``spec`` plus ``case`` (its name), ``device``, ``warmup``, ``repeat``,
        ``max_mem_gib``.
    """
    reason = case.unavailable(args.device)
    if reason is None and estimate_bytes > args.max_mem_gib * GIB:
        reason = f"skipped: estimate {estimate_bytes / GIB:.2f} GiB > --max-mem-gib {args.max_mem_gib:g}"
    if reason is not None:
        return {"status": reason}
    common = {
        "case": case.name,
        "device": str(args.device),
        "warmup": args.warmup,
        "repeat": args.repeat,
        "max_mem_gib": args.max_mem_gib,
    }
    return run_worker(script, {**spec, **common}, args.device)


def run_worker(script: Path, spec: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Run ``script --worker spec`` in a fresh interpreter; its result, or how it died (killed, crashed)."""
    env = {**os.environ, **(CPU_WORKER_ENV if device.type == "cpu" else {})}
    with tempfile.TemporaryDirectory(prefix="benchmark_worker_") as tmp:
        result_path = Path(tmp) / "result.json"
        spec_json = json.dumps({**spec, "result_path": str(result_path)})
        proc = subprocess.run(
            [sys.executable, str(Path(script).resolve()), WORKER_FLAG, spec_json],
            env=env,
            check=False,
            capture_output=True,
            text=True,
        )
        if result_path.exists():
            return json.loads(result_path.read_text())
    if proc.returncode < 0:
        killed = " (SIGKILL: likely the kernel's OOM killer)" if proc.returncode == -9 else ""
        return {"status": f"died: signal {-proc.returncode}{killed}"}
    last = proc.stderr.strip().splitlines()[-1:] or ["no output"]
    return {"status": f"died: exit {proc.returncode}: {last[0]}"[:300]}


def worker_main(spec_json: str, measure: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """The worker's side of :func:`run_case`: ``measure(spec)``, written where the parent reads it.

    ``measure`` returns the row's measurements with ``status="ok"``; any exception it raises becomes
    the row's status (``OOM`` for an allocation failure), so that the run goes on with the next case.
    """
    spec = json.loads(spec_json)
    try:
        result = measure(spec)
    except Exception as err:  # noqa: BLE001  (any failure is one row's status; the run goes on)
        result = {"status": "OOM" if is_oom(err) else f"error: {type(err).__name__}: {err}"[:300]}
    Path(spec["result_path"]).write_text(json.dumps(result))


def start(
    args: argparse.Namespace, cases: Sequence[_CaseT], measure: Callable[[dict[str, Any]], dict[str, Any]]
) -> list[_CaseT] | None:
    """The first thing a script's ``main`` does: run as a worker (``--worker``), or print the cases
    (``--list-cases``), and return ``None`` when it did either; else the cases ``--cases`` chose."""
    if args.worker:
        worker_main(args.worker, measure)
        return None
    chosen = select_cases(cases, args.cases)
    if args.list_cases:
        print(format_case_list(chosen, args.device))
        return None
    return chosen
