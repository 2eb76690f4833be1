"""CP attention of one rank, forward + backward, next to the ideal share and the previous implementation.

Every case computes causal attention (with ``--window``, sliding-window attention) for the queries one
CP rank holds (``shard_batch``'s head-tail split of ``--cp`` ranks) over the keys of the whole sequence
(padded: one sequence; packed: documents that attend only within themselves), on one device. The other
ranks are simulated (:class:`lightning_cp.parallel.simulated.SimulatedCPGroup`, every rank's forward
recorded once, untimed): the all-gather of K/V returns the whole sequence's K/V (this rank's part from its
inputs), the reduce-scatter of their gradients keeps this rank's slice.

============  ======================================================================================
``ideal``     full-sequence attention of all tokens (padded: SDPA causal; packed: SDPA per document; with
              a window, SDPA with the window's mask), K/V heads repeated before the timed step; measured
              once per layout and length, and a rank's ideal share of it is its time / cp (``x ideal``)
``ours``      ``lightning_cp.parallel.attention``: per-piece varlen causal kernels (FlashAttention-2 varlen
              on CUDA, the exact blocked kernel elsewhere), K/V re-gathered in the backward
``previous``  the implementation before the layout issue: K/V all-gathered and kept by autograd, SDPA
              over the local queries with a dense ``[T_local, T]`` boolean mask rebuilt per call
``fa2``,      peers (CUDA, when installed): the same pieces of the gathered K/V through
``fa3``,      ``flash_attn_varlen_func`` of FlashAttention-2 (``flash_attn``), -3 (``flash_attn_interface``)
``fa4``       or -4 (``flash_attn.cute.interface``), K/V kept by autograd
============  ======================================================================================

Columns: peak extra memory and wall time of forward + backward (``_probes``), the bytes autograd saves
between the forward and the backward (what one layer holds per rank until its backward), the keys and
values the rank's pieces attend to (``selected K/V``: ``ours`` puts them in sequence order, once, out of the gathered
``cp * T_local`` tokens; a window shrinks them), and the time against the ideal share. Each case runs in a fresh worker process (``_harness``).

Run from the repository root::

    python benchmarks/attention.py --quick
    python benchmarks/attention.py --tokens 4096 8192 --cp 2 4 --layouts padded docs8 mixed
    python benchmarks/attention.py --tokens 8192 --cp 4 --layouts padded --window none 512
    python benchmarks/attention.py --device cuda --tokens 32768 131072 --cp 4 --markdown attention.md
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _harness import (
    DTYPES,
    Case,
    needs_cuda,
    needs_module,
    parse_arguments,
    run_case,
    run_grid,
    start,
)
from _probes import GIB, MIB, measure, set_memory_budget
from _report import CASE, STATUS, Column, publish, ratio_column, shape_column
from torch import Tensor

from lightning_cp.parallel import CPShard, CPSplit, shard_batch
from lightning_cp.parallel._key_selection import shard_keys
from lightning_cp.parallel.exchange import GroupExchange
from lightning_cp.parallel.simulated import SimulatedCPGroup, rank_attention

LAYOUTS = ("padded", "docs8", "mixed")
"""``padded``: one sequence of ``T`` tokens; ``docs8``: 8 equal documents; ``mixed``: documents of random
lengths from 1 to ``T / 4`` (seeded), as packed SFT data."""
_PACKAGES = ("torch", "lightning-cp")
_RUNTIME_OVERHEAD_BYTES = 600 * MIB


@dataclass(frozen=True)
class Shape:
    tokens: int
    layout: str
    cp: int
    heads: int
    kv_heads: int
    head_dim: int
    window: int | None = None
    """Sliding window in tokens (``None``: full causal attention), for every case."""

    def label(self) -> str:
        window = "" if self.window is None else f" w={self.window}"
        return f"{self.layout} T={self.tokens} cp={self.cp}{window}"

    def document_lengths(self) -> list[int]:
        if self.layout == "padded":
            return [self.tokens]
        if self.layout == "docs8":
            return [self.tokens // 8] * 7 + [self.tokens - 7 * (self.tokens // 8)]
        g = torch.Generator().manual_seed(0)
        lengths, left = [], self.tokens
        while left > 0:
            length = min(left, int(torch.randint(1, max(2, self.tokens // 4), (), generator=g)))
            lengths.append(length)
            left -= length
        return lengths


@dataclass
class _Problem:
    """One rank's inputs (token-major ``[T_local, H, D]``) and every rank's, which its simulated peers send."""

    shape: Shape
    q: Tensor
    k: Tensor
    v: Tensor
    shard: CPShard
    ranks: list[tuple[Tensor, Tensor, Tensor, CPShard]]
    """Every rank's q, k, v and shard, in rank order (not leaves: only the peers' exchanges use them)."""
    full: tuple[Tensor, Tensor, Tensor]
    """``[1, Hq, T, D]`` q, k, v of all tokens (K/V heads repeated), for the ideal case."""
    lengths: list[int]
    coordinates: tuple[Tensor, Tensor, Tensor, Tensor]
    """Document (0: padding) and position of this rank's queries and of every gathered key, for the
    previous implementation's dense mask."""
    tokens: Tensor
    """``[T_local]``: the index in the whole sequence of each of this rank's tokens (-1: padding)."""

    @property
    def scale(self) -> float:
        return self.shape.head_dim**-0.5

    def attention_shard(self) -> CPShard:
        """This rank's shard for ``lightning_cp``'s attention, carrying a simulated group in which every
        rank's forward was recorded (untimed), whose reduce-scatter keeps this rank's share."""
        peers = SimulatedCPGroup(self.shape.cp, sum_key_gradients=False)
        with peers.recording(), torch.no_grad():
            for rank, (q, k, v, shard) in enumerate(self.ranks):
                rank_attention(q, k, v, replace(shard, exchange=peers.exchange(rank)), self.scale)
        return replace(self.shard, exchange=peers.exchange(self.shard.split.cp_rank))

    def kv_exchange(self) -> GroupExchange:
        """This rank's exchange of ``_kv(k, v)`` (the previous implementation's and the peers' gather)."""
        peers = SimulatedCPGroup(self.shape.cp, sum_key_gradients=False)
        with peers.recording():
            for rank, (_, k, v, _) in enumerate(self.ranks):
                peers.exchange(rank).all_gather(_kv(k, v))
        return peers.exchange(self.shard.split.cp_rank)


def _kv(k: Tensor, v: Tensor) -> Tensor:
    """``[T, 2 * Hkv, D]``: keys and values side by side, what the previous path and the peers gather."""
    return torch.cat([k, v], dim=1)


def _make_problem(shape: Shape, dtype: torch.dtype, device: torch.device, rank: int) -> _Problem:
    g = torch.Generator().manual_seed(0)
    total = shape.tokens
    q, k, v = (
        torch.randn(total, heads, shape.head_dim, generator=g).to(device, dtype)
        for heads in (shape.heads, shape.kv_heads, shape.kv_heads)
    )
    lengths = shape.document_lengths()
    documents = torch.repeat_interleave(torch.arange(1, len(lengths) + 1), torch.tensor(lengths))
    batch = {
        "input_ids": torch.zeros(1, total, dtype=torch.long),
        "token": torch.arange(1, total + 1)[None],  # 0: padding
        "document": documents[None],
    }
    if shape.layout != "padded":
        batch["cu_seqlens"] = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    shards = [shard_batch(batch, shape.cp, r) for r in range(shape.cp)]
    # shard_batch pads every sequence to a multiple of 2 * cp; padding (-1) reads token 0 (never scored).
    tokens = [s["token"][0].to(device) - 1 for s in shards]
    index = [t.clamp(min=0) for t in tokens]
    cp_shards = [CPShard.build(CPSplit(shape.cp, r), torch.tensor(lengths), device) for r in range(shape.cp)]
    ranks = [(q[i], k[i], v[i], cp_shard) for i, cp_shard in zip(index, cp_shards)]
    mine = index[rank]
    document, position = (
        torch.cat([s[key][0] for s in shards]).to(device) for key in ("document", "position_ids")
    )
    local = slice(rank * len(mine), (rank + 1) * len(mine))
    coordinates = (document[local], position[local], document, position)

    def leaf(x: Tensor) -> Tensor:
        return x.detach().clone().requires_grad_()

    def whole(x: Tensor) -> Tensor:  # [T, H, D] -> [1, Hq, T, D], K/V heads repeated for the ideal's SDPA
        return leaf(x.repeat_interleave(shape.heads // x.shape[1], dim=1).transpose(0, 1)[None])

    return _Problem(
        shape,
        leaf(q[mine]),
        leaf(k[mine]),
        leaf(v[mine]),
        cp_shards[rank],
        ranks,
        (whole(q), whole(k), whole(v)),
        lengths,
        coordinates,
        tokens[rank],
    )


def _build_ours(p: _Problem) -> Callable[[], Tensor]:
    shard = p.attention_shard()
    return lambda: rank_attention(p.q, p.k, p.v, shard, p.scale, window=p.shape.window)


def _build_previous(p: _Problem) -> Callable[[], Tensor]:
    """K/V all-gathered (kept for the backward by autograd) and a dense ``[T_local, T]`` mask per call."""
    exchange = p.kv_exchange()
    group = p.shape.heads // p.shape.kv_heads
    query_doc, query_pos, key_doc, key_pos = p.coordinates

    def step() -> Tensor:
        kv = _GatherKeepingGraph.apply(_kv(p.k, p.v), exchange)
        k, v = kv[:, : p.shape.kv_heads], kv[:, p.shape.kv_heads :]
        mask = (query_doc[:, None] == key_doc[None]) & (key_pos[None] <= query_pos[:, None])
        if p.shape.window is not None:
            mask &= key_pos[None] > query_pos[:, None] - p.shape.window
        out = F.scaled_dot_product_attention(
            p.q.transpose(0, 1)[None],
            k.repeat_interleave(group, dim=1).transpose(0, 1)[None],
            v.repeat_interleave(group, dim=1).transpose(0, 1)[None],
            attn_mask=mask,
        )
        return out[0].transpose(0, 1)

    return step


class _GatherKeepingGraph(torch.autograd.Function):
    """The previous all-gather: its output is an autograd tensor that the attention below saves."""

    @staticmethod
    def forward(ctx: Any, local: Tensor, exchange: GroupExchange) -> Tensor:
        ctx.exchange = exchange
        return exchange.all_gather(local)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return ctx.exchange.reduce_scatter(grad), None


def _build_ideal(p: _Problem) -> Callable[[], Tensor]:
    q, k, v = p.full
    bounds = torch.tensor([0, *p.lengths]).cumsum(0).tolist()

    def attend(a: int, b: int, kk: Tensor, vv: Tensor) -> Tensor:
        if p.shape.window is None:
            return F.scaled_dot_product_attention(q[:, :, a:b], kk[:, :, a:b], vv[:, :, a:b], is_causal=True)
        position = torch.arange(b - a, device=q.device)
        offset = position[:, None] - position[None]
        mask = (offset >= 0) & (offset < p.shape.window)
        return F.scaled_dot_product_attention(q[:, :, a:b], kk[:, :, a:b], vv[:, :, a:b], attn_mask=mask)

    def step() -> Tensor:
        return torch.cat([attend(a, b, k, v) for a, b in itertools.pairwise(bounds)], dim=2)

    return step


_FLASH_PEERS = {
    "fa2": ("flash_attn", "flash-attn (FlashAttention-2)"),
    "fa3": ("flash_attn_interface", "flash-attn-3 (flash_attn_interface)"),
    "fa4": ("flash_attn.cute.interface", "flash-attn-4 (flash_attn.cute)"),
}
"""Peer kernels: case name -> (module with ``flash_attn_varlen_func``, what to install)."""


def _flash_peer_builder(name: str) -> Callable[[_Problem], Callable[[], Tensor]]:
    def build(p: _Problem) -> Callable[[], Tensor]:
        varlen = importlib.import_module(_FLASH_PEERS[name][0]).flash_attn_varlen_func
        exchange, keys, kv_heads = p.kv_exchange(), shard_keys(p.shard, p.shape.window), p.shape.kv_heads
        # FlashAttention's window: (left, right) keys beside the query's own, passed only with --window.
        window = {} if p.shape.window is None else {"window_size": (p.shape.window - 1, 0)}

        def step() -> Tensor:
            gathered = _GatherKeepingGraph.apply(_kv(p.k, p.v), exchange)
            ordered = gathered if keys.order is None else gathered.index_select(0, keys.order)
            out = p.q.new_empty((*p.q.shape[:2], p.v.shape[-1]))
            for call in keys.calls:  # the calls and key order of ours, through the peer's kernel
                call_kv = ordered[call.keys]
                call_out = varlen(
                    p.q[call.queries],
                    call_kv[:, :kv_heads].contiguous(),
                    call_kv[:, kv_heads:].contiguous(),
                    cu_seqlens_q=call.cu_queries,
                    cu_seqlens_k=call.cu_keys,
                    max_seqlen_q=call.max_queries,
                    max_seqlen_k=call.max_keys,
                    softmax_scale=p.scale,
                    causal=True,  # bottom-right aligned, as the pieces need
                    **window,
                )
                out[call.queries] = call_out[0] if isinstance(call_out, tuple) else call_out
            return out

        return step

    return build


@dataclass(frozen=True)
class _Sizes:
    """What the memory estimates are written in."""

    shape: Shape
    itemsize: int
    """Bytes of one element of ``--dtype``."""
    fused: bool
    """Whether SDPA holds no ``[T, T]`` scores here (flash kernels: CUDA, bf16 / fp16)."""

    def rank_bytes(self) -> int:
        """Inputs and outputs of one rank, with their gradients, and the whole sequence's K/V twice."""
        s = self.shape
        local = s.tokens // s.cp + 2 * s.cp
        return (4 * local * s.heads + 4 * s.tokens * s.kv_heads) * s.head_dim * self.itemsize

    def kept_keys_bytes(self) -> int:
        """The gathered K/V and the pieces' selection of them, kept by autograd (previous path, peers)."""
        s = self.shape
        return 4 * s.tokens * s.kv_heads * s.head_dim * self.itemsize


def _ideal_bytes(z: _Sizes) -> int:
    s = z.shape
    scores = 0 if z.fused else 4 * s.heads * s.tokens**2
    return 8 * s.tokens * s.heads * s.head_dim * z.itemsize + scores


_CASES: tuple[Case[_Problem, _Sizes], ...] = (
    Case(
        "ideal",
        "full-sequence SDPA of all tokens (per document when packed); a rank's ideal share is time / cp",
        _build_ideal,
        _ideal_bytes,
    ),
    Case(
        "ours",
        "lightning_cp.parallel.attention: varlen pieces, K/V re-gathered in the backward",
        _build_ours,
        lambda z: z.rank_bytes() + 64 * MIB * 4,
    ),
    Case(
        "previous",
        "K/V all-gathered and kept, dense [T_local, T] mask, SDPA (before the layout issue)",
        _build_previous,
        lambda z: z.rank_bytes() + 9 * z.shape.heads * (z.shape.tokens // z.shape.cp) * z.shape.tokens,
    ),
    *(
        Case(
            name,
            f"flash_attn_varlen_func of {package} on the same pieces, gathered K/V kept by autograd",
            _flash_peer_builder(name),
            lambda z: z.rank_bytes() + z.kept_keys_bytes(),
            needs=(needs_cuda, needs_module(module, package)),
        )
        for name, (module, package) in _FLASH_PEERS.items()
    ),
)
_CASES_BY_NAME = {case.name: case for case in _CASES}


# --------------------------------------------------------------------------------------------------
# The worker: one case, one shape, in its own process


def _saved_bytes(step: Callable[[], Tensor]) -> int:
    """Bytes autograd keeps from ``step``'s forward until its backward (distinct storages)."""
    storages: dict[int, int] = {}

    def pack(tensor: Tensor) -> Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = step()
    del out
    return sum(storages.values())


def _measure(spec: dict[str, Any]) -> dict[str, Any]:
    case = _CASES_BY_NAME[spec["case"]]
    device = torch.device(spec["device"])
    p = _make_problem(Shape(**spec["shape"]), DTYPES[spec["dtype"]], device, spec["rank"])
    leaves = (*p.full, p.q, p.k, p.v)
    step = case.build(p)

    def reset() -> None:
        for leaf in leaves:
            leaf.grad = None

    def forward_backward() -> Tensor:
        out = step()
        out.backward(torch.ones_like(out))
        return out.detach().float().sum()

    saved = _saved_bytes(step)
    set_memory_budget(device, int(spec["max_mem_gib"] * GIB))
    measurement, checksum = measure(
        forward_backward,
        device,
        warmup=spec["warmup"],
        repeat=spec["repeat"],
        reset=reset,
        retained=lambda: sum(leaf.grad.nbytes for leaf in leaves if leaf.grad is not None),
    )
    return {"status": "ok", **measurement.summary(), "saved_bytes": saved, "checksum": checksum.item()}


# --------------------------------------------------------------------------------------------------
# The parent: grid, rows, report


def _measure_case(shape: Shape, case: Case, args: argparse.Namespace) -> dict[str, Any]:
    dtype = DTYPES[args.dtype]
    fused = args.device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
    sizes = _Sizes(shape, torch.empty((), dtype=dtype).element_size(), fused)
    estimate = case.estimate(sizes) + _RUNTIME_OVERHEAD_BYTES
    row = {
        "case": case.name,
        "shape": shape.label(),
        **asdict(shape),
        "dtype": args.dtype,
        "selected_kv_bytes": _selected_kv_bytes(shape, args.rank, sizes.itemsize),
    }
    spec = {"shape": asdict(shape), "dtype": args.dtype, "rank": args.rank}
    return {**row, **run_case(Path(__file__), case, args, spec, estimate)}


def _selected_kv_bytes(shape: Shape, rank: int, itemsize: int) -> int:
    """Bytes of the keys and values the rank's pieces attend to (``ours`` selects them from the gathered
    ``cp * T_local``): what one layer's K/V take on the rank besides the gathered copy."""
    shard = CPShard.build(CPSplit(shape.cp, rank), torch.tensor(shape.document_lengths()), "cpu")
    return shard_keys(shard, shape.window).num_keys * 2 * shape.kv_heads * shape.head_dim * itemsize


def _add_ratios(rows: list[dict[str, Any]]) -> None:
    """``x ideal``: time over the ideal share (ideal time / cp); ``x ours``: memory and time over ours."""
    by = {(r["case"], r["shape"]): r for r in rows if r["status"] == "ok"}
    for row in rows:
        ideal = by.get(("ideal", row["shape"]))
        ours = by.get(("ours", row["shape"]))
        ok = row["status"] == "ok"
        row["ideal_share_ms"] = ideal["time_ms"] / row["cp"] if ideal else None
        row["x_ideal"] = (
            row["time_ms"] / row["ideal_share_ms"] if ok and ideal and row["case"] != "ideal" else None
        )
        row["mem_x_ours"] = row["peak_extra_bytes"] / ours["peak_extra_bytes"] if ok and ours else None
        row["saved_x_ours"] = row["saved_bytes"] / ours["saved_bytes"] if ok and ours else None


_COLUMNS = (
    CASE,
    shape_column("layout, tokens, cp"),
    Column("peak extra MiB", "peak_extra_bytes", ",.0f", scale=MIB),
    ratio_column("mem_x_ours", "x ours"),
    Column("saved MiB", "saved_bytes", ",.1f", scale=MIB),
    ratio_column("saved_x_ours", "x ours"),
    Column("selected K/V MiB", "selected_kv_bytes", ",.1f", scale=MIB),
    Column("time ms", "time_ms", ",.1f"),
    Column("ideal share ms", "ideal_share_ms", ",.1f"),
    ratio_column("x_ideal", "x ideal"),
    STATUS,
)

_FULL_CPU = {"tokens": [4096, 8192], "cp": [2, 4], "layouts": list(LAYOUTS)}
_FULL_CUDA = {"tokens": [8192, 32768, 131072], "cp": [2, 4, 8], "layouts": list(LAYOUTS)}
_QUICK = {"tokens": [1024], "cp": [2], "layouts": ["padded", "mixed"], "repeat": 1, "warmup": 0}


def _window(text: str) -> int | None:
    if text == "none":
        return None
    window = int(text)
    if window < 1:
        raise argparse.ArgumentTypeError(f"a window is a positive number of tokens or 'none', not {text}")
    return window


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", help="total tokens T (default: 4096 8192 on CPU)")
    parser.add_argument(
        "--cp", type=int, nargs="+", help="simulated CP sizes (default: 2 4 on CPU, 2 4 8 on CUDA)"
    )
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, help="default: all")
    parser.add_argument("--heads", type=int, default=16, help="query heads (default 16)")
    parser.add_argument("--kv-heads", type=int, default=4, help="key/value heads (default 4: GQA)")
    parser.add_argument("--head-dim", type=int, default=64, help="default 64 (128 on CUDA is typical)")
    parser.add_argument("--rank", type=int, default=0, help="the simulated CP rank (default 0)")
    parser.add_argument(
        "--window",
        type=_window,
        nargs="+",
        default=[None],
        help="sliding windows in tokens, 'none' for full causal attention (default: none)",
    )
    parser.add_argument("--quick", action="store_true", help="smoke test: T=1024, cp=2, one run")
    positive = ("tokens", "cp", "heads", "kv_heads", "head_dim")
    args = parse_arguments(parser, argv, cpu=_FULL_CPU, cuda=_FULL_CUDA, quick=_QUICK, positive=positive)
    if args.heads % args.kv_heads:
        parser.error(f"--kv-heads {args.kv_heads} must divide --heads {args.heads}")
    if any(args.rank >= cp for cp in args.cp):
        parser.error(f"--rank {args.rank} must be below every --cp")
    return args


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Run the grid, print the table and return its rows (also written to ``--json``, ``--markdown``)."""
    args = _parse_args(argv)
    cases = start(args, _CASES, _measure)
    if cases is None:
        return []
    shapes = [
        Shape(tokens, layout, cp, args.heads, args.kv_heads, args.head_dim, window)
        for layout in args.layouts
        for tokens in args.tokens
        for cp in args.cp
        for window in args.window
    ]
    started = time.perf_counter()
    ideal: dict[tuple[str, int], dict[str, Any]] = {}

    def row(shape: Shape, case: Case) -> dict[str, Any]:
        if case.name != "ideal":
            return _measure_case(shape, case, args)
        # The ideal does not depend on cp: measured once per layout and length, shown on every cp's rows.
        key = (shape.layout, shape.tokens)
        if key not in ideal:
            ideal[key] = _measure_case(shape, case, args)
        return {**ideal[key], "shape": shape.label(), "cp": shape.cp}

    rows = run_grid(shapes, cases, row)
    _add_ratios(rows)
    wall_s = time.perf_counter() - started
    publish(
        rows,
        _COLUMNS,
        args=args,
        title=(
            f"CP attention of rank {args.rank}, forward + backward, {args.dtype} on {args.device.type}, "
            f"{args.heads} heads / {args.kv_heads} KV heads x {args.head_dim}; time: median of {args.repeat} "
            f"after {args.warmup} warm-up"
        ),
        notes="saved: bytes autograd keeps between forward and backward; x ideal: time / (ideal time / cp).",
        wall_s=wall_s,
        packages=_PACKAGES,
    )
    return rows


if __name__ == "__main__":
    main()
