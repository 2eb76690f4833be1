"""Self-checks of CP attention in each of its exchanges: every rank's shard against full-sequence SDPA.

The doctor shards small padded and packed batches with grouped-query attention for every rank a check runs
(:mod:`lightning_cp.doctor._ranks`: all ranks of a simulated group of 2 and 4 in this process, or this rank
of the real group under ``torchrun``), runs :func:`~lightning_cp.parallel.context_parallel_attention`
forward and backward on each shard, and compares the outputs and dQ / dK / dV of the real tokens with those
of ``F.scaled_dot_product_attention`` on the whole sequence (per document when packed), in float64 on the
CPU. Each exchange of :class:`~lightning_cp.parallel.attention_mode.AttentionMode` is checked:

- ``allgather``: the key/value heads all-gathered at once (one all-gather in the forward);
- ``allgather x2 rounds``: one key/value head per round (two all-gathers in the forward);
- ``ulysses``: the heads over the ranks by all-to-all (two in the forward; at cp = 4 the two key/value heads
  are replicated).

A check also fails when the forward made other exchanges than its mode's: a mode that silently runs another
one computes the same numbers. Under autocast (:func:`autocast_attention_checks`: fp32 inputs inside
``torch.autocast(device, dtype=torch.bfloat16)``, the all-gather of a simulated group of 2) the reference is
SDPA under the same autocast, and the output must come in SDPA's dtype: attention that ignored autocast would
pass the numbers, in fp32, at twice the memory and a fraction of the speed.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_cp.doctor._autocast import AUTOCAST, autocast
from lightning_cp.doctor._compare import CheckResult, compare, dtype_name, run_check
from lightning_cp.doctor._ranks import CheckRanks, SimulatedRanks
from lightning_cp.parallel import _varlen, context_parallel_attention, shard_batch
from lightning_cp.parallel.attention_mode import AttentionMode
from lightning_cp.parallel.exchange import GroupExchange

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 64
"""Grouped-query attention, at a head size the CUDA kernels take."""
PADDED = (2, 250)
"""``B, S`` of the padded batch: 250 is no multiple of ``2 * cp`` for cp = 4, so padding is exercised."""
PACKED_CU = (0, 1, 38, 39, 130, 200, 257)
"""Packed documents: of length 1, odd lengths, and longer than a CP chunk."""
LAYOUTS = ("padded", "packed")
MODES: dict[str, AttentionMode] = {
    "allgather": AttentionMode("allgather"),
    f"allgather x{KV_HEADS} rounds": AttentionMode("allgather", kv_heads_per_gather=1),
    "ulysses": AttentionMode("ulysses"),
}
"""Each exchange the checks run, by the name their lines give it."""
FORWARD_EXCHANGES: dict[str, list[str]] = {
    "allgather": ["all_gather"],
    f"allgather x{KV_HEADS} rounds": ["all_gather"] * KV_HEADS,
    "ulysses": ["all_to_all"] * 2,
}
"""The exchanges each mode's forward makes: one all-gather per round, or Ulysses' all-to-all there and back."""
SIMULATED = {"allgather": (2, 4), f"allgather x{KV_HEADS} rounds": (4,), "ulysses": (2, 4)}
"""The simulated CP sizes each mode is checked at in one process."""
QUANTITIES = ("out", "dq", "dk", "dv")


def attention_inputs(layout: str, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """``(q, k, v, grad_out, cu_seqlens)`` on the CPU in ``dtype``, the same on every call (and rank)."""
    batch, seq_len = PADDED if layout == "padded" else (1, PACKED_CU[-1])
    g = torch.Generator().manual_seed(0)

    def randn(heads: int) -> Tensor:
        return torch.randn(batch, heads, seq_len, HEAD_DIM, generator=g).to(dtype)

    cu = None if layout == "padded" else torch.tensor(PACKED_CU)
    return randn(HEADS), randn(KV_HEADS), randn(KV_HEADS), randn(HEADS), cu


def sdpa_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    grad_out: Tensor,
    cu_seqlens: Tensor | None,
    low: torch.dtype | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(out, dq, dk, dv)`` of causal SDPA over whole sequences (each document alone when packed), with
    K/V heads repeated for grouped-query attention; computed where and in the dtype the inputs are, the
    forward under ``low`` autocast when given."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    keys, values = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    bounds = [0, q.shape[2]] if cu_seqlens is None else cu_seqlens.tolist()
    with autocast(q.device, low):
        out = torch.cat(
            [
                F.scaled_dot_product_attention(
                    q[:, :, a:b], keys[:, :, a:b], values[:, :, a:b], is_causal=True
                )
                for a, b in itertools.pairwise(bounds)
            ],
            dim=2,
        )
    out.backward(grad_out.to(out.dtype))
    return out.detach(), q.grad, k.grad, v.grad


def kernel_name(q: Tensor) -> str:
    """The local kernel CP attention runs for queries like ``q``: the package's own choice."""
    return "flash-varlen" if _varlen.use_flash(q, q, q, None) else "torch-blocked"


def shard_heads(
    tensors: dict[str, Tensor],
    cu_seqlens: Tensor | None,
    cp: int,
    rank: int,
    exchange: GroupExchange | None = None,
    attention: AttentionMode | None = None,
) -> dict:
    """Rank ``rank``'s shard of ``[B, H, S, d]`` tensors (as ``[B, H, S_local, d]``, contiguous), with the
    batch's ``cp_shard`` (over ``exchange``, in mode ``attention``) and ``input_mask``."""
    first = next(iter(tensors.values()))
    batch: dict = {
        "input_ids": torch.zeros(first.shape[0], first.shape[2], dtype=torch.long, device=first.device)
    }
    batch.update({name: t.transpose(1, 2) for name, t in tensors.items()})
    if cu_seqlens is not None:
        batch["cu_seqlens"] = cu_seqlens
    shard = shard_batch(batch, cp, rank, cp_group=exchange, attention=attention)
    return {**shard, **{name: shard[name].transpose(1, 2).contiguous() for name in tensors}}


def valid_tokens(t: Tensor, valid: Tensor) -> Tensor:
    """The tokens of ``t`` ``[B, H, S_local, d]`` where ``valid`` ``[B, S_local]``, as ``[n, H, d]`` on the CPU."""
    return t.detach().transpose(1, 2).cpu()[valid.cpu()]


def attention_triples(
    ranks: CheckRanks,
    device: torch.device,
    inputs: tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None],
    mode: str,
    reference: tuple[torch.dtype, torch.device] = (torch.float64, torch.device("cpu")),
    low: torch.dtype | None = None,
) -> tuple[dict[str, tuple[Tensor, Tensor, Tensor]], list[str]]:
    """CP attention in ``mode`` (a key of :data:`MODES`) for every rank of ``ranks`` on ``device``, and SDPA on
    the whole sequence in the ``reference`` dtype and device and in the inputs' own dtype on ``device``.

    Args:
        inputs: ``(q, k, v, grad_out, cu_seqlens)`` of the whole batch (:func:`attention_inputs`' layout).
        low: the forwards of CP attention and of SDPA on ``device`` run under autocast to this dtype (the
            backwards outside it, as in training); ``None``: no autocast.

    Returns:
        As :func:`rank_triples`.
    """
    q, k, v, grad_out, cu = inputs
    ref_dtype, ref_device = reference
    references = sdpa_reference(*(t.to(ref_device, ref_dtype) for t in (q, k, v, grad_out)), cu)
    torchs = sdpa_reference(*(t.to(device) for t in (q, k, v, grad_out)), cu, low)
    on_device = {n: t.to(device) for n, t in zip("qkvg", (q, k, v, grad_out))}

    def forward(shard: dict, leaves: tuple[Tensor, ...]) -> Tensor:
        with autocast(device, low):
            return context_parallel_attention(*leaves, cp_shard=shard["cp_shard"])

    return rank_triples(ranks, on_device, cu, forward, (references, torchs), MODES[mode])


def rank_triples(
    ranks: CheckRanks,
    tensors: dict[str, Tensor],
    cu_seqlens: Tensor | None,
    forward: Callable[[dict, tuple[Tensor, ...]], Tensor],
    expected: tuple[Sequence[Tensor], Sequence[Tensor]],
    attention: AttentionMode | None = None,
) -> tuple[dict[str, tuple[Tensor, Tensor, Tensor]], list[str]]:
    """An attention layer's forward and backward on every rank of ``ranks``, compared on the real tokens.

    Args:
        tensors: ``[B, heads, S, d]`` tensors of the whole batch on the device the ranks run on: ``q``, ``k``,
            ``v``, the output's gradient ``g``, and any other the layer reads, sharded alike.
        forward: ``forward(shard, (q, k, v))``: the layer's output on a rank's shard (:func:`shard_heads`,
            over that rank's exchange, in mode ``attention``), from its ``q``, ``k``, ``v`` leaves.
        expected: ``(reference, PyTorch's)``, each ``(out, dq, dk, dv)`` ``[B, H, S, d]`` of the whole batch
            (compared where the reference is).

    Returns:
        ``{quantity: (ours, reference, PyTorch's)}`` for ``out``, ``dq``, ``dk``, ``dv``, each ``[n, H, d]``: the
        real tokens of the ranks run here, on the CPU; and the exchanges rank ``ranks.ranks[0]``'s forward made.
    """
    references, torchs = expected
    wanted = {f"ref_{n}": t for n, t in zip(QUANTITIES, references)}
    wanted.update({f"torch_{n}": t.to(references[0].device) for n, t in zip(QUANTITIES, torchs)})
    shards = {
        rank: shard_heads(tensors, cu_seqlens, ranks.cp, rank, ranks.exchange(rank), attention)
        for rank in ranks.ranks
    }
    leaves = {rank: tuple(shard[n].requires_grad_() for n in "qkv") for rank, shard in shards.items()}
    outs = dict(zip(ranks.ranks, ranks.run(lambda rank: forward(shards[rank], leaves[rank]))))
    exchanges = ranks.calls[ranks.ranks[0]].copy()

    def backward_step(rank: int) -> tuple[Tensor, ...]:
        grad_out = shards[rank]["g"].to(outs[rank].dtype)
        return torch.autograd.grad(outs[rank], leaves[rank], grad_out, retain_graph=True)

    grads = dict(zip(ranks.ranks, ranks.run(backward_step)))
    compared: dict[str, list[tuple[Tensor, ...]]] = {n: [] for n in QUANTITIES}
    for rank in ranks.ranks:
        mine = shard_heads(wanted, cu_seqlens, ranks.cp, rank)
        valid = mine["input_mask"].bool()  # [B, S_local]: the padding added by the split is not compared
        for n, ours in zip(QUANTITIES, (outs[rank], *grads[rank])):
            triple = (ours, mine[f"ref_{n}"], mine[f"torch_{n}"])
            compared[n].append(tuple(valid_tokens(t, valid) for t in triple))
    triples = {n: tuple(torch.cat(parts) for parts in zip(*per_rank)) for n, per_rank in compared.items()}
    return triples, exchanges


def check_attention(
    name: str,
    ranks: CheckRanks,
    device: torch.device,
    dtype: torch.dtype,
    layout: str,
    mode: str,
    low: torch.dtype | None = None,
) -> CheckResult:
    """CP attention in ``mode`` (a key of :data:`MODES`) for every rank of ``ranks`` on ``device`` against
    SDPA on the whole sequence in float64, on the real tokens of those ranks' shards, with inputs in ``dtype``
    (under ``low`` autocast when given, within ``low``'s tolerance); a FAIL when the forward made other
    exchanges than the mode's, or when the output's dtype is not SDPA's."""
    triples, forward = attention_triples(ranks, device, attention_inputs(layout, dtype), mode, low=low)
    exchanges = f"fwd: {', '.join(forward) or 'no exchange'}"
    if forward != FORWARD_EXCHANGES[mode]:
        return CheckResult(name, "FAIL", f"{exchanges}; {mode} makes {', '.join(FORWARD_EXCHANGES[mode])}")
    ours, _, sdpa = (t.dtype for t in triples["out"])
    if ours != sdpa:
        return CheckResult(
            name, "FAIL", f"output in {dtype_name(ours)}, SDPA's in {dtype_name(sdpa)} [{exchanges}]"
        )
    compute = low or dtype
    kernel = kernel_name(torch.empty(1, 1, HEAD_DIM, dtype=compute, device=device))
    return compare(name, compute, triples, f"[{kernel}; {exchanges}]")


def attention_checks(device: torch.device, dtypes: tuple[torch.dtype, ...]) -> list[CheckResult]:
    """One result per (dtype, mode, simulated CP size, layout): every rank of a simulated group vs SDPA."""
    results = []
    for dtype, (mode, sizes) in itertools.product(dtypes, SIMULATED.items()):
        for cp, layout in itertools.product(sizes, LAYOUTS):
            name = f"attention {mode} cp={cp} {layout} gqa {dtype_name(dtype)}"
            results.append(run_check(name, _simulated, device, dtype, layout, mode, cp))
    return results


def autocast_attention_checks(device: torch.device) -> list[CheckResult]:
    """One result: fp32 inputs under :data:`~lightning_cp.doctor._autocast.AUTOCAST` autocast, the all-gather of
    a simulated group of 2, packed, vs SDPA under the same autocast (see the module docstring)."""
    name = f"attention allgather cp=2 packed gqa float32 under {dtype_name(AUTOCAST)} autocast"
    return [run_check(name, _simulated, device, torch.float32, "packed", "allgather", 2, AUTOCAST)]


def _simulated(
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    layout: str,
    mode: str,
    cp: int,
    low: torch.dtype | None = None,
) -> CheckResult:
    return check_attention(name, SimulatedRanks(cp), device, dtype, layout, mode, low)
