"""Self-checks of the fused LM-head loss and log-probabilities against plain PyTorch on full logits.

For each backend (torch; Triton where :mod:`lightning_cp.ops` would run it) and dtype,
:func:`lightning_cp.ops.linear_cross_entropy` (loss, dL/dhidden, dL/dweight) is compared to
``F.cross_entropy`` on materialized logits, and :func:`lightning_cp.ops.token_logprobs` (log-probabilities
and the gradients of a weighted sum of them) to ``log_softmax``; references in float64 on the CPU. The
problem has three chunks (the last one partial), 10% ignored labels and a vocabulary wider than one Triton
tile.

Under autocast (:func:`autocast_loss_checks`: ``bf16-mixed`` under DDP, fp32 hidden states and weight inside
``torch.autocast(device, dtype=torch.bfloat16)``) the same comparison is made with PyTorch under the same
autocast, within bf16's tolerance, and the matmuls that ran are recorded (:class:`~lightning_cp.doctor.
_autocast.MatmulDtypes`): at most 1% of their FLOPs may run in fp32 (the head's backward in fp32 is 2-3x
slower on a GPU). The weight gradient, summed in fp32, is a bf16 GEMM with an fp32 output on CUDA, and an fp32
matmul of bf16-rounded operands elsewhere; the line says which ran.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_cp import ops
from lightning_cp.constants import IGNORE_INDEX
from lightning_cp.doctor._autocast import AUTOCAST, MatmulDtypes, autocast
from lightning_cp.doctor._compare import CheckResult, compare, dtype_name, run_check
from lightning_cp.ops import _plan

TOKENS, VOCAB, HIDDEN, CHUNK = 300, 5000, 64, 128
IMPLS = ("torch", "triton")
FUNCTIONS = ("linear_cross_entropy", "token_logprobs")


def loss_inputs(dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(hidden [N, H], weight [V, H], labels [N], upstream [N])`` on the CPU, the same on every call."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(TOKENS, HIDDEN, generator=g).to(dtype)
    weight = (torch.randn(VOCAB, HIDDEN, generator=g) / HIDDEN**0.5).to(dtype)
    labels = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    labels[torch.rand(TOKENS, generator=g) < 0.1] = IGNORE_INDEX
    upstream = torch.randn(TOKENS, generator=g)
    return hidden, weight, labels, upstream


def impl_unavailable(impl: str, device: torch.device) -> str | None:
    """Why :mod:`lightning_cp.ops` would refuse ``impl`` on ``device`` (its own rule), or ``None``."""
    try:
        _plan._resolve_impl(impl, device)
    except (ImportError, ValueError) as error:
        return str(error).split(";")[0]
    return None


def loss_checks(device: torch.device, dtypes: tuple[torch.dtype, ...]) -> list[CheckResult]:
    """One result per (function, backend, dtype); a backend that cannot run here is a SKIP."""
    return _each_backend(device, [(dtype, None) for dtype in dtypes])


def autocast_loss_checks(device: torch.device) -> list[CheckResult]:
    """One result per (function, backend) with fp32 inputs under :data:`~lightning_cp.doctor._autocast.
    AUTOCAST` autocast (see the module docstring); a backend that cannot run here is a SKIP."""
    return _each_backend(device, [(torch.float32, AUTOCAST)])


def _each_backend(
    device: torch.device, dtypes: list[tuple[torch.dtype, torch.dtype | None]]
) -> list[CheckResult]:
    """One result per (function, backend, (inputs' dtype, autocast's or ``None``))."""
    results = []
    for function, impl, (dtype, low) in itertools.product(FUNCTIONS, IMPLS, dtypes):
        name = f"loss {function} {impl} {dtype_name(dtype)}" + (
            f" under {dtype_name(low)} autocast" if low else ""
        )
        reason = impl_unavailable(impl, device)
        if reason is not None:
            results.append(CheckResult(name, "SKIP", reason))
        else:
            results.append(run_check(name, _check, function, impl, device, dtype, low))
    return results


def _run(
    function: str,
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    upstream: Tensor,
    impl: str | None,
    low: torch.dtype | None = None,
) -> list[Tensor]:
    """The result and its gradients: the package's (``impl``), or (``None``) plain PyTorch's on materialized
    logits (fp32 softmax of the logits); the forward under ``low`` autocast when given, the backward outside."""
    hidden, weight = (t.detach().clone().requires_grad_() for t in (hidden, weight))
    with autocast(hidden.device, low):
        if impl is not None:
            fused = ops.linear_cross_entropy if function == "linear_cross_entropy" else ops.token_logprobs
            out = fused(hidden, weight, labels, chunk_size=CHUNK, impl=impl)
        else:
            logits = hidden @ weight.T
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
            if function == "linear_cross_entropy":
                out = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX)
            else:
                valid = labels != IGNORE_INDEX
                out = logits.log_softmax(-1).gather(1, labels.clamp(min=0)[:, None])[:, 0] * valid
    (out if function == "linear_cross_entropy" else (out * upstream).sum()).backward()
    return [out.detach(), hidden.grad, weight.grad]


def _check(
    name: str, function: str, impl: str, device: torch.device, dtype: torch.dtype, low: torch.dtype | None
) -> CheckResult:
    inputs = loss_inputs(dtype)
    reference = _run(function, inputs[0].double(), inputs[1].double(), inputs[2], inputs[3].double(), None)
    on_device = [t.to(device) for t in inputs]
    torchs = _run(function, *on_device, None, low)
    names = ("loss" if function == "linear_cross_entropy" else "logprobs", "dhidden", "dweight")
    if low is None:
        ours = _run(function, *on_device, impl)
        return compare(name, dtype, dict(zip(names, zip(ours, reference, torchs))))
    with MatmulDtypes(low) as matmuls:
        ours = _run(function, *on_device, impl, low)
    return matmuls.verdict(compare(name, low, dict(zip(names, zip(ours, reference, torchs)))))
