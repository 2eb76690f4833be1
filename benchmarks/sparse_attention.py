"""One CP rank's DeepSeek Sparse Attention layer at long context on the CPU: its peak memory beside the plan's.

Rank 0 of a CP group of ``--cp`` ranks runs one sparse attention layer's own work on its ``T / cp`` tokens of
one sequence of ``--tokens``, forward and backward, as the package runs it under CP:
:func:`~lightning_cp.parallel.key_indexer.select_topk_keys` (the indexer keys all-gathered, a running top-k
in bounded blocks), the selection kept as int32 (as the model integration keeps it for the backward),
:func:`~lightning_cp.parallel.sparse_attention.sparse_attention` over it (the keys and values all-gathered,
every head in one round, blocks of selected keys), and its backward from a random output gradient. Random
fp32 inputs: ``--heads`` query heads, each with its own key (MLA's latent expanded per head, as the attention
receives it) of ``--qk-head-dim`` and value of ``--v-head-dim``, and an indexer of ``--index-heads`` heads of
``--index-head-dim``.

The peers are :func:`one_rank_exchange`'s: the rank's collectives allocate what NCCL's do (the all-gather's
``[cp * T_local, ...]`` output, the reduce-scatter's ``[T_local, ...]`` output), the peers' rows being zeros.
That changes no byte of the rank's own work (the selection picks among the zero keys as among any others), so
its memory is one rank's of a real group, less the communication. Everything is what this rank holds: the
whole sequence's gathered keys are ``cp`` times its own.

Columns: the peak above the inputs (``q``, ``k``, ``v`` and the indexer's queries, weights and keys), as the
allocator sees it (every storage the step creates, live bytes over time: what CUDA's
``max_memory_allocated`` would report) and as the worker's resident set grows (``VmHWM``, ``_probes``); the
plan's figure for the same layer (:func:`lightning_cp.plan.sparse.sparse_layer_bytes`: ``peak``) and the
measured over planned ratio; its terms (the saved int32 selection, the indexer's transient, the attention
backward's); and the time of forward + backward. Each length runs in a fresh worker process.

Run from the repository root::

    python benchmarks/sparse_attention.py --quick
    python benchmarks/sparse_attention.py --tokens 16384 32768 --markdown
    python benchmarks/sparse_attention.py --operators 32768 --cp 8 --heads 128 --latent 576 512
"""

from __future__ import annotations

import argparse
import json
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _harness import run_worker, worker_main
from _probes import MIB, measure
from _report import STATUS, Column, format_table
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

COLUMNS = [
    Column("T", "tokens", ",.0f"),
    Column("cp", "cp", ".0f"),
    Column("T_local", "local", ",.0f"),
    Column("peak MiB", "tracked_peak", ".0f", MIB),
    Column("RSS peak MiB", "peak_extra_bytes", ".0f", MIB),
    Column("plan MiB", "plan_peak", ".0f", MIB),
    Column("peak / plan", "ratio", ".3f"),
    Column("selection MiB", "plan_selection", ".0f", MIB),
    Column("indexer MiB", "plan_indexer", ".0f", MIB),
    Column("backward MiB", "plan_backward", ".0f", MIB),
    Column("time s", "time_s", ".1f"),
    STATUS,
]


def one_rank_exchange(cp: int) -> Any:
    """Rank 0's :class:`~lightning_cp.parallel.exchange.GroupExchange` in a CP group of ``cp`` ranks whose
    peers send zeros, allocating what NCCL's collectives do: ``all_gather`` a new ``[cp * T_local, ...]``
    tensor (this rank's rows first), ``reduce_scatter`` a new ``[T_local, ...]`` one (this rank's rows of what
    it sends)."""
    from lightning_cp.parallel.exchange import GroupExchange

    class _Exchange(GroupExchange):
        def __init__(self) -> None:
            super().__init__(None)

        @property
        def size(self) -> int:
            return cp

        @property
        def rank(self) -> int:
            return 0

        def all_gather(self, local: Tensor) -> Tensor:
            gathered = local.new_zeros((cp * local.shape[0], *local.shape[1:]))
            gathered[: local.shape[0]] = local
            return gathered

        def reduce_scatter(self, full: Tensor) -> Tensor:
            return full[: full.shape[0] // cp].clone()

    return _Exchange()


class StoragePeak(TorchDispatchMode):
    """Live bytes of the storages created under the mode, and their peak (a weak reference's finalizer
    subtracts a storage when it dies). The storages of ``inputs`` are not counted (views of them are made
    under the mode too)."""

    def __init__(self, inputs: tuple[Tensor, ...] = ()) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._inputs = {tensor.untyped_storage().data_ptr() for tensor in inputs}
        self._tracked: set[int] = set()

    def _release(self, key: int, nbytes: int) -> None:
        self._tracked.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self._tracked and key not in self._inputs and storage.nbytes():
                    self._tracked.add(key)
                    self.live += storage.nbytes()
                    weakref.finalize(storage, self._release, key, storage.nbytes())
        self.peak = max(self.peak, self.live)
        return out


def layer_shape(
    heads: int,
    qk_head_dim: int,
    v_head_dim: int,
    index_heads: int,
    index_head_dim: int,
    topk: int,
    kv_heads: int | None = None,
) -> Any:
    """The plan's :class:`~lightning_cp.plan.ModelShape` of one such sparse attention layer (no MLP, no
    vocabulary: only the attention's sizes count), with a key/value head per query head unless ``kv_heads``
    (MLA's absorbed form: 1)."""
    from lightning_cp.plan.shape import ModelShape, SparseIndexer

    return ModelShape(
        hidden=heads * qk_head_dim,
        layers=1,
        heads=heads,
        kv_heads=kv_heads or heads,
        head_dim=qk_head_dim,
        ffn=0,
        vocab=1,
        tied=False,
        params=0,
        architecture="hf",
        value_head_dim=v_head_dim,
        sparse=SparseIndexer(topk, index_heads, index_head_dim, layers=1, indexer_layers=1),
    )


def layer_step(
    shape: Any, tokens: int, cp: int, seed: int = 0, latent: bool = False
) -> tuple[Callable[[], float], tuple[Tensor, ...]]:
    """One rank's sparse attention layer of ``shape`` on ``tokens`` (one sequence) over ``cp`` ranks: a step
    that runs the selection, the attention and its backward and returns the output's sum, and its inputs
    (made here, outside the step). ``latent``: the values are the keys' first ``v_head_dim`` columns (no
    ``v``). The step leaves ``dq``, ``dk``, ``dv`` in their ``.grad`` and drops them at its next call."""
    from lightning_cp.parallel import shard_batch
    from lightning_cp.parallel.key_indexer import select_topk_keys
    from lightning_cp.parallel.sparse_attention import sparse_attention

    sparse = shape.sparse
    ids = {"input_ids": torch.zeros(1, tokens, dtype=torch.long)}
    shard = shard_batch(ids, cp, 0, cp_group=one_rank_exchange(cp))["cp_shard"]
    local = shard.sequence_lengths.sum().item() // cp
    generator = torch.Generator().manual_seed(seed)

    def randn(*size: int) -> Tensor:
        return torch.randn(*size, generator=generator)

    q = randn(1, shape.heads, local, shape.head_dim).requires_grad_()
    k = randn(1, shape.kv_heads, local, shape.head_dim).requires_grad_()
    v = None if latent else randn(1, shape.kv_heads, local, shape.v_head_dim).requires_grad_()
    index_queries = randn(local, sparse.heads, sparse.head_dim)
    index_weights = randn(local, sparse.heads)
    index_keys = randn(local, sparse.head_dim)
    scale = shape.head_dim**-0.5
    leaves = (q, k) if latent else (q, k, v)
    value_dim = shape.v_head_dim if latent else None

    def step() -> float:
        for leaf in leaves:
            leaf.grad = None
        selected = select_topk_keys(
            index_queries, index_weights, index_keys, shard, sparse.topk, sparse.head_dim**-0.5
        ).int()
        out = sparse_attention(q, k, v, selected, shard, scale, value_dim=value_dim)
        out.backward(torch.randn_like(out))
        return out.detach().sum().item()

    return step, (*leaves, index_queries, index_weights, index_keys)


def attention_operators(
    heads: int, key_dim: int, value_dim: int, kv_heads: int, latent: bool, tokens: int, cp: int, topk: int
) -> int:
    """Operators :func:`~lightning_cp.parallel.sparse_attention.sparse_attention` dispatches, forward and
    backward, on rank 0 of ``cp`` with ``tokens`` local tokens of one sequence and ``topk`` keys a query, on
    bf16 fake tensors (``_counting.DispatchCounter``, as ``efficiency.py`` counts a layer); ``latent``: the
    values are the keys' first ``value_dim`` columns."""
    from _counting import Counts, DispatchCounter
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lightning_cp.parallel import shard_batch
    from lightning_cp.parallel.sparse_attention import sparse_attention

    ids = {"input_ids": torch.zeros(1, cp * tokens, dtype=torch.long)}
    shard = shard_batch(ids, cp, 0, cp_group=one_rank_exchange(cp))["cp_shard"]
    counts = Counts()
    with FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v = (
            torch.empty(1, h, tokens, d, dtype=torch.bfloat16, requires_grad=True)
            for h, d in ((heads, key_dim), (kv_heads, key_dim), (kv_heads, value_dim))
        )
        selected = torch.empty(tokens, topk, dtype=torch.int32)
        with DispatchCounter(counts):
            value_dim_arg = value_dim if latent else None
            out = sparse_attention(q, k, None if latent else v, selected, shard, 1.0, value_dim=value_dim_arg)
            out.backward(torch.empty_like(out))
    return counts.ops


def _operators(args: argparse.Namespace) -> None:
    """Print the top-k attention's operators per layer at ``args.operators`` local tokens: counted at two
    lengths whose whole sequences hold ``topk`` keys, extrapolated along the query blocks (which grow with the
    tokens)."""
    low = max(256, -(-args.topk // args.cp))
    forms = [("expanded", args.heads, args.qk_head_dim, args.v_head_dim, args.heads, False)]
    if args.latent:
        forms.append(("absorbed", args.heads, *args.latent, 1, True))
    for name, heads, key_dim, value_dim, kv_heads, latent in forms:
        a, b = (
            attention_operators(heads, key_dim, value_dim, kv_heads, latent, t, args.cp, args.topk)
            for t in (low, 2 * low)
        )
        at = a + (b - a) * (args.operators - low) // low
        print(
            f"{name}: {heads} heads over {kv_heads} key/value heads of {key_dim} (values {value_dim}), "
            f"top-{args.topk}, cp {args.cp}: {a:,} operators at {low} tokens, {b:,} at {2 * low}, "
            f"~{at:,} at {args.operators:,}"
        )


def _measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Measure one length in this (fresh) process: the tracked and resident peaks, the time, the plan."""
    from lightning_cp.plan import local_tokens
    from lightning_cp.plan.sparse import sparse_layer_bytes

    torch.set_num_threads(spec["threads"])
    sizes = ("heads", "qk_head_dim", "v_head_dim", "index_heads", "index_head_dim", "topk")
    shape = layer_shape(*(spec[name] for name in sizes))
    step, inputs = layer_step(shape, spec["tokens"], spec["cp"])
    tracker = StoragePeak(inputs)

    def tracked() -> float:
        tracker.peak = tracker.live = 0
        with tracker:
            return step()

    begin = time.perf_counter()
    measurement, _ = measure(tracked, torch.device("cpu"), warmup=0, repeat=1)
    elapsed = time.perf_counter() - begin
    local = local_tokens(spec["tokens"], spec["cp"])
    plan = sparse_layer_bytes(shape, local, spec["cp"], shape.kv_heads, 4)
    return {
        **measurement.summary(),
        "local": local,
        "tracked_peak": tracker.peak,
        "plan_peak": plan.peak,
        "ratio": tracker.peak / plan.peak,
        "plan_selection": plan.selection,
        "plan_indexer": plan.indexer,
        "plan_backward": plan.backward,
        "time_s": elapsed,
    }


def _run_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One row in a fresh CPU worker (:func:`_harness.run_worker`): the spec, its measurements and its status."""
    return {**spec, **run_worker(Path(__file__), spec, torch.device("cpu"))}


def _measured(spec: dict[str, Any]) -> dict[str, Any]:
    return {**_measure(spec), "status": "ok"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[16384, 32768], help="sequence lengths")
    parser.add_argument("--cp", type=int, default=4, help="CP size; rank 0 is measured")
    parser.add_argument("--heads", type=int, default=4, help="query heads (each with its key and value)")
    parser.add_argument("--qk-head-dim", type=int, default=192, help="query/key head dim (MLA: nope + rope)")
    parser.add_argument("--v-head-dim", type=int, default=128)
    parser.add_argument("--index-heads", type=int, default=32)
    parser.add_argument("--index-head-dim", type=int, default=128)
    parser.add_argument("--topk", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--quick", action="store_true", help="tiny shapes: T 2048 and 4096, cp 2, top-256")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument(
        "--operators",
        type=int,
        metavar="T_LOCAL",
        help="instead: count the top-k attention's operators per layer at T_LOCAL tokens per rank (fake tensors)",
    )
    parser.add_argument(
        "--latent",
        type=int,
        nargs=2,
        metavar=("KEY_DIM", "VALUE_DIM"),
        help="with --operators: MLA's absorbed form too (one key of KEY_DIM, its first VALUE_DIM the values)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker_main(args.worker, _measured)
        return
    if args.operators:
        _operators(args)
        return
    if args.quick:
        args.tokens, args.cp, args.topk, args.heads = [2048, 4096], 2, 256, 2
        args.qk_head_dim, args.v_head_dim, args.index_heads, args.index_head_dim = 48, 32, 4, 32
    names = ("cp", "heads", "qk_head_dim", "v_head_dim", "index_heads", "index_head_dim", "topk", "threads")
    rows = [_run_worker({"tokens": t, **{n: getattr(args, n) for n in names}}) for t in args.tokens]
    print(
        f"one sparse attention layer, rank 0 of cp={args.cp}: {args.heads} heads, qk {args.qk_head_dim}, "
        f"v {args.v_head_dim}; indexer {args.index_heads} x {args.index_head_dim}, top-{args.topk}; fp32, CPU"
    )
    print(format_table(rows, COLUMNS, markdown=args.markdown))
    if args.json:
        args.json.write_text(json.dumps({"results": rows}, indent=1))


if __name__ == "__main__":
    main()
