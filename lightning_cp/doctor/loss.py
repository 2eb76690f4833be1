"""Self-checks of the fused LM-head loss and log-probabilities against plain PyTorch on full logits.

For each backend (torch; Triton where :mod:`lightning_cp.ops` would run it) and dtype,
:func:`lightning_cp.ops.linear_cross_entropy` (loss, dL/dhidden, dL/dweight) is compared to
``F.cross_entropy`` on materialized logits, and :func:`lightning_cp.ops.token_logprobs` (log-probabilities
and the gradients of a weighted sum of them) to ``log_softmax``; references in float64 on the CPU. The
problem has three chunks (the last one partial), 10% ignored labels and a vocabulary wider than one Triton
tile.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_cp import ops
from lightning_cp.constants import IGNORE_INDEX
from lightning_cp.doctor._compare import CheckResult, compare, run_check
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
    results = []
    for function, impl, dtype in itertools.product(FUNCTIONS, IMPLS, dtypes):
        name = f"loss {function} {impl} {str(dtype).removeprefix('torch.')}"
        reason = impl_unavailable(impl, device)
        if reason is not None:
            results.append(CheckResult(name, "SKIP", reason))
        else:
            results.append(run_check(name, _check, function, impl, device, dtype))
    return results


def _plain(function: str, hidden: Tensor, weight: Tensor, labels: Tensor, upstream: Tensor) -> list[Tensor]:
    """The result and its gradients by plain PyTorch on materialized logits (fp32 softmax of the logits)."""
    hidden, weight = (t.detach().clone().requires_grad_() for t in (hidden, weight))
    logits = hidden @ weight.T
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if function == "linear_cross_entropy":
        out = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX)
        out.backward()
    else:
        valid = labels != IGNORE_INDEX
        out = logits.log_softmax(-1).gather(1, labels.clamp(min=0)[:, None])[:, 0] * valid
        (out * upstream).sum().backward()
    return [out.detach(), hidden.grad, weight.grad]


def _ours(
    function: str, hidden: Tensor, weight: Tensor, labels: Tensor, upstream: Tensor, impl: str
) -> list[Tensor]:
    hidden, weight = (t.detach().clone().requires_grad_() for t in (hidden, weight))
    if function == "linear_cross_entropy":
        out = ops.linear_cross_entropy(hidden, weight, labels, chunk_size=CHUNK, impl=impl)
        out.backward()
    else:
        out = ops.token_logprobs(hidden, weight, labels, chunk_size=CHUNK, impl=impl)
        (out * upstream).sum().backward()
    return [out.detach(), hidden.grad, weight.grad]


def _check(name: str, function: str, impl: str, device: torch.device, dtype: torch.dtype) -> CheckResult:
    inputs = loss_inputs(dtype)
    reference = _plain(function, inputs[0].double(), inputs[1].double(), inputs[2], inputs[3].double())
    on_device = [t.to(device) for t in inputs]
    torchs = _plain(function, *on_device)
    ours = _ours(function, *on_device, impl)
    value = "loss" if function == "linear_cross_entropy" else "logprobs"
    quantities = dict(zip((value, "dhidden", "dweight"), zip(ours, reference, torchs)))
    return compare(name, dtype, quantities)
