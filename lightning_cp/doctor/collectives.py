"""Checks of the real collectives, when the doctor runs on several processes (``torchrun``).

Every rank joins the default process group (NCCL on CUDA, gloo on the CPU) and checks, with all ranks in
one CP group: a sum over the world; Megatron-core's groups as the strategy builds them; the all-gather and
the reduce-scatter of :class:`~lightning_cp.parallel.exchange.GroupExchange`;
:func:`~lightning_cp.parallel.context_parallel_attention` in each of its exchanges (all-gather, all-gather in
rounds, Ulysses), padded and packed, against SDPA on the whole sequence; and the hybrid mixers' head-parallel
exchange against the layer on each document. Each rank compares its own shard
(:class:`~lightning_cp.doctor._ranks.GroupRanks`). On CUDA, the exchange over a group of ``cpu_offload``'s
backend (:data:`MIXED_BACKEND`: gloo for the host shards beside NCCL): the K/V all-gather and reduce-scatter
on CUDA tensors, which must reduce-scatter through NCCL (an all-reduce moves twice the bytes), and the ranks'
agreement on CPU tensors, through gloo; elsewhere that check is a SKIP.

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

from lightning_cp.doctor._compare import CheckResult, dtype_name, run_check
from lightning_cp.doctor._ranks import GroupRanks
from lightning_cp.doctor.attention import LAYOUTS, MODES, check_attention
from lightning_cp.doctor.mixers import NO_TRANSFORMERS, check_mixer, mixer_names, split_problem
from lightning_cp.parallel import groups
from lightning_cp.parallel.exchange import GroupExchange

TIMEOUT = timedelta(minutes=2)
"""How long a collective of the default group (joining it, gathering the verdicts) may wait for its peers."""
CHECK_TIMEOUT = timedelta(minutes=1)
"""How long a collective of one check may wait for its peers before the check fails on that rank."""
MIXED_BACKEND = "cpu:gloo,cuda:nccl"
"""The backend of the process groups under ``cpu_offload`` (``MegatronCPFSDPStrategy``): NCCL for CUDA
tensors, gloo for the host shards' collectives."""
MIXED_CHECK = f"exchange on {MIXED_BACKEND} (cpu_offload)"
"""The name of the check of :data:`MIXED_BACKEND`'s groups."""


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
        name = f"attention {mode} cp={world} {layout} gqa {dtype_name(dtype)} across the group"
        results.append(in_step(name, check_attention, device, dtype, layout, mode))
    for kind, name in mixer_names(world).items():
        name = f"{name} across the group"
        skip = (
            NO_TRANSFORMERS
            if importlib.util.find_spec("transformers") is None
            else split_problem(kind, world)
        )
        results.append(CheckResult(name, "SKIP", skip) if skip else in_step(name, check_mixer, device, kind))
    if device.type == "cuda":
        backends = device_backends(MIXED_BACKEND)
        results.append(in_step(MIXED_CHECK, check_backends, device, backends, backend=MIXED_BACKEND))
    else:
        reason = f"needs CUDA ranks (the group's NCCL half moves CUDA tensors); these run on {device.type}"
        results.append(CheckResult(MIXED_CHECK, "SKIP", reason))
    return results


def in_step(
    name: str, check: Callable[..., CheckResult], device: torch.device, *args: Any, backend: str | None = None
) -> CheckResult:
    """``check(name, ranks, device, *args)`` on a process group of its own over every rank, of ``backend``
    (``None``: the default group's) (see the module docstring); its result, or a FAIL with the exception. Every
    rank must call it, in the same order."""
    group = dist.new_group(list(range(dist.get_world_size())), timeout=CHECK_TIMEOUT, backend=backend)
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


def device_backends(backend: str) -> dict[str, str]:
    """``{"cpu": "gloo", "cuda": "nccl"}`` for ``"cpu:gloo,cuda:nccl"``: the backend a group created with
    ``backend`` uses for each device type (read here from the string itself, not from ``torch``)."""
    return dict(pair.split(":") for pair in backend.split(","))


def check_backends(
    name: str, ranks: GroupRanks, device: torch.device, backends: dict[str, str]
) -> CheckResult:
    """The exchange over ``ranks``' group, whose backend for each device type is ``backends``: the K/V
    all-gather and reduce-scatter on ``device`` tensors against the rank blocks and their sum, and the
    agreement of the ranks (:meth:`GroupExchange.agree_min`) on the host. A FAIL also where ``device``'s
    backend is NCCL and the reduce-scatter was an all-reduce (seen as its input summed in place): twice the
    bytes, what the exchange did on ``cpu_offload``'s groups before it read their backend per device."""
    exchange, world, rows = GroupExchange(ranks.group), ranks.cp, 5
    rank, backend = ranks.ranks[0], backends.get(device.type)
    base = _rank_block(0, world * rows, device)
    full = (rank + 1) * base
    sent = full.clone()
    ((gathered, local, agreed),) = ranks.run(
        lambda r: (
            exchange.all_gather(_rank_block(r, rows, device)),
            exchange.reduce_scatter(full),
            exchange.agree_min(10 + r),
        )
    )
    collective = "reduce-scatter" if torch.equal(full, sent) else "all-reduce"
    summed = world * (world + 1) / 2 * base[rank * rows : (rank + 1) * rows]
    doubled = backend == "nccl" and collective == "all-reduce"  # twice the bytes of NCCL's reduce-scatter
    checked = {
        "all-gather": torch.equal(gathered, torch.cat([_rank_block(r, rows, device) for r in range(world)])),
        "reduce-scatter's sum": torch.equal(local, summed),
        "agreement": agreed == 10,
        f"all-reduce where the {device.type} backend is nccl": not doubled,
    }
    wrong = [what for what, ok in checked.items() if not ok]
    detail = f"{device.type} ({backend}): all-gather, {collective}; "
    detail += f"agreement on cpu ({backends.get('cpu')}): min {agreed}"
    if wrong:
        return CheckResult(name, "FAIL", f"wrong: {', '.join(wrong)}; {detail}")
    return CheckResult(name, "PASS", detail)
