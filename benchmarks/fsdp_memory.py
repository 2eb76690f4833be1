"""Per-rank bytes of parameters, gradients and AdamW state: DDP vs FSDP over DP x CP, on the package GPT.

Spawns ``--world`` gloo processes on the CPU. For each (dp, cp) layout and each of DDP and
``MegatronCPFSDPStrategy``'s sharding (the same ``fully_shard`` units and root), it builds the GPT,
takes one AdamW step on random tokens, and counts on every rank the bytes of the tensors it holds:
parameters (the local shard under FSDP), their gradients and the optimizer state. The ideal is DDP's
bytes divided by ``dp * cp``; FSDP's excess over it is the padding of uneven shards. Activations and the
transient unsharded unit FSDP gathers are not counted (they are per step, not per parameter).

Run from the repository root::

    python benchmarks/fsdp_memory.py                # n_layer 8, n_embd 512, vocab 32768: ~42M parameters
    python benchmarks/fsdp_memory.py --n-layer 2 --n-embd 64 --vocab 512 --layouts 2x2
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import Column, format_table

MIB = 2**20
COLUMNS = [
    Column("dp x cp", "layout", align="<"),
    Column("wrapper", "wrapper", align="<"),
    Column("params MiB", "params", ".1f", MIB),
    Column("grads MiB", "grads", ".1f", MIB),
    Column("AdamW MiB", "optimizer", ".1f", MIB),
    Column("total MiB", "total", ".1f", MIB),
    Column("x DDP", "ratio", ".3f"),
    Column("ideal 1/(dp*cp)", "ideal", ".3f"),
]


def _local_bytes(tensor: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def _measure(config: Any, cp: int, fsdp: bool) -> dict[str, int]:
    """One AdamW step of the GPT under DDP or FSDP over DP x CP; this rank's bytes by category."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from lightning_cp.models import GPT
    from lightning_cp.parallel import groups
    from lightning_cp.strategies import _fsdp
    from lightning_cp.strategies._modules import default_layer_classes, resolve_classes

    layout = groups.initialize(tp=1, cp=cp)
    torch.manual_seed(0)
    model = GPT(config)
    if fsdp:
        units = resolve_classes("MegatronCPFSDPStrategy", "fsdp_wrap", default_layer_classes(model), model)
        wrapped = _fsdp.shard(
            model,
            _fsdp.sharding_mesh(layout.loss_group, "cpu"),
            units,
            _fsdp.mixed_precision_policy("32-true"),
        )
    else:
        wrapped = DistributedDataParallel(model, process_group=layout.loss_group)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(layout.rank))
    hidden = wrapped(ids, torch.arange(64)[None])
    (hidden.float().pow(2).mean() + model.lm_head_weight.sum() * 0).backward()
    optimizer.step()
    params = list(model.parameters())
    result = {
        "params": sum(_local_bytes(p) for p in params),
        "grads": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(
            _local_bytes(value)
            for state in optimizer.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor) and value.dim() > 0
        ),
    }
    dist.barrier()
    groups.destroy()
    return result


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    from lightning_cp.models import GPTConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    config = GPTConfig(vocab_size=args.vocab, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    for dp, cp in args.layouts:
        for fsdp in (False, True):
            queue.put((rank, dp, cp, fsdp, _measure(config, cp, fsdp)))
    dist.destroy_process_group()


def build_rows(measured: dict[tuple[int, int, bool], dict[str, int]]) -> list[dict[str, Any]]:
    """Table rows from ``{(dp, cp, fsdp): the largest rank's bytes by category}``."""
    rows = []
    for (dp, cp, fsdp), values in measured.items():
        total = values["params"] + values["grads"] + values["optimizer"]
        ddp = measured[(dp, cp, False)]
        ddp_total = ddp["params"] + ddp["grads"] + ddp["optimizer"]
        rows.append(
            {
                "layout": f"{dp} x {cp}",
                "wrapper": "FSDP" if fsdp else "DDP",
                **values,
                "total": total,
                "ratio": total / ddp_total,
                "ideal": 1 / (dp * cp) if fsdp else 1.0,
            }
        )
    return rows


def _layout(text: str) -> tuple[int, int]:
    dp, cp = (int(part) for part in text.split("x"))
    return dp, cp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--layouts", nargs="+", type=_layout, default=[(2, 2), (1, 4)], help="dp x cp, e.g. 2x2"
    )
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32768)
    args = parser.parse_args()
    worlds = {dp * cp for dp, cp in args.layouts}
    if len(worlds) != 1:
        parser.error(f"--layouts {args.layouts}: every layout must use the same number of ranks")
    world = worlds.pop()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, port, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    measured: dict[tuple[int, int, bool], dict[str, int]] = {}
    for _ in range(world * len(args.layouts) * 2):
        _, dp, cp, fsdp, values = queue.get(timeout=600)
        key = (dp, cp, fsdp)
        previous = measured.get(key)
        if previous is None or sum(values.values()) > sum(previous.values()):
            measured[key] = values  # the most loaded rank
    for p in procs:
        p.join()
    print(
        f"GPT n_layer={args.n_layer} n_embd={args.n_embd} vocab={args.vocab}, fp32, AdamW, {world} gloo ranks; "
        "per-rank bytes on the most loaded rank\n"
    )
    print(format_table(build_rows(dict(sorted(measured.items()))), COLUMNS, markdown=True))


if __name__ == "__main__":
    main()
