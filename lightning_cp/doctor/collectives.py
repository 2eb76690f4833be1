"""Checks of the real collectives, when the doctor runs on several processes (``torchrun``).

Every rank joins the default process group (NCCL on CUDA, gloo on the CPU), builds Megatron-core's groups
as the strategy does, with all ranks in one CP group, and checks: a sum over the world; the all-gather and
the reduce-scatter of :class:`~lightning_cp.parallel.attention.GroupExchange`; and
:func:`~lightning_cp.parallel.context_parallel_attention` across the group, padded and packed, against
SDPA on the whole sequence (each rank compares its own shard). A collective that never completes ends
after the process group's timeout instead of hanging.
"""

from __future__ import annotations

import itertools
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_cp.doctor._compare import CheckResult, compare, run_check
from lightning_cp.doctor.attention import LAYOUTS, attention_inputs, kernel_name, sdpa_reference
from lightning_cp.parallel import context_parallel_attention, groups, shard_batch
from lightning_cp.parallel.exchange import GroupExchange
from lightning_cp.parallel.layout import ProcessGroup

TIMEOUT = timedelta(minutes=2)
"""How long a collective may wait for its peers before the process group gives up."""


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
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=TIMEOUT)
    return True


def collective_checks(device: torch.device, dtypes: tuple[torch.dtype, ...]) -> list[CheckResult]:
    """This rank's results; every rank of the initialized default group must call it (collectives)."""
    world = dist.get_world_size()
    results = [run_check(f"process group {dist.get_backend()} world={world}", _check_sum, device)]
    layout = groups.initialize(tp=1, cp=world)
    try:
        exchange = GroupExchange(layout.cp_group)
        results.append(run_check("exchange all_gather", _check_all_gather, exchange, device))
        results.append(run_check("exchange reduce_scatter", _check_reduce_scatter, exchange, device))
        for dtype, name in itertools.product(dtypes, LAYOUTS):
            check = f"attention cp={world} {name} gqa {str(dtype).removeprefix('torch.')} across the group"
            results.append(run_check(check, _check_attention, layout.cp_group, device, dtype, name))
    finally:
        groups.destroy()
    return results


def gather_results(results: list[CheckResult]) -> list[list[CheckResult]]:
    """Every rank's results, in rank order (on every rank)."""
    gathered: list[list[CheckResult] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    return [ranks or [] for ranks in gathered]


def _check_sum(name: str, device: torch.device) -> CheckResult:
    world, rank = dist.get_world_size(), dist.get_rank()
    total = torch.tensor([float(rank + 1)], device=device)
    dist.all_reduce(total)
    expected = world * (world + 1) / 2
    status = "PASS" if total.item() == expected else "FAIL"
    detail = f"sum of rank + 1 over the world: {total.item():g} (expected {expected:g}), this is rank {rank}"
    return CheckResult(name, status, detail)


def _rank_block(rank: int, rows: int, device: torch.device) -> Tensor:
    """``[rows, 2, 3]`` values that say which rank and row they come from (exact in fp32)."""
    return (torch.arange(rows * 6, dtype=torch.float32, device=device) + 1000 * rank).view(rows, 2, 3)


def _check_all_gather(name: str, exchange: GroupExchange, device: torch.device) -> CheckResult:
    world, rank, rows = dist.get_world_size(), dist.get_rank(), 5
    gathered = exchange.all_gather(_rank_block(rank, rows, device))
    expected = torch.cat([_rank_block(r, rows, device) for r in range(world)])
    ok = gathered.shape == expected.shape and torch.equal(gathered, expected)
    return CheckResult(name, "PASS" if ok else "FAIL", f"{world} x [{rows}, 2, 3] fp32")


def _check_reduce_scatter(name: str, exchange: GroupExchange, device: torch.device) -> CheckResult:
    world, rank, rows = dist.get_world_size(), dist.get_rank(), 5
    base = _rank_block(0, world * rows, device)
    local = exchange.reduce_scatter((rank + 1) * base)
    expected = world * (world + 1) / 2 * base[rank * rows : (rank + 1) * rows]
    ok = local.shape == expected.shape and torch.equal(local, expected)
    return CheckResult(name, "PASS" if ok else "FAIL", f"[{world * rows}, 2, 3] fp32")


def _shard(
    tensors: dict[str, Tensor], cu: Tensor | None, cp: int, rank: int, group: ProcessGroup | None = None
) -> dict:
    """This rank's shard of ``[B, H, S, D]`` tensors (as ``[B, H, S_local, D]``), with the batch's layout."""
    first = next(iter(tensors.values()))
    batch: dict = {
        "input_ids": torch.zeros(first.shape[0], first.shape[2], dtype=torch.long, device=first.device)
    }
    batch.update({name: t.transpose(1, 2) for name, t in tensors.items()})
    if cu is not None:
        batch["cu_seqlens"] = cu
    shard = shard_batch(batch, cp, rank, cp_group=group)
    return {**shard, **{name: shard[name].transpose(1, 2).contiguous() for name in tensors}}


def _check_attention(
    name: str, group: ProcessGroup, device: torch.device, dtype: torch.dtype, layout: str
) -> CheckResult:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    q, k, v, grad_out, cu = attention_inputs(layout, dtype)
    quantities = ("out", "dq", "dk", "dv")
    reference = sdpa_reference(*(t.double() for t in (q, k, v, grad_out)), cu)
    torchs = sdpa_reference(*(t.to(device) for t in (q, k, v, grad_out)), cu)
    expected = {f"ref_{n}": t for n, t in zip(quantities, reference)}
    expected.update({f"torch_{n}": t.cpu().double() for n, t in zip(quantities, torchs)})
    expected = _shard(expected, cu, world, rank)
    mine = _shard({n: t.to(device) for n, t in zip("qkvg", (q, k, v, grad_out))}, cu, world, rank, group)
    lq, lk, lv = (mine[n].requires_grad_() for n in "qkv")
    out = context_parallel_attention(lq, lk, lv, cp_shard=mine["cp_shard"])
    out.backward(mine["g"])
    valid = expected["input_mask"].bool()  # [B, S_local]: padding added by the split is not compared

    def tokens(t: Tensor) -> Tensor:  # [B, H, S_local, D] -> the valid tokens' [n, H, D]
        return t.transpose(1, 2).cpu()[valid]

    ours = (out.detach(), lq.grad, lk.grad, lv.grad)
    compared = {
        n: (tokens(o), tokens(expected[f"ref_{n}"]), tokens(expected[f"torch_{n}"]))
        for n, o in zip(quantities, ours)
    }
    return compare(name, dtype, compared, f"[{kernel_name(lq)}], rank {rank}")
