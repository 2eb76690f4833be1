"""The GPU proof's ``loss`` section: the fused loss at the chunk the plan picks, against Liger and CCE.

One shape, Qwen3-8B's head (32768 tokens x 151936 x 4096, bf16): ``loss_memory.py`` measures ours at the
plan's chunk (:func:`planned_loss`: the layout the plan chooses for Qwen3-8B at 32K tokens on one 80 GB GPU)
and at Liger's own chunk (:func:`liger_chunk`; one run when the two agree), Liger and CCE side by side.
Targets (:func:`add_loss_figures`): ours' time at the plan's chunk against the faster peer; ours' extra memory
against what the plan budgets for the loss at that chunk; ours at Liger's chunk against Liger's memory. CCE's
memory is a ratio beside them, not a target: CCE keeps no ``[chunk, V]`` block at all (its kernels recompute
the logits tile by tile), a design no chunked loss matches.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from _probes import MIB
from _report import STATUS, Column, format_table, ratio_column, shape_column
from _section_base import ROOT, Row, Section, targets_verdict, verdict

LOSS_PEERS = ("liger_flce", "cce")
LOSS_TIME_TARGET = 1.5
"""Ours' time at the plan's chunk at most this times the faster of Liger and CCE. With a bf16 head weight ours
runs four ``2 N V H`` matmuls (the sweep's logits and ``grad_hidden``; the weight gradient's pass recomputes the
logits, to sum the gradient in fp32 instead of rounding it to bf16 at every chunk as Liger does) against
Liger's three, so at equal matmul speed ours takes 4/3 of Liger's time: 0.95 could not pass. 1.5 leaves an
eighth for the row kernels and catches what matters (an fp32 matmul, a per-chunk stall)."""
LOSS_PLAN_TARGET = 1.1
"""Ours' extra memory at the plan's chunk at most this times what the plan budgets for it (10% over: FAIL)."""
LOSS_MEMORY_TARGET = 1.0
"""Ours' extra memory at Liger's chunk at most this times Liger's, measured on the same shape in the same run.
Passable as counted on the CPU (``tests/ops/test_engine_memory.py``, on ``meta`` tensors through the CUDA
branch): ours' sweep holds one ``[chunk, V]`` bf16 logits block, as Liger does, and its bf16 weight's fp32
gradient pass no more than that (the products summed into the block's accumulator in place, the block sized
to fit); Liger holds its ``[chunk, H]`` input-gradient product besides."""
LOSS_MODEL = ROOT / "examples" / "configs" / "models" / "qwen3_8b.json"
"""The model whose head the section runs (151936 x 4096), planned at :data:`LOSS_PLAN`."""
LOSS_PLAN = {"seq_len": 32768, "gpus": 1, "gpu_bytes": 80 * 10**9}
"""Where the plan is asked for the chunk: Qwen3-8B, 32K tokens, one GPU of 80 GB (the CLI's default)."""
LOSS_ARGUMENTS = "--device cuda --dtype bf16 --repeat 3 --warmup 1"
"""``loss_memory.py``'s command line in the report, besides the shape, the cases and the chunk."""


@dataclass(frozen=True)
class LossTargets:
    """What the rows are judged against: the two chunks ours runs at, and the plan's budget at its chunk."""

    plan_chunk: int
    """Tokens per chunk the plan gives the fused loss (:func:`planned_loss`)."""
    liger_chunk: int
    """Tokens per chunk Liger picks for the shape (:func:`liger_chunk`)."""
    planned_bytes: int
    """The plan's loss term at :attr:`plan_chunk` less what ``loss_memory.py`` does not count as extra."""
    layout: str = ""
    """The layout the plan chose (its name), for the notes."""


def ours_case(chunk: int) -> str:
    """The case name of ours at ``chunk`` tokens per chunk in the section's table."""
    return f"ours_lce@{chunk}"


def liger_chunk(tokens: int, vocab: int, hidden: int) -> int:
    """Liger's tokens per chunk (``fused_linear_cross_entropy_forward``): ``N / ceil(V / H)`` rounded up to a
    power of two, so that a ``[chunk, V]`` block is about ``[N, H]``; at most ``N``."""
    return min(tokens, 1 << (math.ceil(tokens / math.ceil(vocab / hidden)) - 1).bit_length())


def planned_loss(model: Path = LOSS_MODEL) -> tuple[LossTargets, tuple[int, int, int]]:
    """The plan's chunk and its budget for the fused loss of ``model`` (a ``transformers`` config file) at
    :data:`LOSS_PLAN`, and the ``(tokens, vocab, hidden)`` shape that loss runs at on one rank.

    The chunk: the first layout that fits, its ``loss_chunk`` (the plan lowers it when the loss is the step's
    largest transient: :func:`lightning_cp.plan.search.memory_chunk`), else the automatic chunk as the plan
    counts it. The budget: that layout's ``loss`` term less the loss's input and the gradients of the input and
    the head's weight, as the plan counts them (``loss_memory.py`` leaves them out of ``extra``)."""
    from lightning_cp.cli.plan import read_model
    from lightning_cp.plan import local_tokens, plan
    from lightning_cp.plan.terms import Step, loss_chunk_tokens

    spec = LOSS_PLAN
    shape = read_model(str(model))
    candidates = plan(shape, spec["seq_len"], spec["gpus"])
    fitting = [c for c in candidates if c.fits(spec["gpu_bytes"])]
    if not fitting:
        raise ValueError(f"{model}: no layout fits {spec}; the section needs one the plan picks")
    chosen = fitting[0]
    tokens = local_tokens(spec["seq_len"], chosen.layout.cp)
    chunk = chosen.loss_chunk or loss_chunk_tokens(shape, tokens)
    step = Step(shape, chosen.layout, chosen.precision, "cuda", True, tokens)
    outside = 2 * tokens * shape.hidden * step.compute + shape.vocab * shape.hidden * step.master
    targets = LossTargets(
        plan_chunk=chunk,
        liger_chunk=liger_chunk(tokens, shape.vocab, shape.hidden),
        planned_bytes=chosen.estimate.loss - outside,
        layout=chosen.layout.name(),
    )
    return targets, (tokens, shape.vocab, shape.hidden)


def add_loss_figures(rows: list[Row], targets: LossTargets) -> None:
    """TFLOP/s of every row; on ours' rows (:func:`ours_case`) the time over the faster peer's and the extra
    memory over CCE's (a ratio), and the targets: at the plan's chunk the time (:data:`LOSS_TIME_TARGET`) and
    the extra memory over the plan's budget (:data:`LOSS_PLAN_TARGET`), at Liger's chunk the extra memory over
    Liger's (:data:`LOSS_MEMORY_TARGET`). Peers are those measured on the same shape in this run."""
    for row in rows:
        flops = 6 * row["tokens"] * row["vocab"] * row["hidden"]
        row["tflops"] = flops / (row["time_ms"] * 1e-3) / 1e12 if row["status"].startswith("ok") else None
    for shape in {row["shape"] for row in rows}:
        same = [r for r in rows if r["shape"] == shape and r["status"].startswith("ok")]
        peers = {r["case"]: r for r in same if r["case"] in LOSS_PEERS}
        fastest = min((r["time_ms"] for r in peers.values()), default=None)
        for row in same:
            row["x_best_peer"] = row["time_ms"] / fastest if fastest else None
            row["x_cce_memory"] = _memory_ratio(row, peers.get("cce"))
            if row["case"] == ours_case(targets.plan_chunk):
                row["planned_bytes"] = targets.planned_bytes
                row["time_target"] = verdict(row["x_best_peer"], LOSS_TIME_TARGET)
                row["plan_target"] = verdict(
                    row["peak_extra_bytes"] / targets.planned_bytes, LOSS_PLAN_TARGET
                )
            if row["case"] == ours_case(targets.liger_chunk):
                ratio = _memory_ratio(row, peers.get("liger_flce"))
                row["liger_memory_target"] = verdict(ratio, LOSS_MEMORY_TARGET)


def _memory_ratio(row: Row, peer: Row | None) -> float | None:
    """``row``'s extra memory over ``peer``'s; ``None`` without a peer or with a peer that kept nothing."""
    return row["peak_extra_bytes"] / peer["peak_extra_bytes"] if peer and peer["peak_extra_bytes"] else None


TARGET_KEYS = ("time_target", "plan_target", "liger_memory_target")
_LOSS_COLUMNS = (
    shape_column("N x V x H"),
    Column("case", "case", align="<"),
    Column("chunk used", "chunk_used", ",.0f"),
    Column("time ms", "time_ms", ",.1f"),
    Column("TFLOP/s", "tflops", ",.1f"),
    Column("extra MiB", "peak_extra_bytes", ",.0f", scale=MIB),
    ratio_column("x_best_peer", "time x faster peer"),
    ratio_column("x_cce_memory", "memory x CCE"),
    Column("plan's MiB", "planned_bytes", ",.0f", scale=MIB),
    Column(f"time (x peer <= {LOSS_TIME_TARGET:g})", "time_target", align="<"),
    Column(f"memory (x plan <= {LOSS_PLAN_TARGET:g})", "plan_target", align="<"),
    Column(f"memory (x Liger <= {LOSS_MEMORY_TARGET:g})", "liger_memory_target", align="<"),
    STATUS,
)


def loss_commands(targets: LossTargets, shape: tuple[int, int, int]) -> list[list[str]]:
    """``loss_memory.py``'s argument lists: ours at each distinct chunk of ``targets``, then the peers."""
    common = [
        *LOSS_ARGUMENTS.split(),
        "--tokens",
        str(shape[0]),
        "--vocab",
        str(shape[1]),
        "--hidden",
        str(shape[2]),
    ]
    chunks = sorted({targets.plan_chunk, targets.liger_chunk})
    ours = [[*common, "--chunk-size", str(chunk), "--cases", "ours_lce"] for chunk in chunks]
    return [*ours, [*common, "--cases", *LOSS_PEERS]]


def _run(commands: Sequence[list[str]]) -> list[Row]:
    """Every command's rows, ours' renamed by the chunk they ran at (:func:`ours_case`)."""
    import loss_memory

    rows = []
    for argv in commands:
        for row in loss_memory.main(argv):
            if row["case"] == "ours_lce":
                row["case"] = ours_case(int(argv[argv.index("--chunk-size") + 1]))
            rows.append(row)
    return rows


def loss(device: torch.device) -> Section:
    targets, shape = planned_loss()
    commands = loss_commands(targets, shape)
    rows = _run(commands)
    add_loss_figures(rows, targets)
    ours = sorted({ours_case(targets.plan_chunk), ours_case(targets.liger_chunk)})
    result = targets_verdict(rows, ours, TARGET_KEYS, "ours against the plan and the peers")
    notes = (
        f"`loss_memory.py` with {'; '.join('`' + ' '.join(argv) + '`' for argv in commands)}: forward + backward "
        "of `mean CE(hidden @ weight.T, labels)` (10% of labels ignored) into both gradients, median of 3 after 1 "
        "warm-up. TFLOP/s counts 3 x 2NVH. Extra: the peak above the inputs, minus the two gradients. "
        f"Chunks: the plan's, {targets.plan_chunk:,} tokens (Qwen3-8B at {LOSS_PLAN['seq_len']:,} tokens on one "
        f"80 GB GPU: `{targets.layout}`), and Liger's, {targets.liger_chunk:,} (`N / ceil(V / H)`, a power of two); "
        f"the plan budgets {targets.planned_bytes / MIB:,.0f} MiB for the loss there besides its input and the "
        "gradients. CCE's memory is a ratio, not a target: CCE keeps no `[chunk, V]` block (its kernels recompute "
        f"the logits tile by tile). The time target is {LOSS_TIME_TARGET:g}x the faster peer: with a bf16 weight "
        "ours runs 4 matmuls of 2NVH (its fp32 weight-gradient pass recomputes the logits), Liger 3."
    )
    table = format_table(rows, _LOSS_COLUMNS, markdown=True)
    return Section(result.status, result.summary, f"{table}\n\n{notes}")
