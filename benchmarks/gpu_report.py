"""The GPU proof in one Markdown report: the GPU tests, the doctor, the loss, the attention kernels, the DSA
indexer's kernel, a hybrid layer per CP rank, a decoder layer per planned layout and the main job, each within a
time limit of its own.

One command on one lent H100 / H200, about 8.5 minutes in all (``--budget``, seconds, shared by the sections)::

    python benchmarks/gpu_report.py --budget 510 --output gpu_report.md
    python benchmarks/gpu_report.py --sections doctor loss --output part.md
    python benchmarks/gpu_report.py --device cpu --output cpu.md       # what runs here, and what is skipped

Each section (:mod:`_sections`) runs in a process of its own (this file with ``--section``) under its share of
the budget left (:data:`SHARES`: time a section leaves unused goes to the later ones); one that runs over is
stopped with everything it started, one that crashes is a FAIL with the end of its output, and the next one
starts either way. The report is rewritten after every section, so it exists whatever happens later: the device
and the versions, one table line per section (status, seconds against its limit, summary) and each section's
tables and output. On a machine without CUDA every section that needs it is a SKIP saying why; the doctor runs
on the CPU. The exit status is 1 when a section failed, else 0.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import torch
from _report import machine_info
from _sections import SECTIONS, Section, code_block

SHARES = {
    "gpu-tests": 120,
    "doctor": 70,
    "loss": 70,
    "attention": 60,
    "indexer": 20,
    "hybrid": 60,
    "layers": 60,
    "main-job": 50,
}
"""Each section's time limit in seconds under the default budget when every section runs and each uses all of
its time: the shares of the time left that each gets."""
BUDGET_S = sum(SHARES.values())
"""The default budget: 510 s, which leaves about a minute of the device's 10-minute command for installing the
wheels and starting."""
_PACKAGES = (
    "lightning-cp",
    "triton",
    "transformers",
    "megatron-core",
    "lightning",
    "liger-kernel",
    "cut-cross-entropy",
    "flash-linear-attention",
    "causal-conv1d",
    "mamba-ssm",
    "pytest",
)
_LOG_TAIL = 40
"""Lines of a section's output the report shows when the section crashed or ran out of time."""


def share_of(name: str, remaining: Sequence[str], remaining_s: float) -> float:
    """Section ``name``'s time limit: its share (:data:`SHARES`) of the ``remaining_s`` seconds left for it and
    the ``remaining`` sections after it, so that time an earlier section left unused goes to the later ones."""
    return remaining_s * SHARES[name] / sum(SHARES[other] for other in (name, *remaining))


def run_section(name: str, device: torch.device, limit_s: float, log: Path) -> Section:
    """Section ``name`` in a process of its own, its output in ``log``: its verdict, or a FAIL when it ran over
    ``limit_s`` (stopped with every process it started) or ended without one."""
    result = log.with_suffix(".json")
    command = [sys.executable, str(Path(__file__).resolve()), "--section", name, "--device", device.type]
    with log.open("w") as out:
        proc = subprocess.Popen(
            [*command, "--result", str(result)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},  # what it printed is in the log when it is stopped
            start_new_session=True,  # its own process group: stopping it stops what it started
        )
        try:
            proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return _failed(f"stopped after its limit of {limit_s:.0f} s", log)
    if result.exists():
        return Section(**json.loads(result.read_text()))
    return _failed(f"ended with status {proc.returncode} and no verdict", log)


def _failed(summary: str, log: Path) -> Section:
    """A FAIL with ``summary`` and the end of the section's output."""
    tail = code_block(log.read_text(errors="replace"), _LOG_TAIL)
    return Section("FAIL", summary, f"The end of its output:\n\n{tail}")


def _header(device: torch.device, argv: Sequence[str], budget_s: float) -> list[str]:
    info = machine_info(device, _PACKAGES)
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return [
        "# lightning-cp GPU report",
        "",
        f"`python benchmarks/gpu_report.py {' '.join(argv)}`, {when}, budget {budget_s:.0f} s",
        "",
        *(
            f"- {key}: {'none' if value is None else f'{value:.1f}' if isinstance(value, float) else value}"
            for key, value in info.items()
        ),
        "",
    ]


def render(header: list[str], names: Sequence[str], done: dict[str, tuple[Section, float, float]]) -> str:
    """The report: ``header``, one line per section (those not run yet as ``...``), then each finished one."""
    lines = [*header, "| section | status | seconds (limit) | summary |", "| --- | --- | ---: | --- |"]
    for name in names:
        if name not in done:
            lines.append(f"| {name} | ... | - | not run yet |")
            continue
        section, seconds, limit = done[name]
        spent = f"{seconds:.0f} ({limit:.0f})" if limit else "-"
        lines.append(f"| {name} | {section.status} | {spent} | {section.summary.replace('|', '/')} |")
    for name in names:
        if name in done:
            section = done[name][0]
            lines += ["", f"## {name}: {section.status}", "", section.summary, ""]
            if section.body:
                lines += [section.body, ""]
    return "\n".join(lines)


def _parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=Path("gpu_report.md"), help="the Markdown report")
    parser.add_argument(
        "--budget", type=float, default=BUDGET_S, help=f"seconds for all sections (default {BUDGET_S})"
    )
    parser.add_argument(
        "--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS), help="default: all"
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    parser.add_argument("--section", choices=list(SECTIONS), help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.budget <= 0:
        parser.error(f"--budget {args.budget}: must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the sections, write the report to ``--output``; the exit status (1: a section failed)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.section:  # one section, in the process the report started for it
        args.result.write_text(json.dumps(asdict(SECTIONS[args.section].run(device))))
        return 0
    reasons = {name: SECTIONS[name].needs(device) for name in args.sections}  # cheap: no process started
    header = _header(device, argv, args.budget)
    done: dict[str, tuple[Section, float, float]] = {}
    deadline = time.perf_counter() + args.budget
    with tempfile.TemporaryDirectory(prefix="gpu_report_") as tmp:
        for index, name in enumerate(args.sections):
            later = [other for other in args.sections[index + 1 :] if reasons[other] is None]
            limit = share_of(name, later, deadline - time.perf_counter()) if reasons[name] is None else 0.0
            reason = reasons[name] or (None if limit >= 1 else "no time left of the budget")
            if reason is None:
                print(f"gpu_report: {name} (limit {limit:.0f} s)", flush=True)
            started = time.perf_counter()
            log = Path(tmp) / f"{name}.log"
            section = Section("SKIP", reason) if reason else run_section(name, device, limit, log)
            done[name] = (section, time.perf_counter() - started, limit)
            print(f"gpu_report: {name}: {section.status} {section.summary}", flush=True)
            args.output.write_text(render(header, args.sections, done))
    print(f"gpu_report: wrote {args.output}", flush=True)
    return 1 if any(section.status == "FAIL" for section, _, _ in done.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
