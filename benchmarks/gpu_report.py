"""The project's GPU figures in one Markdown report: fused loss, CP attention, an HF Llama step, an FSDP step.

One command, sized for about 8 minutes on one H100 (each part also runs alone with ``--parts``)::

    python benchmarks/gpu_report.py --output gpu_report.md
    python benchmarks/gpu_report.py --parts loss attention --output loss_attention.md
    python benchmarks/gpu_report.py --quick --output report.md        # tiny shapes on the CPU (CI)

It runs the benchmark scripts of this folder through their command lines (each case in a fresh worker:
``_harness``) and writes their rows as tables, with the device, the versions, and each target of issue 24
next to the measured ratio and PASS / FAIL:

=============  ========================================================================================
``loss``       ``loss_memory.py``: ours (``impl="auto"``), Liger and CCE at 8K / 32K / 128K tokens x
               128K / 152K vocabulary x 4K hidden, bf16: time, extra memory, TFLOP/s, the chunk ours
               used. Targets: at most 0.95x the time of the faster of Liger and CCE, and at most the
               extra memory of each of them, measured in the same run
``attention``  ``attention.py``: one simulated CP rank of cp 4 and 8, padded and packed (``mixed``), 32K
               to 512K tokens, 16 heads / 4 KV heads x 128, against the ideal share (the best single-device
               kernel on the whole sequence / cp) and the FlashAttention packages installed. Target: within
               1.25x of the ideal share padded, 1.5x packed
``hf``         ``hf_llama.py``: a Llama-1B-shaped forward + backward at 32K and 128K tokens, ours vs HF +
               Liger
``fsdp``       ``fsdp_step.py``: one bf16-mixed training step of a ~1B GPT under FSDP (and DDP), one process
=============  ========================================================================================

A peer that is not installed (Liger, CCE, a FlashAttention package) or cannot run here is a row with the
reason, never a crash.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import attention
import fsdp_step
import hf_llama
import loss_memory
import torch
from _probes import MIB
from _report import CASE, STATUS, Column, format_table, machine_info, ratio_column, shape_column

Row = dict[str, Any]

LOSS_TIME_TARGET = 0.95
"""Ours' time at most this times the faster of Liger and CCE."""
LOSS_MEMORY_TARGET = 1.0
"""Ours' extra memory at most this times each peer's, measured on the same shape in the same run."""
ATTENTION_TARGETS = {"padded": 1.25, "mixed": 1.5}
"""Ours' time per rank at most this times the ideal share, per layout (``mixed``: packed documents)."""
_LOSS_PEERS = ("liger_flce", "cce")
_PACKAGES = (
    "lightning-cp",
    "triton",
    "transformers",
    "megatron-core",
    "lightning",
    "liger-kernel",
    "cut-cross-entropy",
    "flash-attn",
)


def _part_arguments(quick: bool, device: str) -> dict[str, list[str]]:
    """Each part's command line: the GPU grid, or ``--quick`` for the smoke test."""
    common = ["--device", device]
    if quick:
        return {
            "loss": [*common, "--quick", "--cases", "ours_lce", *_LOSS_PEERS],
            "attention": [*common, "--quick", "--cp", "4", "--layouts", "padded", "mixed"]
            + ["--cases", "ideal", "ours", "fa2", "fa3", "fa4"],
            "hf": [*common, "--quick"],
            "fsdp": [*common, "--quick", "--cases", "fsdp"],
        }
    return {
        "loss": [
            *common,
            "--dtype",
            "bf16",
            "--tokens",
            "8192",
            "32768",
            "131072",
            "--vocab",
            "128256",
            "151936",
        ]
        + ["--hidden", "4096", "--cases", "ours_lce", *_LOSS_PEERS, "--repeat", "3", "--warmup", "1"],
        "attention": [*common, "--dtype", "bf16", "--tokens", "32768", "131072", "524288", "--cp", "4", "8"]
        + ["--layouts", "padded", "mixed", "--heads", "16", "--kv-heads", "4", "--head-dim", "128"]
        + ["--cases", "ideal", "ours", "fa2", "fa3", "fa4", "--repeat", "1", "--warmup", "1"],
        "hf": [*common, "--dtype", "bf16", "--tokens", "32768", "131072", "--repeat", "1", "--warmup", "1"],
        "fsdp": [*common, "--repeat", "3", "--warmup", "2"],
    }


def _verdict(value: float | None, limit: float) -> str | None:
    return None if value is None else f"{'PASS' if value <= limit else 'FAIL'} {value:.2f} <= {limit:g}"


# --------------------------------------------------------------------------------------------------
# Each part: the script that measures it, the figures the report adds to its rows, its table


def _add_loss_figures(rows: list[Row]) -> None:
    """TFLOP/s of every row; ours' time over the faster peer's and its extra memory over each peer's (the
    peers measured on the same shape in this run), against the targets."""
    for row in rows:
        flops = 6 * row["tokens"] * row["vocab"] * row["hidden"]
        row["tflops"] = flops / (row["time_ms"] * 1e-3) / 1e12 if row["status"].startswith("ok") else None
    for shape in {row["shape"] for row in rows}:
        same = [r for r in rows if r["shape"] == shape and r["status"].startswith("ok")]
        peers = {r["case"]: r for r in same if r["case"] in _LOSS_PEERS}
        fastest = min((r["time_ms"] for r in peers.values()), default=None)
        for row in same:
            row["x_best_peer"] = row["time_ms"] / fastest if fastest else None
            if row["case"] != "ours_lce":
                continue
            row["time_target"] = _verdict(row["x_best_peer"], LOSS_TIME_TARGET)
            for name, peer in peers.items():
                ratio = (
                    row["peak_extra_bytes"] / peer["peak_extra_bytes"] if peer["peak_extra_bytes"] else None
                )
                row[f"memory_x_{name}"] = _verdict(ratio, LOSS_MEMORY_TARGET) if ratio else None


def _add_attention_targets(rows: list[Row]) -> None:
    for row in rows:
        limit = ATTENTION_TARGETS.get(row["layout"])
        if row["case"] != "ideal" and limit is not None:
            row["target"] = _verdict(row.get("x_ideal"), limit)


@dataclass(frozen=True)
class _Part:
    run: Callable[[list[str]], list[Row]]
    """The script's ``main(argv) -> rows``."""
    title: str
    columns: tuple[Column, ...]
    notes: str
    add_figures: Callable[[list[Row]], None] | None = None

    def section(self, rows: list[Row]) -> str:
        if self.add_figures is not None:
            self.add_figures(rows)
        return f"## {self.title}\n\n{format_table(rows, self.columns, markdown=True)}\n\n{self.notes}\n"


_TIME = Column("time ms", "time_ms", ",.1f")
_PEAK_EXTRA = Column("step extra MiB", "peak_extra_bytes", ",.0f", scale=MIB)
_PEAK = Column("peak MiB", "peak_bytes", ",.0f", scale=MIB)

_PARTS = {
    "loss": _Part(
        loss_memory.main,
        "Fused LM head + cross-entropy (`loss_memory.py`)",
        (
            shape_column("N x V x H"),
            CASE,
            _TIME,
            Column("TFLOP/s", "tflops", ",.1f"),
            Column("extra MiB", "peak_extra_bytes", ",.0f", scale=MIB),
            Column("chunk used", "chunk_used", ",.0f"),
            ratio_column("x_best_peer", "x faster peer"),
            Column(f"time target (x peer <= {LOSS_TIME_TARGET})", "time_target", align="<"),
            *(
                Column(f"memory target (x {peer} <= {LOSS_MEMORY_TARGET:g})", f"memory_x_{peer}", align="<")
                for peer in _LOSS_PEERS
            ),
            STATUS,
        ),
        "Forward + backward of `mean CE(hidden @ weight.T, labels)` (10% of labels ignored) into both "
        "gradients. TFLOP/s counts the matmul FLOPs of a fused head: 3 x 2NVH (the logits, dL/dhidden, "
        "dL/dweight); ours computes a bf16 weight's gradient in a second pass over vocabulary blocks "
        "(5 x 2NVH done), counted as 3. Extra: the peak above the inputs, minus the two gradients. Chunk "
        "used: the tokens per chunk ours resolved in the run (on CUDA the automatic chunk follows the free "
        "memory). The targets compare ours with the peers measured on the same shape in this run.",
        _add_loss_figures,
    ),
    "attention": _Part(
        attention.main,
        "CP attention per rank (`attention.py`)",
        (
            shape_column("layout, tokens, cp"),
            CASE,
            _TIME,
            Column("ideal share ms", "ideal_share_ms", ",.1f"),
            ratio_column("x_ideal", "x ideal"),
            Column("target (x ideal)", "target", align="<"),
            Column("peak extra MiB", "peak_extra_bytes", ",.0f", scale=MIB),
            Column("saved MiB", "saved_bytes", ",.1f", scale=MIB),
            STATUS,
        ),
        "One simulated CP rank (rank 0), forward + backward. Ideal share: full-sequence SDPA (per document "
        "when packed; flash on CUDA) of all tokens, divided by cp. `mixed`: packed documents of random "
        f"lengths. Targets: {ATTENTION_TARGETS['padded']}x padded, {ATTENTION_TARGETS['mixed']}x packed.",
        _add_attention_targets,
    ),
    "hf": _Part(
        hf_llama.main,
        "HF Llama forward + backward (`hf_llama.py`)",
        (
            shape_column("model, tokens"),
            CASE,
            _TIME,
            ratio_column("time_x_ours", "x ours"),
            _PEAK_EXTRA,
            _PEAK,
        )
        + (Column("loss", "loss", ".4f"), STATUS),
        "Llama-3.2-1B's shape, random weights, gradient checkpointing, one sequence, cp = 1. ours: the "
        '"lightning_cp" attention and the fused loss; hf_liger: HF sdpa with Liger-Kernel\'s Llama patches.',
    ),
    "fsdp": _Part(
        fsdp_step.main,
        "Training step under FSDP (`fsdp_step.py`)",
        (
            shape_column("model, tokens"),
            CASE,
            Column("step ms", "time_ms", ",.1f"),
            _PEAK,
            _PEAK_EXTRA,
            STATUS,
        ),
        "Forward, backward and AdamW, bf16-mixed, activation checkpointing of the blocks, world size 1.",
    ),
}


def _value(value: Any) -> str:
    """A machine-info value: ``None`` (a package not installed, no CUDA) as ``none``, floats rounded."""
    return "none" if value is None else f"{value:.1f}" if isinstance(value, float) else str(value)


def _header(device: torch.device, argv: Sequence[str]) -> str:
    info = machine_info(device, _PACKAGES)
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# lightning-cp GPU report",
        "",
        f"`python benchmarks/gpu_report.py {' '.join(argv)}`, {when}",
        "",
        *(f"- {key}: {_value(value)}" for key, value in info.items()),
        "",
    ]
    return "\n".join(lines)


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=Path("gpu_report.md"), help="the Markdown report")
    parser.add_argument("--parts", nargs="+", choices=list(_PARTS), default=list(_PARTS), help="default: all")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (runs on the CPU, for CI)")
    parser.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> str:
    """Run the parts, write the report to ``--output`` and return it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    part_arguments = _part_arguments(args.quick, device.type)
    sections = [_header(device, argv)]
    for name in args.parts:
        part, started = _PARTS[name], time.perf_counter()
        rows = part.run(part_arguments[name])
        sections.append(part.section(rows) + f"\n_{name}: {time.perf_counter() - started:.0f} s_\n")
        args.output.write_text("\n".join(sections))  # what is done so far survives a later crash
    print(f"\ngpu_report: wrote {args.output}")
    return "\n".join(sections)


if __name__ == "__main__":
    main()
