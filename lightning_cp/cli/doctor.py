"""Check that lightning-cp computes exactly on this machine, and show the kernels it picks.

Run::

    lightning-cp doctor                      # the first GPU, or the CPU without one (a few seconds)
    lightning-cp doctor --device cpu         # the CPU paths, also on a GPU machine
    torchrun --nproc-per-node 8 --no-python lightning-cp doctor    # also the collectives over 8 GPUs

It prints the versions (Python, torch with CUDA / cuDNN / NCCL, Triton, transformers, Megatron-core,
Lightning), the flash-attention kernels torch and the installed packages offer, the devices, and which
kernels the package itself picks on the device (CP attention per dtype, the fused loss's backend and
chunk). Then one line per self-check, ``PASS``, ``FAIL <error>`` or ``SKIP <why>``
(:mod:`lightning_cp.doctor`): CP attention of simulated groups of 2 and 4 ranks against SDPA on the
whole sequence, the fused loss and log-probabilities against plain PyTorch, in fp32 and bf16, the Triton
backend on CUDA; under ``torchrun``, the real collectives too (every rank runs every check; rank 0
prints its own lines and any other rank's failures). The exit status is 1 when a check fails, else 0.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch
import torch.distributed as dist

from lightning_cp.doctor import CheckResult, collectives, environment
from lightning_cp.doctor.attention import attention_checks
from lightning_cp.doctor.loss import loss_checks

DTYPES = (torch.float32, torch.bfloat16)
"""The dtypes every numerical check runs in."""


def main(argv: Sequence[str] | None = None) -> int:
    """``lightning-cp doctor [--device auto|cpu|cuda]``; returns the exit status (1: a check failed)."""
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
    lead = not distributed or dist.get_rank() == 0
    try:
        if lead:
            _print_environment(device)
        results = attention_checks(device, DTYPES) + loss_checks(device, DTYPES)
        if distributed:
            per_rank = collectives.gather_results(results + collectives.collective_checks(device, DTYPES))
        else:
            hint = "torchrun --nproc-per-node N --no-python lightning-cp doctor"
            per_rank = [[*results, CheckResult("collectives", "SKIP", f"one process; run `{hint}`")]]
    finally:
        if created_group:
            dist.destroy_process_group()
    if lead:
        _print_results(per_rank)
    return 1 if any(r.status == "FAIL" for rank in per_rank for r in rank) else 0


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


def _print_environment(device: torch.device) -> None:
    print(f"lightning-cp doctor on {device}\n")
    _print_section("versions", environment.versions())
    _print_section("attention kernels", environment.attention_kernels())
    _print_section("devices", environment.devices(device))
    _print_section(f"kernels the package picks on {device}", environment.selection(device, DTYPES))
    print(f"\nchecks on {device}", flush=True)


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
