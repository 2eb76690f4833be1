"""The Triton path: the cases of ``_triton_cases.py`` in a fresh process, and a CUDA comparison.

Without CUDA the kernels run in Triton's interpreter, which must be switched on (``TRITON_INTERPRET=1``)
before Triton is first imported; in this pytest process Megatron-core has long imported it, so the cases
run in a subprocess that starts with the variable set. With CUDA the same subprocess compiles them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_cp.ops import linear_cross_entropy
from tests.ops._reference import IGNORE, assert_close

_CASES = Path(__file__).with_name("_triton_cases.py")
_REPO = Path(__file__).resolve().parents[2]


def test_triton_kernels_match_the_reference():
    pytest.importorskip("triton")
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", str(_CASES), "-q", "-x", "-p", "no:cacheprovider"],
        cwd=_REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert result.returncode == 0, f"Triton cases failed:\n{result.stdout[-8000:]}\n{result.stderr[-4000:]}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_torch_path_on_cuda_at_a_realistic_width(dtype):
    # Several 4096-wide tiles per row and uneven chunks, compiled kernels against the torch path.
    n, hidden_size, vocab = 1000, 256, 10_000
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, hidden_size, generator=g).to("cuda", dtype)
    weight = (torch.randn(vocab, hidden_size, generator=g) / hidden_size**0.5).to("cuda", dtype)
    labels = torch.randint(0, vocab, (n,), generator=g).cuda()
    labels[::7] = IGNORE
    results = {}
    for impl in ("torch", "triton"):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss, stats = linear_cross_entropy(
            h,
            w,
            labels,
            chunk_size=300,
            impl=impl,
            return_stats=True,
            label_smoothing=0.1,
            z_loss=1e-3,
            softcap=15.0,
        )
        loss.backward()
        results[impl] = (loss, h.grad, w.grad, stats.nll, stats.entropy, stats.correct)
    for got, want in zip(results["triton"], results["torch"], strict=True):
        if got.dtype == torch.bool:
            assert (got != want).float().mean() < 1e-3  # bf16 near-ties may flip
        else:
            assert_close(got, want, dtype)
