"""The GPU proof's ``indexer`` section: the DSA indexer's Triton kernel timed against its torch path and its ideal.

:func:`~lightning_cp.parallel.key_indexer.select_topk_keys` at GLM-5's indexer (:data:`INDEXER_SHAPE`: 32 heads x
128 dims, top-2048) on one sequence of 32,768 tokens at cp 1, bf16 queries and keys, fp32 weights, twice: with the
Triton kernel (``_indexer_triton``) and with the torch path (the kernel reported unavailable, as without Triton).
Each is timed (median of 3 after a warm-up) against the ideal: the scores' FLOPs (:func:`score_flops`) at the bf16
rate of one ``torch.mm`` of two 8192 x 8192 matrices on the same device. The two selections must agree row by row
(near-ties may differ: both sum fp32 products in different orders), and the Triton call's peak above its inputs is
set beside the plan's ``indexer`` term (:func:`~lightning_cp.plan.sparse.sparse_layer_bytes`), informational.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from unittest import mock

import torch
from _probes import MIB, measure
from _report import CASE, STATUS, Column, format_table, ratio_column
from _section_base import Row, Section, targets_verdict, verdict

INDEXER_SHAPE = {"tokens": 32768, "heads": 32, "dim": 128, "topk": 2048}
"""GLM-5's indexer (``index_n_heads``, ``index_head_dim``, ``index_topk``) on one sequence."""
TIME_TARGET = 3.0
"""The Triton kernel's time at most this times the ideal."""
AGREEMENT_TARGET = 0.99
"""At least this share of the query rows select the same set of keys on both paths."""
RATE_SIZE = 8192
"""The side of the square bf16 matrices whose ``torch.mm`` gives the device's rate."""
CASES = ("triton", "torch")


def score_flops(tokens: int, heads: int, dim: int) -> int:
    """The indexer's FLOPs on one causal sequence of ``tokens``: each of the ``T (T + 1) / 2`` (query, earlier
    key) pairs' ``heads`` dot products of ``dim`` and the weighted sum over the heads, ``2 H (D + 1)`` each."""
    return heads * (dim + 1) * tokens * (tokens + 1)


@contextlib.contextmanager
def torch_path() -> Iterator[None]:
    """Within it ``indexer_scores`` runs its torch path on CUDA too: the Triton kernel reported unavailable."""
    from lightning_cp.parallel import _indexer_triton

    with mock.patch.object(_indexer_triton, "available", lambda x: False):
        yield


def measure_paths(
    device: torch.device,
    tokens: int,
    heads: int,
    dim: int,
    topk: int,
    rate_size: int,
    repeat: int = 3,
) -> tuple[dict[str, Row], float, float]:
    """Time ``select_topk_keys`` on random bf16 queries ``[tokens, heads, dim]`` and keys ``[tokens, dim]``, fp32
    weights, one sequence at cp 1 on ``device`` (no communication), by each of :data:`CASES` (warm-up 1, then the
    median of ``repeat``); and one bf16 ``torch.mm`` of ``rate_size`` squares.

    Returns:
        Per case ``time_ms`` and ``peak_extra_bytes`` (the peak above the inputs: CUDA's allocator, else the
        resident set); the share of query rows whose selected sets are equal on both paths; the mm's FLOP/s.
    """
    from lightning_cp.parallel import CPShard, CPSplit
    from lightning_cp.parallel.key_indexer import select_topk_keys

    g = torch.Generator(device).manual_seed(0)

    def randn(*size: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:  # made on the device: faster
        return torch.randn(size, generator=g, device=device, dtype=dtype)

    queries, keys = randn(tokens, heads, dim), randn(tokens, dim)
    weights = randn(tokens, heads, dtype=torch.float32) * heads**-0.5
    shard = CPShard.build(CPSplit(1, 0), torch.tensor([tokens]), device)

    def select() -> torch.Tensor:
        return select_topk_keys(queries, weights, keys, shard, topk, dim**-0.5)

    measured: dict[str, Row] = {}
    selected: dict[str, torch.Tensor] = {}
    for case in CASES:
        with torch_path() if case == "torch" else contextlib.nullcontext():
            measurement, selected[case] = measure(select, device, warmup=1, repeat=repeat)
        summary = measurement.summary()
        measured[case] = {key: summary[key] for key in ("time_ms", "peak_extra_bytes")}
    a, b = randn(rate_size, rate_size), randn(rate_size, rate_size)
    mm, _ = measure(lambda: torch.mm(a, b), device, warmup=1, repeat=repeat)
    rate = 2 * rate_size**3 / (mm.summary()["time_ms"] / 1e3)
    return measured, same_rows(selected["triton"], selected["torch"]), rate


def same_rows(a: torch.Tensor, b: torch.Tensor) -> float:
    """The share of the rows of ``a`` and ``b`` (``[T, n]`` selected keys) that hold the same set of keys, in
    whatever order (``topk`` orders equal scores as it likes)."""
    return (a.sort(dim=1).values == b.sort(dim=1).values).all(dim=1).float().mean().item()


def indexer_rows(measured: dict[str, Row], flops: int, rate: float, plan_bytes: int, shape: str) -> list[Row]:
    """The table's rows: the ideal (``flops`` at ``rate`` FLOP/s), then each measured case of ``measured``
    (:func:`measure_paths`) with its TFLOP/s, its time over the ideal, its peak over ``plan_bytes`` and, for
    ``triton``, its target cell (at most :data:`TIME_TARGET` x ideal)."""
    ideal_ms = flops / rate * 1e3
    rows: list[Row] = [
        {"case": "ideal", "time_ms": ideal_ms},
        *({"case": c, **r} for c, r in measured.items()),
    ]
    for row in rows:
        row.update(
            shape=shape, status="ok", x_ideal=row["time_ms"] / ideal_ms, tflops=flops / row["time_ms"] / 1e9
        )
        row["target"] = verdict(row["x_ideal"], TIME_TARGET) if row["case"] == "triton" else None
        peak = row.get("peak_extra_bytes")
        row["x_plan"] = None if peak is None else peak / plan_bytes
    return rows


def indexer_verdict(rows: Sequence[Row], agreement: float) -> Section:
    """PASS when the Triton kernel's time target and the rows' agreement (at least :data:`AGREEMENT_TARGET`)
    pass, else FAIL naming what missed; the summary gives both times, triton's ratio to the ideal and the
    agreement. No body (:func:`indexer` adds the tables)."""
    timed = targets_verdict(rows, ("triton",), ["target"], "time")
    by_case = {row["case"]: row for row in rows}
    triton, torch_ = by_case["triton"], by_case["torch"]
    summary = (
        f"triton {triton['time_ms']:,.1f} ms ({triton['x_ideal']:.2f}x ideal, target {TIME_TARGET:g}x), "
        f"torch {torch_['time_ms']:,.1f} ms; rows agreeing {agreement:.4f} (target {AGREEMENT_TARGET:g})"
    )
    missed = [] if timed.status == "PASS" else [timed.summary]
    if agreement < AGREEMENT_TARGET:
        missed.append(f"agreement {agreement:.4f} < {AGREEMENT_TARGET:g}")
    return Section("FAIL", f"{summary}; FAIL: {'; '.join(missed)}") if missed else Section("PASS", summary)


_COLUMNS = (
    CASE,
    Column("time ms", "time_ms", ",.2f"),
    Column("TFLOP/s", "tflops", ",.1f"),
    ratio_column("x_ideal", "x ideal"),
    Column("target (x ideal)", "target", align="<"),
    Column("peak above inputs MiB", "peak_extra_bytes", ",.0f", scale=MIB),
    ratio_column("x_plan", "x plan's indexer term"),
    STATUS,
)


def indexer(device: torch.device) -> Section:
    from sparse_attention import layer_shape

    from lightning_cp.plan.sparse import sparse_layer_bytes

    tokens, heads, dim, topk = INDEXER_SHAPE.values()
    measured, agreement, rate = measure_paths(device, tokens, heads, dim, topk, RATE_SIZE)
    # GLM-5's sparse layer in MLA's absorbed form (the indexer's term depends on the indexer's sizes alone).
    shape = layer_shape(64, 576, 512, heads, dim, topk, kv_heads=1)
    plan_bytes = sparse_layer_bytes(shape, tokens, 1, 1, 2, latent=True).indexer
    label = f"T {tokens:,}, {heads} x {dim}, top-{topk}"
    rows = indexer_rows(measured, score_flops(tokens, heads, dim), rate, plan_bytes, label)
    body = (
        f"`select_topk_keys` on one sequence ({label}, cp 1), bf16 queries and keys, fp32 weights; median of 3 "
        f"after a warm-up. Ideal: the scores' {score_flops(tokens, heads, dim) / 1e12:.2f} TFLOP "
        f"(`2 H (D + 1) T (T + 1) / 2`) at one bf16 `torch.mm` of {RATE_SIZE} x {RATE_SIZE}'s rate "
        f"({rate / 1e12:,.0f} TFLOP/s). `torch`: the same call with the Triton kernel reported unavailable. "
        f"Query rows selecting the same set on both paths: {agreement:.4f} (target at least {AGREEMENT_TARGET:g}). "
        f"Peak: `torch.cuda.max_memory_allocated` above the inputs, over the plan's `indexer` term "
        f"({plan_bytes / MIB:,.0f} MiB; informational).\n\n" + format_table(rows, _COLUMNS, markdown=True)
    )
    return dataclasses.replace(indexer_verdict(rows, agreement), body=body)
