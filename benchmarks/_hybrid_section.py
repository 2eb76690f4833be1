"""The GPU proof's ``hybrid`` section: one CP rank of a mixer layer with the CUDA kernels ``transformers`` finds.

A Gated DeltaNet, a Mamba2 and a short-convolution layer at a real model's width (:data:`HYBRID_SIZES`), each
whose kernels are installed: rank 0 of cp 4 timed with its peers simulated, against the unsharded layer's
share, and every rank of the group together against the layer in fp32 (:func:`mixer_rank`).
"""

from __future__ import annotations

import copy
import importlib.util
import itertools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from _report import STATUS, Column, format_table, ratio_column
from _section_base import Row, Section, error_ratio, verdict

HYBRID_SIZES: dict[str, dict[str, Any]] = {
    "gated_deltanet": {
        "hidden_size": 2048,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "initializer_range": 0.02,
    },
    "mamba2": {
        "hidden_size": 2048,
        "num_heads": 64,
        "head_dim": 64,
        "n_groups": 8,
        "state_size": 128,
        "chunk_size": 256,
        "time_step_rank": 128,
        "initializer_range": 0.02,
    },
    "short_conv": {"hidden_size": 2048, "initializer_range": 0.02},
}
"""Each mixer kind at a real model's width (Qwen3.5's Gated DeltaNet, a Mamba2 of Nemotron-H's heads, LFM2's
convolution), at ``transformers``' default initializer range."""
HYBRID_DOCUMENTS = (4096,) * 4
HYBRID_CP = 4


def _timed(
    step: Callable[[], None], device: torch.device, repeat: int, setup: Callable[[], None] | None = None
) -> float:
    """Median wall milliseconds of ``step`` over ``repeat`` runs after one warm-up (CUDA synchronized);
    ``setup`` runs before each, untimed."""
    times = []
    for run in range(repeat + 1):
        if setup is not None:
            setup()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        begin = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if run:
            times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times)


def mixer_rank(
    kind: str,
    device: torch.device,
    dtype: torch.dtype,
    documents: Sequence[int],
    cp: int,
    sizes: dict[str, Any] | None = None,
    repeat: int = 3,
) -> Row:
    """One CP rank of the mixer layer of ``kind`` (``sizes`` over the doctor's tiny configuration) on a packed
    row of ``documents`` of one length: its forward + backward time (rank 0, its peers simulated: their data
    are zeros, their work not done), the unsharded layer's (each document alone, as the rows of a batch) and
    its share; and the relative errors of every rank together and of the layer itself in ``dtype`` against
    the layer in fp32 on ``device`` (outputs, input and parameter gradients), ours' worst over its limit
    (:func:`error_ratio`)."""
    from lightning_cp.doctor._compare import relative_error
    from lightning_cp.doctor._ranks import SimulatedRanks
    from lightning_cp.doctor.mixers import kernel_packages, mixer_config, mixer_layer, mixer_triples
    from lightning_cp.hf.mixers import adapt_token_mixers
    from lightning_cp.parallel import shard_batch
    from lightning_cp.parallel.simulated import SimulatedCPGroup

    if len(set(documents)) != 1:
        raise ValueError(f"documents {list(documents)}: the unsharded layer takes them as rows of one length")
    layer = mixer_layer(kind, dtype, sizes)
    width = mixer_config(kind, sizes)["hidden_size"]
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(1, sum(documents), width, generator=g).to(dtype)
    weight = torch.randn(hidden.shape, generator=g).to(dtype)
    triples, _ = mixer_triples(
        SimulatedRanks(cp), device, layer, hidden, weight, documents, reference=(torch.float32, device)
    )
    errors = {q: (relative_error(o, r), relative_error(t, r)) for q, (o, r, t) in triples.items()}
    ratios = {q: error_ratio(ours, torchs, dtype) for q, (ours, torchs) in errors.items()}
    worst = max(ratios, key=ratios.__getitem__)
    row: Row = {
        "kind": kind,
        "kernels": kernel_packages(kind),
        "ours_errors": " / ".join(f"{ours:.1e}" for ours, _ in errors.values()),
        "torch_errors": " / ".join(f"{torchs:.1e}" for _, torchs in errors.values()),
        "worst": f"{worst}: {verdict(ratios[worst], 1.0)}",
    }
    ranked = copy.deepcopy(layer).to(device)
    adapt_token_mixers(ranked, cp)
    unsharded = layer.to(device)
    x = hidden.to(device).view(len(documents), documents[0], width).requires_grad_()
    w = weight.to(device).view_as(x)
    row["unsharded_ms"] = _timed(lambda: unsharded(x).backward(w), device, repeat)
    full = {
        "input_ids": torch.zeros(1, hidden.shape[1], dtype=torch.long, device=device),
        "cu_seqlens": torch.tensor([0, *itertools.accumulate(documents)]),
        "h": hidden.to(device),
        "w": weight.to(device),
    }
    current: dict[str, Any] = {}

    def new_batch() -> None:  # a fresh group and shard per step, untimed (the data pipeline's work)
        group = SimulatedCPGroup(cp, sum_key_gradients=False)
        current.update(group=group, shard=shard_batch(full, cp, 0, cp_group=group.exchange(0)))

    def rank_step() -> None:
        shard = current["shard"]
        with current["group"].recording():
            ranked(shard["h"].detach().requires_grad_(), cp_shard=shard["cp_shard"]).backward(shard["w"])

    row["rank_ms"] = _timed(rank_step, device, repeat, setup=new_batch)
    row["share_ms"] = row["unsharded_ms"] / cp
    row["x_share"] = row["rank_ms"] / row["share_ms"]
    row["status"] = "FAIL" if ratios[worst] > 1.0 else "PASS"
    return row


_HYBRID_COLUMNS = (
    Column("mixer", "kind", align="<"),
    Column("CUDA kernels", "kernels", align="<"),
    Column("unsharded ms", "unsharded_ms", ",.1f"),
    Column("share ms (1/cp)", "share_ms", ",.1f"),
    Column("rank ms", "rank_ms", ",.1f"),
    ratio_column("x_share", "x share"),
    Column("ours rel err (out / dx / dparams)", "ours_errors", align="<"),
    Column("bf16 layer's own", "torch_errors", align="<"),
    Column("worst / its limit", "worst", align="<"),
    STATUS,
)


def hybrid(device: torch.device) -> Section:
    from lightning_cp.doctor.mixers import MIXERS

    rows = []
    for kind, (_, _, packages) in MIXERS.items():
        missing = [p for p in packages if importlib.util.find_spec(p) is None]
        if len(missing) == len(packages):
            rows.append({"kind": kind, "status": f"SKIP: {', '.join(missing)} not installed"})
            continue
        try:
            row = mixer_rank(kind, device, torch.bfloat16, HYBRID_DOCUMENTS, HYBRID_CP, HYBRID_SIZES[kind])
        except Exception as error:  # noqa: BLE001  (one kind's failure is its row; the others still run)
            rows.append({"kind": kind, "status": f"FAIL: {type(error).__name__}: {error}"[:300]})
            continue
        rows.append(row)
    statuses = [row["status"].split(":")[0] for row in rows]
    status = "FAIL" if "FAIL" in statuses else "PASS" if "PASS" in statuses else "SKIP"
    summary = "; ".join(f"{row['kind']} {row['status']}" for row in rows)
    body = (
        f"One rank (rank 0) of cp {HYBRID_CP}, its peers simulated, forward + backward of one layer on "
        f"{len(HYBRID_DOCUMENTS)} packed documents of {HYBRID_DOCUMENTS[0]} tokens, bf16; unsharded: the layer on "
        "each document (the rows of a batch); share: its time / cp. Errors: every rank of the group together, "
        "and the layer itself in bf16, against the layer in fp32.\n\n"
        + format_table(rows, _HYBRID_COLUMNS, markdown=True)
    )
    return Section(status, summary, body)
