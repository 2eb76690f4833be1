"""Under ``bf16-mixed`` with DDP (autocast over fp32 weights), every matmul of the fused loss runs in bf16.

Autocast casts the forward's logits matmul, but not the gradient matmuls (``torch.mm(..., out=)``,
``addmm_``), and the backward runs outside autocast: the head's gradients then took two fp32 matmuls of the
three, 2-3x slower on a GPU. The dispatcher records every matmul's input dtype and FLOPs here, on the CPU;
the fp32 sum of bf16 products (``torch.mm(..., out_dtype=torch.float32)``, CUDA only) is stood in for by a
function that records its inputs' dtype.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from lightning_cp import products
from lightning_cp.ops import linear_cross_entropy, token_logprobs

_MATMULS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_}


class _MatmulFlops(TorchDispatchMode):
    """FLOPs of every matmul dispatched, by the dtype of its inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.flops: Counter[torch.dtype] = Counter()

    def count(self, a: torch.Tensor, b: torch.Tensor) -> None:
        self.flops[a.dtype] += 2 * a.shape[0] * a.shape[1] * b.shape[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in _MATMULS:
            a, b = args[-2:] if func.overloadpacket is not torch.ops.aten.mm else args[:2]
            self.count(a, b)
        return func(*args, **(kwargs or {}))


def _fp32_product_recorded(recorder: _MatmulFlops):
    def add_fp32_product(acc, a, b):  # the CUDA kernel: a GEMM of a's dtype summed in fp32
        recorder.count(a, b)
        with _disable_current_modes():
            acc.add_(torch.mm(a.float(), b.float()))

    return add_fp32_product


@pytest.mark.parametrize("loss", ["cross_entropy", "logprobs"])
def test_every_matmul_of_the_loss_runs_in_autocast_s_dtype(monkeypatch, loss):
    recorder = _MatmulFlops()
    monkeypatch.setattr(products, "add_product", _fp32_product_recorded(recorder))
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(96, 32, generator=g).requires_grad_()
    weight = (0.3 * torch.randn(80, 32, generator=g)).requires_grad_()
    labels = torch.randint(0, 80, (96,), generator=g)
    with recorder:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if loss == "cross_entropy":
                out = linear_cross_entropy(hidden, weight, labels, chunk_size=32)
            else:
                out = token_logprobs(hidden, weight, labels, chunk_size=32).sum()
        out.backward()
    total = sum(recorder.flops.values())
    assert recorder.flops[torch.float32] <= 0.01 * total, dict(recorder.flops)
    # The gradients are those of the fp32 loss within bf16's rounding, and come back in the inputs' dtype.
    reference_hidden, reference_weight = (t.detach().clone().requires_grad_() for t in (hidden, weight))
    logits = reference_hidden @ reference_weight.T
    if loss == "cross_entropy":
        torch.nn.functional.cross_entropy(logits, labels).backward()
    else:
        logits.log_softmax(-1).gather(1, labels[:, None]).sum().backward()
    for got, want in ((hidden.grad, reference_hidden.grad), (weight.grad, reference_weight.grad)):
        assert got.dtype == torch.float32
        assert ((got - want).norm() / want.norm()).item() < 2e-2
