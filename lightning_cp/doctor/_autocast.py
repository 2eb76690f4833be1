"""What the checks under autocast need: the context itself, and the dtype every matmul ran in.

A check under autocast calls the package with fp32 inputs inside ``torch.autocast(device, dtype=bf16)``, as
``bf16-mixed`` under DDP does, and compares with PyTorch under the same autocast. :class:`MatmulDtypes`
records, below autocast (the dispatcher's view: the operands as they reached the kernel), the FLOPs of every
matrix multiplication by how it ran, so that a check can say which matmuls escaped autocast's dtype (a GEMM
with ``out=`` or ``addmm_``, which autocast does not cover, or a backward, which runs outside it).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_cp.doctor._compare import CheckResult, dtype_name

AUTOCAST = torch.bfloat16
"""The dtype the autocast checks run in (``bf16-mixed``)."""
FP32_SHARE = 0.01
"""The largest share of the matmul FLOPs that may run in fp32 under autocast (a GEMM in fp32 is several
times slower than in bf16 on a GPU)."""
_MATMULS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_, torch.ops.aten.bmm}


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """``torch.autocast(device.type, dtype=dtype)``, or nothing when ``dtype`` is ``None``."""
    return contextlib.nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


class MatmulDtypes(TorchDispatchMode):
    """While active, the FLOPs of every ``mm`` / ``addmm`` / ``addmm_`` / ``bmm`` dispatched, by how it ran
    (:attr:`flops`): its operands' dtype; ``"<low> -> float32 out"`` for a GEMM of ``low`` operands with an
    fp32 output (``torch.mm(..., out_dtype=torch.float32)``, CUDA's fp32-summed product); ``"float32 on <low>
    values"`` for fp32 operands that hold ``low`` values exactly (the same product where no such GEMM exists,
    as on the CPU: the operands rounded to ``low``, then multiplied in fp32).

    Args:
        low: autocast's dtype.
    """

    def __init__(self, low: torch.dtype) -> None:
        super().__init__()
        self.low = low
        self.flops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func.overloadpacket in _MATMULS:
            a, b = (
                args[1:3]
                if func.overloadpacket in (torch.ops.aten.addmm, torch.ops.aten.addmm_)
                else args[:2]
            )
            self.flops[self._how(a, b, func._overloadname)] += 2 * a.numel() * b.shape[-1]
        return func(*args, **(kwargs or {}))

    def _how(self, a: Tensor, b: Tensor, overload: str) -> str:
        name = dtype_name(a.dtype)
        if overload.startswith("dtype"):  # mm.dtype, mm.dtype_out: fp32 output of a low-precision GEMM
            return f"{name} -> float32 out"
        if a.dtype == torch.float32 and all(_holds(t, self.low) for t in (a, b)):
            return f"float32 on {dtype_name(self.low)} values"
        return name

    def share(self, how: str) -> float:
        """The fraction of the recorded FLOPs that ran as ``how`` (a key of :attr:`flops`)."""
        total = sum(self.flops.values())
        return self.flops[how] / total if total else 0.0

    def summary(self) -> str:
        """``"bfloat16 67%, float32 on bfloat16 values 33%"``: each way, by its share of the FLOPs."""
        if not self.flops:
            return "no matmul"
        return ", ".join(f"{how} {self.share(how):.0%}" for how, _ in self.flops.most_common())

    def verdict(self, result: CheckResult) -> CheckResult:
        """``result`` (a comparison under autocast), its detail followed by :meth:`summary`; a FAIL when more
        than :data:`FP32_SHARE` of the FLOPs ran in fp32."""
        ran = f"[matmul FLOPs: {self.summary()}]"
        fp32 = self.share(dtype_name(torch.float32))
        if result.status == "PASS" and fp32 > FP32_SHARE:
            detail = f"{fp32:.0%} of the matmul FLOPs ran in float32 (at most {FP32_SHARE:.0%}) {ran}"
            return CheckResult(result.name, "FAIL", detail)
        return CheckResult(result.name, result.status, f"{result.detail} {ran}".strip())


def _holds(t: Tensor, dtype: torch.dtype) -> bool:
    """Whether every value of ``t`` is exactly representable in ``dtype``."""
    return torch.equal(t, t.to(dtype).to(t.dtype))
