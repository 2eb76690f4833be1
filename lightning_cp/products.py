"""Matrix products summed into a wider accumulator: a bf16 GEMM into fp32, in place where the device can.

A training step in bf16 keeps some sums in fp32 (a weight's gradient over many tokens, a gradient added at
gathered rows). :func:`add_product` adds ``a @ b`` into such an accumulator with the products of ``a`` and ``b``'s
own dtype on CUDA (one tensor-core GEMM whose fp32 sum goes straight into the accumulator), not an fp32 matmul of
upcast copies, which runs at a fraction of the speed and holds the copies. Shared by the fused loss's weight
gradient (:mod:`lightning_cp.ops`), MLA's latent backward (:mod:`lightning_cp.parallel.latent_attention`) and a
tiled projection's weight gradient (:mod:`lightning_cp.memory.tiling`).
"""

from __future__ import annotations

import functools

import torch

_IN_PLACE_DEVICES = ("cuda", "meta")
"""Devices whose ``aten::addmm.dtype_out`` sums a bf16 / fp16 GEMM into an fp32 ``self`` given as ``out``, in
place: CUDA (cuBLAS), and meta, whose kernel lets the CPU tests count what CUDA allocates; the CPU has none."""
_LOW_PRECISION = (torch.bfloat16, torch.float16)


def add_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b``, ``a`` ``[m, k]``, ``b`` ``[k, n]``, ``acc`` ``[m, n]`` fp32 (or wider), summed in
    ``acc``'s dtype.

    Bf16 / fp16 ``a`` and ``b`` of one dtype into an fp32 ``acc`` on CUDA: one GEMM in their dtype (each product
    of two bf16 values exact in fp32) that sums into ``acc`` in place (cuBLAS's beta = 1), with no ``[m, n]``
    temporary (torch 2.8 and 2.9: the GEMM's fp32 output, then added). Elsewhere (the CPU, mixed dtypes, an
    fp64 ``acc``) ``a`` and ``b`` are cast to ``acc``'s dtype first. No communication."""
    low_precision = a.dtype == b.dtype and a.dtype in _LOW_PRECISION and acc.dtype == torch.float32
    if low_precision and _addmm_sums_into_fp32(a.device.type):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    elif low_precision and a.is_cuda and _mm_has_fp32_output():
        acc.add_(torch.mm(a, b, out_dtype=torch.float32))
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


@functools.cache
def _mm_has_fp32_output() -> bool:
    # torch.mm(a, b, out_dtype=torch.float32): fp32 output straight from a bf16 / fp16 GEMM (CUDA only).
    return "dtype" in torch.ops.aten.mm.overloads()


@functools.cache
def _addmm_sums_into_fp32(device_type: str) -> bool:
    """Whether ``torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)`` sums a bf16 GEMM into an fp32
    ``acc`` in place on devices of ``device_type``. Torch 2.8 and 2.9 refuse an fp32 ``self`` beside bf16
    matrices (pytorch#167931 lifts it), and no GPU has run this package yet: so it is tried once, on a 2 x 2
    product, and its sum checked; meta (the CPU tests' stand-in for CUDA) is taken at its kernel's word."""
    if device_type not in _IN_PLACE_DEVICES or "dtype_out" not in torch.ops.aten.addmm.overloads():
        return False
    if device_type == "meta":
        return True
    acc = torch.ones(2, 2, device=device_type)
    ones = torch.ones(2, 2, device=device_type, dtype=torch.bfloat16)
    try:
        torch.addmm(acc, ones, ones, out_dtype=torch.float32, out=acc)
    except RuntimeError:
        return False
    return bool((acc == 3).all())
