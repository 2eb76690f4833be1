"""Check that lightning-cp computes exactly on this machine, and show the kernels it picks.

Run::

    lightning-cp doctor                      # the first GPU, or the CPU without one (seconds)
    lightning-cp doctor --device cpu         # the CPU paths, also on a GPU machine
    torchrun --nproc-per-node 8 --no-python lightning-cp doctor    # also the collectives over 8 GPUs

It prints the versions (Python, torch with CUDA / cuDNN / NCCL, Triton, transformers, Megatron-core,
Lightning), the flash-attention kernels torch and the installed packages offer, the devices, and which
kernels the package itself picks on the device (CP attention per dtype, the fused loss's backend and this
process's automatic chunk). Then one line per self-check, ``PASS``, ``FAIL <error>`` or ``SKIP <why>``
(:mod:`lightning_cp.doctor`): CP attention of simulated groups of 2 and 4 ranks in each of its exchanges
(all-gather, all-gather in rounds, Ulysses) against SDPA on the whole sequence, and with fp32 inputs under bf16
autocast; a sparse attention layer (the indexer's top-k keys and the attention over them) of a simulated group
of 4 against the dense selection on each document; the hybrid mixers (Gated DeltaNet, Mamba2, short
convolution) of a simulated group of 4 against the layer on each document; the fused loss and log-probabilities
against plain PyTorch, in fp32 and bf16, and under bf16 autocast with the dtype every matmul ran in, the Triton
backend on CUDA; a GPT tiled in tiles shorter than its sequences against the untiled one. Under ``torchrun``
every rank runs every check, and the real collectives too (on CUDA, over ``cpu_offload``'s
``cpu:gloo,cuda:nccl`` groups as well), each check on a process group of its own so that one rank's failure
never leaves the others out of step; the verdicts are gathered, rank 0 prints its lines and every other rank's
failures, and every rank prints its verdict line. The exit status is 1 when a check failed on any rank, else 0,
the same on every rank.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_cp.doctor import CheckResult, collectives, environment
from lightning_cp.doctor._compare import error_line
from lightning_cp.doctor.attention import attention_checks, autocast_attention_checks
from lightning_cp.doctor.loss import autocast_loss_checks, loss_checks
from lightning_cp.doctor.mixers import mixer_checks
from lightning_cp.doctor.sparse import sparse_checks
from lightning_cp.doctor.tiling import tiling_checks

DTYPES = (torch.float32, torch.bfloat16)
"""The dtypes the attention and loss checks run in."""


def main(argv: Sequence[str] | None = None) -> int:
    """``lightning-cp doctor [--device auto|cpu|cuda]``; returns the exit status (1: a check failed on a rank)."""
    parser = _parser()
    args = parser.parse_args(argv)
    distributed = collectives.launched_distributed()
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here; use --device cpu")
    created_group = False
    if distributed:
        device = collectives.local_device("cuda" if use_cuda else "cpu")
        created_group = collectives.init_process_group(device)
    else:
        device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    rank = dist.get_rank() if distributed else None
    try:
        results = _print_environment(device, rank) if not rank else []
        results += _local_checks(device)
        if distributed:
            results += _guarded("collectives", collectives.collective_checks, device, DTYPES)
            per_rank = collectives.gather_results(results)
        else:
            hint = "torchrun --nproc-per-node N --no-python lightning-cp doctor"
            results.append(CheckResult("collectives", "SKIP", f"one process; run `{hint}`"))
            results.append(
                CheckResult(collectives.MIXED_CHECK, "SKIP", f"one process; on CUDA GPUs run `{hint}`")
            )
            per_rank = [results]
    finally:
        if created_group:
            dist.destroy_process_group()
    status = 1 if any(r.status == "FAIL" for ranks in per_rank for r in ranks) else 0
    if not rank:
        _print_results(per_rank)
    if distributed:
        mine = per_rank[rank]
        failed = sum(r.status == "FAIL" for r in mine)
        print(
            f"rank {rank} of {len(per_rank)}: {failed} of its {len(mine)} checks failed; exit status {status}"
        )
    return status


def _local_checks(device: torch.device) -> list[CheckResult]:
    """The checks of this process alone (simulated CP ranks), in the order they are printed."""
    return (
        attention_checks(device, DTYPES)
        + autocast_attention_checks(device)
        + sparse_checks(device, DTYPES)
        + mixer_checks(device)
        + loss_checks(device, DTYPES)
        + autocast_loss_checks(device)
        + tiling_checks(device)
    )


def _guarded(name: str, checks: Callable[..., list[CheckResult]], *args: Any) -> list[CheckResult]:
    """``checks(*args)``, or one FAIL line named ``name`` with what it raised outside its own checks."""
    try:
        return checks(*args)
    except Exception as error:  # noqa: BLE001  (this rank still reports, and still joins the gathering)
        return [CheckResult(name, "FAIL", error_line(error))]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-cp doctor",
        description=__doc__.split("\n\n")[0],
        epilog="Under torchrun every rank uses cuda:LOCAL_RANK (or the CPU with gloo).",
    )
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where the checks run (default: auto, the current CUDA device when there is one)",
    )
    return parser


def _print_section(title: str, lines: environment.Section) -> None:
    width = max(len(key) for key, _ in lines) + 2
    print(title)
    for key, value in lines:
        print(f"  {key:{width}}{value}")


def _print_environment(device: torch.device, rank: int | None) -> list[CheckResult]:
    """Print the machine's sections; a FAIL line for a section that could not be read (nothing otherwise)."""
    print(f"lightning-cp doctor on {device}\n")
    sections = (
        ("versions", environment.versions),
        ("attention kernels", environment.attention_kernels),
        ("devices", lambda: environment.devices(device)),
        (f"kernels the package picks on {device}", lambda: environment.selection(device, DTYPES, rank)),
    )
    failed = []
    for title, lines in sections:
        try:
            _print_section(title, lines())
        except Exception as error:  # noqa: BLE001  (the checks still run, and this rank still reports)
            failed.append(CheckResult(f"environment: {title}", "FAIL", error_line(error)))
    print(f"\nchecks on {device}", flush=True)
    return failed


def _print_results(per_rank: list[list[CheckResult]]) -> None:
    for result in per_rank[0]:
        print(f"  {result.line()}")
    for rank, results in enumerate(per_rank[1:], start=1):
        for result in results:
            if result.status == "FAIL":
                print(f"  rank {rank}: {result.line()}")
    counts = {
        status: sum(r.status == status for rank in per_rank for r in rank)
        for status in ("PASS", "FAIL", "SKIP")
    }
    ranks = f" over {len(per_rank)} ranks" if len(per_rank) > 1 else ""
    print(f"\n{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped{ranks}", flush=True)
