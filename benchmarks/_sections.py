"""The sections of the GPU proof (``gpu_report.py``): what each runs, and its verdict.

Each section (:class:`SectionSpec`) is a function of the device that returns a :class:`Section`: ``PASS``,
``FAIL`` or ``SKIP`` with a one-line summary and a Markdown body, and what it needs: a section that needs CUDA
(or a package) and does not find it is a SKIP saying so, and runs nothing. ``gpu_report.py`` checks the needs,
then runs each section in a process of its own, under its time limit.

=============  ===========================================================================================
``gpu-tests``  ``pytest -m gpu``: the tests that need CUDA
``doctor``     ``lightning-cp doctor`` on the device
``loss``       ``loss_memory.py`` on Qwen3-8B's head (32K x 152K x 4K, bf16): ours at the chunk the plan
               picks and at Liger's own, Liger and CCE side by side (``_loss_section``): time at the plan's
               chunk against the faster peer's (at most 1.5x), extra memory against the plan's budget for
               the loss at that chunk (at most 1.1x) and, at Liger's chunk, against Liger's (at most 1x);
               CCE's memory as a ratio
``attention``  CP attention's FlashAttention-2 varlen pieces against SDPA, bf16, cp 4, 16 heads / 4 KV heads
               x 128, padded and packed (``mixed``): one rank's forward + backward time against the ideal
               share (``attention.py``; at most 1.25x padded, 1.5x packed), and every rank's max error
               against SDPA's own (fp32 SDPA on the whole sequence as the reference)
``indexer``    the DSA indexer's top-k selection at GLM-5's indexer (32 heads x 128, top-2048) on 32K tokens,
               bf16, cp 1, by its Triton kernel and by its torch path (``_indexer_section``): the kernel's
               time against the scores' FLOPs at a bf16 ``torch.mm``'s rate (at most 3x), the share of
               query rows selecting the same keys on both paths (at least 0.99), the peak against the
               plan's ``indexer`` term as a ratio
``hybrid``     one CP rank (cp 4, simulated peers) of a Gated DeltaNet, a Mamba2 and a short-convolution layer
               with the CUDA kernels ``transformers`` finds (``fla``, ``causal-conv1d``, ``mamba-ssm``): time
               against the unsharded layer's share, every rank's error against the layer's own in bf16
``layers``     one decoder layer of Llama-3.1-8B per layout the plan picks at 1M tokens on 1 and on 8 GPUs
               (one CP rank, simulated peers, the layout's checkpointing, offload and tiling; at most 128K
               tokens per rank: ``_layer_section``): ``torch.cuda.max_memory_allocated`` against the plan's
               per-layer term at those tokens (at most 1.1x)
``main-job``   ``lightning-cp fit --config examples/configs/gpu_single.yaml`` (200 steps of the long-range
               copy task on one GPU): finished, and ``val/loss`` below 1.0 (chance is 6.24)
=============  ===========================================================================================
"""

from __future__ import annotations

import itertools
import math
import re
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from _hybrid_section import hybrid
from _indexer_section import indexer
from _layer_section import layers
from _loss_section import loss
from _report import CASE, STATUS, Column, format_table, ratio_column, shape_column
from _section_base import (
    ERROR_RATIO,
    ROOT,
    Row,
    Section,
    SectionSpec,
    code_block,
    error_ratio,
    needs_cuda,
    run_streamed,
    targets_verdict,
    verdict,
)

ATTENTION_TARGETS = {"padded": 1.25, "mixed": 1.5}
"""Ours' time per rank at most this times the ideal share, per layout (``mixed``: packed documents)."""
GPU_TEST_TIMEOUT_S = 90
"""A GPU test that runs longer fails (pytest-timeout, where installed) instead of eating the section's time."""
MAIN_JOB_LOSS = 1.0
"""The main job's final ``val/loss`` must be below this (chance: log 512 = 6.24)."""


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
    timed = targets_verdict(rows, ("ours",), ["target"], "time per rank")
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
    "indexer": SectionSpec(indexer, needs_cuda("the Triton kernel runs on CUDA only", ("triton", "triton"))),
    "hybrid": SectionSpec(
        hybrid,
        needs_cuda(
            "the fla, causal-conv1d and mamba-ssm kernels run on CUDA only (the doctor checks the torch ones)",
            ("transformers", "transformers"),
        ),
    ),
    "layers": SectionSpec(
        layers, needs_cuda("torch.cuda.max_memory_allocated is the measure", ("transformers", "transformers"))
    ),
    "main-job": SectionSpec(main_job, needs_cuda(f"{MAIN_JOB_CONFIG.relative_to(ROOT)} runs on one GPU")),
}
"""Every section, in the order the report runs them."""
