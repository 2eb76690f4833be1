"""Self-checks of CP attention: every rank of a simulated CP group against full-sequence SDPA.

The doctor runs CP attention as each rank of a group of 2 and 4 would (:mod:`lightning_cp.parallel.simulated`:
every rank's forward and backward in this process through the ``GroupExchange`` seam) on small padded and
packed batches with grouped-query attention, and compares the reassembled outputs and dQ / dK / dV to
``F.scaled_dot_product_attention`` on the whole sequence (per document when packed), in float64 on the CPU.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_cp.doctor._compare import CheckResult, compare, run_check
from lightning_cp.parallel import _varlen
from lightning_cp.parallel.simulated import simulate_cp_attention

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 64
"""Grouped-query attention, at a head size the CUDA kernels take."""
PADDED = (2, 250)
"""``B, S`` of the padded batch: 250 is no multiple of ``2 * cp`` for cp = 4, so padding is exercised."""
PACKED_CU = (0, 1, 38, 39, 130, 200, 257)
"""Packed documents: of length 1, odd lengths, and longer than a CP chunk."""
CP_SIZES = (2, 4)
LAYOUTS = ("padded", "packed")


def attention_inputs(layout: str, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """``(q, k, v, grad_out, cu_seqlens)`` on the CPU in ``dtype``, the same on every call (and rank)."""
    batch, seq_len = PADDED if layout == "padded" else (1, PACKED_CU[-1])
    g = torch.Generator().manual_seed(0)

    def randn(heads: int) -> Tensor:
        return torch.randn(batch, heads, seq_len, HEAD_DIM, generator=g).to(dtype)

    cu = None if layout == "padded" else torch.tensor(PACKED_CU)
    return randn(HEADS), randn(KV_HEADS), randn(KV_HEADS), randn(HEADS), cu


def sdpa_reference(
    q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor, cu_seqlens: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(out, dq, dk, dv)`` of causal SDPA over whole sequences (each document alone when packed), with
    K/V heads repeated for grouped-query attention; computed where and in the dtype the inputs are."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    keys, values = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    bounds = [0, q.shape[2]] if cu_seqlens is None else cu_seqlens.tolist()
    out = torch.cat(
        [
            F.scaled_dot_product_attention(q[:, :, a:b], keys[:, :, a:b], values[:, :, a:b], is_causal=True)
            for a, b in itertools.pairwise(bounds)
        ],
        dim=2,
    )
    out.backward(grad_out)
    return out.detach(), q.grad, k.grad, v.grad


def kernel_name(q: Tensor) -> str:
    """The local kernel CP attention runs for queries like ``q``: the package's own choice."""
    return "flash-varlen" if _varlen.use_flash(q, q, q, None) else "torch-blocked"


def attention_checks(device: torch.device, dtypes: tuple[torch.dtype, ...]) -> list[CheckResult]:
    """One result per (dtype, layout, cp size): simulated CP attention vs SDPA on the whole sequence."""
    results = []
    for dtype, layout, cp in itertools.product(dtypes, LAYOUTS, CP_SIZES):
        name = f"attention cp={cp} {layout} gqa {str(dtype).removeprefix('torch.')}"
        results.append(run_check(name, _check, device, dtype, layout, cp))
    return results


def _check(name: str, device: torch.device, dtype: torch.dtype, layout: str, cp: int) -> CheckResult:
    q, k, v, grad_out, cu = attention_inputs(layout, dtype)
    reference = sdpa_reference(*(t.double() for t in (q, k, v, grad_out)), cu)
    on_device = [t.to(device) for t in (q, k, v, grad_out)]
    torchs = sdpa_reference(*on_device, cu)
    ours = simulate_cp_attention(*on_device, cp_size=cp, cu_seqlens=cu)
    quantities = dict(zip(("out", "dq", "dk", "dv"), zip(ours, reference, torchs)))
    return compare(name, dtype, quantities, f"[{kernel_name(on_device[0])}]")
