"""The sections of the GPU proof (``gpu_report.py``): what each runs, and its verdict.

Each section (:class:`SectionSpec`) is a function of the device that returns a :class:`Section`: ``PASS``,
``FAIL`` or ``SKIP`` with a one-line summary and a Markdown body, and what it needs: a section that needs CUDA
(or a package) and does not find it is a SKIP saying so, and runs nothing. ``gpu_report.py`` checks the needs,
then runs each section in a process of its own, under its time limit.

=============  ===========================================================================================
``gpu-tests``  ``pytest -m gpu``: the tests that need CUDA
``doctor``     ``lightning-cp doctor`` on the device
``loss``       ``loss_memory.py``: the fused loss against Liger and CCE (those installed) at 32K x 152K x 4K,
               bf16: time against the faster peer's (at most 0.95x), extra memory against each peer's (at
               most 1x), the chunk ours used
``attention``  CP attention's FlashAttention-2 varlen pieces against SDPA, bf16, cp 4, 16 heads / 4 KV heads
               x 128, padded and packed (``mixed``): one rank's forward + backward time against the ideal
               share (``attention.py``; at most 1.25x padded, 1.5x packed), and every rank's max error
               against SDPA's own (fp32 SDPA on the whole sequence as the reference)
``hybrid``     one CP rank (cp 4, simulated peers) of a Gated DeltaNet, a Mamba2 and a short-convolution layer
               with the CUDA kernels ``transformers`` finds (``fla``, ``causal-conv1d``, ``mamba-ssm``): time
               against the unsharded layer's share, every rank's error against the layer's own in bf16
``main-job``   ``lightning-cp fit --config examples/configs/gpu_single.yaml`` (200 steps of the long-range
               copy task on one GPU): finished, and ``val/loss`` below 1.0 (chance is 6.24)
=============  ===========================================================================================
"""

from __future__ import annotations

import copy
import importlib.util
import itertools
import math
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from _probes import MIB
from _report import CASE, STATUS, Column, format_table, ratio_column, shape_column

ROOT = Path(__file__).resolve().parents[1]
LOSS_PEERS = ("liger_flce", "cce")
LOSS_TIME_TARGET = 0.95
"""Ours' time at most this times the faster of Liger and CCE."""
LOSS_MEMORY_TARGET = 1.0
"""Ours' extra memory at most this times each peer's, measured on the same shape in the same run."""
ATTENTION_TARGETS = {"padded": 1.25, "mixed": 1.5}
"""Ours' time per rank at most this times the ideal share, per layout (``mixed``: packed documents)."""
ERROR_RATIO = 2.0
"""Ours' relative error at most this times PyTorch's own in the same dtype, plus the doctor's floor (its
rule, without its 1% cap: a bf16 Gated DeltaNet's own error is about 1%)."""
GPU_TEST_TIMEOUT_S = 90
"""A GPU test that runs longer fails (pytest-timeout, where installed) instead of eating the section's time."""
MAIN_JOB_LOSS = 1.0
"""The main job's final ``val/loss`` must be below this (chance: log 512 = 6.24)."""

Row = dict[str, Any]


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


# --------------------------------------------------------------------------------------------------
# gpu-tests, doctor: the package's own commands


_PYTEST_SUMMARY = re.compile(
    r"^=*\s*((?:\d+ (?:passed|failed|errors?|skipped|deselected)|no tests ran).*?)\s*=*$"
)


def pytest_verdict(returncode: int, output: str) -> Section:
    """The verdict of a ``pytest -q -rfE`` run from its exit status and output: its summary line and the
    tests that failed or errored."""
    lines = output.splitlines()
    summary = next((m.group(1) for line in reversed(lines) if (m := _PYTEST_SUMMARY.match(line))), None)
    failed = [line for line in lines if line.startswith(("FAILED ", "ERROR "))]
    if summary is None:
        return Section(
            "FAIL", f"pytest ended with status {returncode} and no summary", code_block(output, 40)
        )
    status = "PASS" if returncode == 0 else "FAIL"
    return Section(status, summary, code_block("\n".join([*failed, summary])))


def gpu_test_files() -> list[str]:
    """The test files that hold tests marked ``gpu`` (relative to the repository): only those are collected, so
    that a test module needing a package the GPU machine lacks cannot stop the run."""
    files = sorted((ROOT / "tests").rglob("test_*.py"))
    return [str(f.relative_to(ROOT)) for f in files if "pytest.mark.gpu" in f.read_text(encoding="utf-8")]


def gpu_tests(device: torch.device) -> Section:
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rfE", "-p", "no:cacheprovider"]
    command += ["-o", f"timeout={GPU_TEST_TIMEOUT_S}", "--continue-on-collection-errors", *gpu_test_files()]
    return pytest_verdict(*run_streamed(command))


_DOCTOR_SUMMARY = re.compile(r"^(\d+) passed, (\d+) failed, (\d+) skipped")


def doctor_verdict(returncode: int, output: str) -> Section:
    """The verdict of ``lightning-cp doctor`` from its exit status and output: its counts and FAIL lines."""
    counts = next((line for line in output.splitlines() if _DOCTOR_SUMMARY.match(line)), None)
    failed = [line.strip() for line in output.splitlines() if line.strip().startswith("FAIL ")]
    if counts is None:
        return Section(
            "FAIL", f"the doctor ended with status {returncode} and no summary", code_block(output, 40)
        )
    summary = counts + (f": {'; '.join(line.split('  ')[1] for line in failed)}" if failed else "")
    return Section("PASS" if returncode == 0 else "FAIL", summary, code_block(output))


def doctor(device: torch.device) -> Section:
    command = [sys.executable, "-m", "lightning_cp.cli", "doctor", "--device", device.type]
    return doctor_verdict(*run_streamed(command))


# --------------------------------------------------------------------------------------------------
# loss: ours against Liger and CCE


def add_loss_figures(rows: list[Row]) -> None:
    """TFLOP/s of every row; ours' time over the faster peer's and its extra memory over each peer's (the
    peers measured on the same shape in this run), against the targets."""
    for row in rows:
        flops = 6 * row["tokens"] * row["vocab"] * row["hidden"]
        row["tflops"] = flops / (row["time_ms"] * 1e-3) / 1e12 if row["status"].startswith("ok") else None
    for shape in {row["shape"] for row in rows}:
        same = [r for r in rows if r["shape"] == shape and r["status"].startswith("ok")]
        peers = {r["case"]: r for r in same if r["case"] in LOSS_PEERS}
        fastest = min((r["time_ms"] for r in peers.values()), default=None)
        for row in same:
            row["x_best_peer"] = row["time_ms"] / fastest if fastest else None
            if row["case"] != "ours_lce":
                continue
            row["time_target"] = verdict(row["x_best_peer"], LOSS_TIME_TARGET)
            for name, peer in peers.items():
                ratio = (
                    row["peak_extra_bytes"] / peer["peak_extra_bytes"] if peer["peak_extra_bytes"] else None
                )
                row[f"memory_x_{name}"] = verdict(ratio, LOSS_MEMORY_TARGET) if ratio else None


def targets_verdict(rows: Sequence[Row], ours: str, keys: Sequence[str], what: str) -> Section:
    """PASS when every ``ours`` row was measured and each of its target ``keys`` that has a verdict passes;
    FAIL naming the first miss; SKIP when no target could be judged (nothing to compare with)."""
    mine = [row for row in rows if row["case"] == ours]
    if not mine or any(not row["status"].startswith("ok") for row in mine):
        return Section("FAIL", f"{ours} was not measured: {mine[0]['status'] if mine else 'no row'}")
    verdicts = [(row["shape"], key, row[key]) for row in mine for key in keys if row.get(key)]
    missed = [f"{shape}: {key} {value}" for shape, key, value in verdicts if value.startswith("FAIL")]
    if missed:
        return Section("FAIL", f"{what}: {'; '.join(missed)}")
    if not verdicts:
        others = {row["case"]: row["status"] for row in rows if row["case"] != ours}
        why = "; ".join(f"{case}: {status}" for case, status in others.items())
        return Section("SKIP", f"nothing to compare {ours} with ({why})")
    return Section("PASS", f"{what}: {'; '.join(f'{key} {value}' for _, key, value in verdicts)}")


_LOSS_COLUMNS = (
    shape_column("N x V x H"),
    CASE,
    Column("time ms", "time_ms", ",.1f"),
    Column("TFLOP/s", "tflops", ",.1f"),
    Column("extra MiB", "peak_extra_bytes", ",.0f", scale=MIB),
    Column("chunk used", "chunk_used", ",.0f"),
    ratio_column("x_best_peer", "x faster peer"),
    Column(f"time (x peer <= {LOSS_TIME_TARGET})", "time_target", align="<"),
    *(
        Column(f"memory (x {peer} <= {LOSS_MEMORY_TARGET:g})", f"memory_x_{peer}", align="<")
        for peer in LOSS_PEERS
    ),
    STATUS,
)


LOSS_ARGUMENTS = (
    "--device cuda --dtype bf16 --tokens 32768 --vocab 151936 --hidden 4096 --repeat 3 --warmup 1"
)
"""``loss_memory.py``'s command line in the report (its cases: ``ours_lce`` and :data:`LOSS_PEERS`)."""


def loss(device: torch.device) -> Section:
    import loss_memory

    rows = loss_memory.main([*LOSS_ARGUMENTS.split(), "--cases", "ours_lce", *LOSS_PEERS])
    add_loss_figures(rows)
    keys = ["time_target", *(f"memory_x_{peer}" for peer in LOSS_PEERS)]
    result = targets_verdict(rows, "ours_lce", keys, "ours against the peers")
    notes = (
        f"`loss_memory.py {LOSS_ARGUMENTS}`: forward + backward of `mean CE(hidden @ weight.T, labels)` (10% of "
        "labels ignored) into both gradients, median of 3 after 1 warm-up. TFLOP/s counts 3 x 2NVH. Extra: the "
        "peak above the inputs, minus the two gradients. Chunk used: the tokens per chunk ours resolved in the "
        "run (on CUDA the automatic chunk follows the free memory). The targets compare ours with the peers "
        "measured here on the same shape."
    )
    table = format_table(rows, _LOSS_COLUMNS, markdown=True)
    return Section(result.status, result.summary, f"{table}\n\n{notes}")


# --------------------------------------------------------------------------------------------------
# attention: the FlashAttention-2 varlen pieces against SDPA


def attention_errors(
    device: torch.device,
    dtype: torch.dtype,
    lengths: Sequence[int],
    cp: int,
    heads: int,
    kv_heads: int,
    dim: int,
) -> list[Row]:
    """Every rank of a simulated CP group of ``cp`` (all-gather, every head at once) on one packed row of
    documents of ``lengths`` in ``dtype``, against SDPA on each whole document in fp32 on ``device``; PyTorch's
    own SDPA in ``dtype`` beside it. One row per quantity (out, dq, dk, dv): the max absolute and the relative
    error of ours and of SDPA, and ours' verdict (:func:`error_ratio` at most 1)."""
    from lightning_cp.doctor._compare import relative_error
    from lightning_cp.doctor._ranks import SimulatedRanks
    from lightning_cp.doctor.attention import attention_triples

    g = torch.Generator().manual_seed(0)
    total = sum(lengths)

    def randn(h: int) -> torch.Tensor:
        return torch.randn(1, h, total, dim, generator=g).to(device, dtype)

    q, k, v, grad_out = randn(heads), randn(kv_heads), randn(kv_heads), randn(heads)
    cu = torch.tensor([0, *itertools.accumulate(lengths)]) if len(lengths) > 1 else None  # one: padded
    triples, _ = attention_triples(
        SimulatedRanks(cp), device, (q, k, v, grad_out, cu), "allgather", reference=(torch.float32, device)
    )
    rows = []
    for quantity, (ours, reference, torchs) in triples.items():
        error, torch_error = relative_error(ours, reference), relative_error(torchs, reference)
        rows.append(
            {
                "quantity": quantity,
                "ours_max": float((ours.double() - reference.double()).abs().max()),
                "sdpa_max": float((torchs.double() - reference.double()).abs().max()),
                "ours_rel": error,
                "sdpa_rel": torch_error,
                "verdict": verdict(error_ratio(error, torch_error, dtype), 1.0),
            }
        )
    return rows


_ERROR_COLUMNS = (
    Column("layout, tokens, cp", "shape", align="<"),
    Column("quantity", "quantity", align="<"),
    Column("ours max abs err", "ours_max", ".2e"),
    Column("SDPA max abs err", "sdpa_max", ".2e"),
    Column("ours rel err", "ours_rel", ".2e"),
    Column("SDPA rel err", "sdpa_rel", ".2e"),
    Column("ours / its limit", "verdict", align="<"),
)
_TIME_COLUMNS = (
    shape_column("layout, tokens, cp"),
    CASE,
    Column("time ms", "time_ms", ",.2f"),
    Column("ideal share ms", "ideal_share_ms", ",.2f"),
    ratio_column("x_ideal", "x ideal"),
    Column("target (x ideal)", "target", align="<"),
    STATUS,
)
ATTENTION_SHAPE = {"tokens": 32768, "cp": 4, "heads": 16, "kv_heads": 4, "head_dim": 128}
"""The timed shape (the error check runs a quarter of the tokens: every rank of the group, and SDPA in fp32)."""


def attention(device: torch.device) -> Section:
    import attention as attention_benchmark

    from lightning_cp.doctor.attention import kernel_name

    tokens, cp, heads, kv_heads, dim = ATTENTION_SHAPE.values()
    kernel = kernel_name(torch.empty(1, 1, dim, dtype=torch.bfloat16, device=device))
    argv = f"--device cuda --dtype bf16 --tokens {tokens} --cp {cp} --heads {heads} --kv-heads {kv_heads} "
    argv += f"--head-dim {dim} --layouts padded mixed --cases ideal ours fa2 --repeat 3 --warmup 1"
    rows = attention_benchmark.main(argv.split())
    for row in rows:
        limit = ATTENTION_TARGETS.get(row["layout"])
        if row["case"] != "ideal" and limit is not None:
            row["target"] = verdict(row.get("x_ideal"), limit)
    errors = []
    for layout in ("padded", "mixed"):
        shape = attention_benchmark.Shape(tokens // 4, layout, cp, heads, kv_heads, dim)
        lengths = shape.document_lengths()
        errors += [
            {"shape": shape.label(), **row}
            for row in attention_errors(device, torch.bfloat16, lengths, cp, heads, kv_heads, dim)
        ]
    timed = targets_verdict(rows, "ours", ["target"], "time per rank")
    missed = [
        f"{e['shape']} {e['quantity']} {e['verdict']}" for e in errors if e["verdict"].startswith("FAIL")
    ]
    checked = f"error: {'; '.join(missed)}" if missed else "errors within their limits"
    status = "FAIL" if kernel != "flash-varlen" or missed or timed.status == "FAIL" else timed.status
    timing = (
        f"`attention.py {argv}`: one simulated rank (rank 0), forward + backward; ideal share: SDPA (flash) on "
        "the whole sequence / cp, per document when packed (`mixed`: random lengths). The package picks "
        f"`{kernel}` here."
    )
    accuracy = (
        "Every rank of the group on a quarter of the tokens against SDPA in fp32 on each whole document; ours' "
        f"relative error over its limit, {ERROR_RATIO:g}x SDPA's own bf16 error plus 1e-3 (at most 1 passes)."
    )
    body = [
        timing,
        format_table(rows, _TIME_COLUMNS, markdown=True),
        accuracy,
        format_table(errors, _ERROR_COLUMNS, markdown=True),
    ]
    return Section(status, f"kernel {kernel}; {timed.summary}; {checked}", "\n\n".join(body))


# --------------------------------------------------------------------------------------------------
# hybrid: one CP rank of a mixer layer with the CUDA kernels


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


# --------------------------------------------------------------------------------------------------
# main-job: the example that fits one GPU


MAIN_JOB_CONFIG = ROOT / "examples" / "configs" / "gpu_single.yaml"


def main_job_verdict(returncode: int, output: str, run_dir: Path) -> Section:
    """The verdict of ``lightning-cp fit`` from its exit status, its closing summary and the memory report it
    wrote under ``run_dir``."""
    lines = output.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("lightning-cp: training ")), None)
    closing = lines[start:] if start is not None else lines[-30:]
    match = re.search(r"^\s*val/loss:\s+([\d.]+|nan|inf)", "\n".join(closing), re.MULTILINE)
    val_loss = float(match.group(1)) if match else None
    finished = start is not None and lines[start].startswith("lightning-cp: training finished")
    memory = sorted(run_dir.glob("runs/*/csv/version_*/memory_snapshots/*.md"))
    body = code_block("\n".join(closing))
    if memory:
        body += f"\n\nMemory report of the run (`{memory[0].name}`):\n\n" + memory[0].read_text().strip()
    if returncode != 0 or not finished:
        return Section("FAIL", f"lightning-cp fit ended with status {returncode}, not finished", body)
    if val_loss is None or not math.isfinite(val_loss) or val_loss >= MAIN_JOB_LOSS:
        return Section("FAIL", f"finished, but val/loss {val_loss} is not below {MAIN_JOB_LOSS}", body)
    return Section("PASS", f"{lines[start].removeprefix('lightning-cp: ')}, val/loss {val_loss:.4f}", body)


def main_job(device: torch.device) -> Section:
    with tempfile.TemporaryDirectory(prefix="gpu_report_main_job_") as tmp:
        command = [sys.executable, "-m", "lightning_cp.cli", "fit", "--config", str(MAIN_JOB_CONFIG)]
        returncode, output = run_streamed([*command, "--ckpt_path", "null"], cwd=Path(tmp))
        return main_job_verdict(returncode, output, Path(tmp))


SECTIONS: dict[str, SectionSpec] = {
    "gpu-tests": SectionSpec(
        gpu_tests, needs_cuda("every test marked gpu skips without one", ("pytest", "pytest"))
    ),
    "doctor": SectionSpec(doctor),
    "loss": SectionSpec(loss, needs_cuda("Liger's and CCE's kernels run on CUDA only")),
    "attention": SectionSpec(
        attention, needs_cuda("FlashAttention-2 varlen (PyTorch's aten kernels) runs on CUDA only")
    ),
    "hybrid": SectionSpec(
        hybrid,
        needs_cuda(
            "the fla, causal-conv1d and mamba-ssm kernels run on CUDA only (the doctor checks the torch ones)",
            ("transformers", "transformers"),
        ),
    ),
    "main-job": SectionSpec(main_job, needs_cuda(f"{MAIN_JOB_CONFIG.relative_to(ROOT)} runs on one GPU")),
}
"""Every section, in the order the report runs them."""
