"""Checks of the real collectives, when the doctor runs on several processes (``torchrun``).

Every rank joins the default process group (NCCL on CUDA, gloo on the CPU) and checks, with all ranks in
one CP group: a sum over the world; Megatron-core's groups as the strategy builds them; the all-gather and
the reduce-scatter of :class:`~lightning_cp.parallel.exchange.GroupExchange`;
:func:`~lightning_cp.parallel.context_parallel_attention` in each of its exchanges (all-gather, all-gather in
rounds, Ulysses), padded and packed, against SDPA on the whole sequence; and the hybrid mixers' head-parallel
exchange against the layer on each document. Each rank compares its own shard
(:class:`~lightning_cp.doctor._ranks.GroupRanks`).

The ranks stay in step whatever one of them does. Every check runs on a process group of its own, made for it
by every rank in the same order: a rank that fails before its check's collectives tells the others, which
then fail that check at once; one that fails in the middle leaves its peers waiting on that group only, until
its timeout (:data:`CHECK_TIMEOUT`) fails their check too, and the next check starts on a fresh group that
every rank joins. On CUDA, ``TORCH_NCCL_BLOCKING_WAIT=1`` (unless set) makes such a timeout an exception
rather than an abort of the process.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_cp.doctor._compare import CheckResult, run_check
from lightning_cp.doctor._ranks import GroupRanks
from lightning_cp.doctor.attention import LAYOUTS, MODES, check_attention
from lightning_cp.doctor.mixers import NO_TRANSFORMERS, check_mixer, mixer_names, split_problem
from lightning_cp.parallel import groups

TIMEOUT = timedelta(minutes=2)
"""How long a collective of the default group (joining it, gathering the verdicts) may wait for its peers."""
CHECK_TIMEOUT = timedelta(minutes=1)
"""How long a collective of one check may wait for its peers before the check fails on that rank."""


def launched_distributed() -> bool:
    """Whether this process is one of several started by a launcher (``WORLD_SIZE > 1``, as torchrun sets)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def local_device(device_type: str) -> torch.device:
    """This process's device: ``cuda:LOCAL_RANK`` (made the current device), or the CPU."""
    if device_type != "cuda":
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    return device


def init_process_group(device: torch.device) -> bool:
    """Join the default process group from the launcher's environment (NCCL for CUDA, gloo for the CPU),
    unless this process is in one already; whether it was created here."""
    if dist.is_initialized():
        return False
    if device.type == "cuda":
        os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=TIMEOUT)
    return True


def collective_checks(device: torch.device, dtypes: tuple[torch.dtype, ...]) -> list[CheckResult]:
    """This rank's results; every rank of the initialized default group must call it (collectives)."""
    world = dist.get_world_size()
    results = [
        in_step(f"process group {dist.get_backend()} world={world}", _check_sum, device),
        run_check(f"megatron groups tp=1 cp={world}", _check_megatron),
        in_step("exchange all_gather", _check_all_gather, device),
        in_step("exchange reduce_scatter", _check_reduce_scatter, device),
    ]
    for dtype, mode, layout in itertools.product(dtypes, MODES, LAYOUTS):
        name = (
            f"attention {mode} cp={world} {layout} gqa {str(dtype).removeprefix('torch.')} across the group"
        )
        results.append(in_step(name, check_attention, device, dtype, layout, mode))
    for kind, name in mixer_names(world).items():
        name = f"{name} across the group"
        skip = (
            NO_TRANSFORMERS
            if importlib.util.find_spec("transformers") is None
            else split_problem(kind, world)
        )
        results.append(CheckResult(name, "SKIP", skip) if skip else in_step(name, check_mixer, device, kind))
    return results


def in_step(name: str, check: Callable[..., CheckResult], device: torch.device, *args: Any) -> CheckResult:
    """``check(name, ranks, device, *args)`` on a process group of its own over every rank (see the module
    docstring); its result, or a FAIL with the exception. Every rank must call it, in the same order."""
    group = dist.new_group(list(range(dist.get_world_size())), timeout=CHECK_TIMEOUT)
    try:
        ranks = GroupRanks(group, device)
        result = run_check(name, check, ranks, device, *args)
        if not ranks.agreed:  # this rank failed before its exchanges: the others wait to hear it
            with contextlib.suppress(RuntimeError):  # its own failure is its result already
                ranks.agree(False)
        return result
    finally:
        dist.destroy_process_group(group)


def gather_results(results: list[CheckResult]) -> list[list[CheckResult]]:
    """Every rank's results, in rank order (on every rank)."""
    gathered: list[list[CheckResult] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    return [ranks or [] for ranks in gathered]


def _check_sum(name: str, ranks: GroupRanks, device: torch.device) -> CheckResult:
    rank = ranks.ranks[0]
    (total,) = ranks.run(lambda r: ranks.sum([torch.tensor([float(r + 1)], device=device)]))
    expected = ranks.cp * (ranks.cp + 1) / 2
    status = "PASS" if total.item() == expected else "FAIL"
    detail = f"sum of rank + 1 over the world: {total.item():g} (expected {expected:g}), this is rank {rank}"
    return CheckResult(name, status, detail)


def _check_megatron(name: str) -> CheckResult:
    world, rank = dist.get_world_size(), dist.get_rank()
    layout = groups.initialize(tp=1, cp=world)
    try:
        got = (layout.cp, layout.cp_rank, dist.get_world_size(layout.cp_group))
    finally:
        groups.destroy()
    ok = got == (world, rank, world)
    return CheckResult(
        name, "PASS" if ok else "FAIL", f"cp, cp_rank, CP group size: {got}, this is rank {rank}"
    )


def _rank_block(rank: int, rows: int, device: torch.device) -> Tensor:
    """``[rows, 2, 3]`` values that say which rank and row they come from (exact in fp32)."""
    return (torch.arange(rows * 6, dtype=torch.float32, device=device) + 1000 * rank).view(rows, 2, 3)


def _check_all_gather(name: str, ranks: GroupRanks, device: torch.device) -> CheckResult:
    world, rows = ranks.cp, 5
    (gathered,) = ranks.run(lambda r: ranks.exchange(r).all_gather(_rank_block(r, rows, device)))
    expected = torch.cat([_rank_block(r, rows, device) for r in range(world)])
    ok = gathered.shape == expected.shape and torch.equal(gathered, expected)
    return CheckResult(name, "PASS" if ok else "FAIL", f"{world} x [{rows}, 2, 3] fp32")


def _check_reduce_scatter(name: str, ranks: GroupRanks, device: torch.device) -> CheckResult:
    world, rank, rows = ranks.cp, ranks.ranks[0], 5
    base = _rank_block(0, world * rows, device)
    (local,) = ranks.run(lambda r: ranks.exchange(r).reduce_scatter((r + 1) * base))
    expected = world * (world + 1) / 2 * base[rank * rows : (rank + 1) * rows]
    ok = local.shape == expected.shape and torch.equal(local, expected)
    return CheckResult(name, "PASS" if ok else "FAIL", f"[{world * rows}, 2, 3] fp32")
