"""The Triton path: the cases of ``_triton_cases.py`` in fresh processes, and a CUDA comparison.

The interpreter run always happens, with ``TRITON_INTERPRET=1`` and CPU tensors: in this pytest process
Megatron-core has long imported Triton, and the interpreter must be switched on before Triton is first
imported, so the cases run in a subprocess that starts with the variable set. On a CUDA machine a second
subprocess, without the variable, runs them compiled on the GPU (the gloo cases skip there).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_cp.ops import (
    _engine,
    linear_cross_entropy_with_stats,
)
from tests.ops import _reference as ref
from tests.ops._reference import IGNORE, assert_close, upcast_leaves

_CASES = Path(__file__).with_name("_triton_cases.py")
_REPO = Path(__file__).resolve().parents[2]


def _cases_env(*, interpret: bool) -> dict[str, str]:
    """The environment of a run of the cases: the interpreter is on exactly when asked for, CUDA or not."""
    env = dict(os.environ)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    return env


def _run_cases(*, interpret: bool) -> None:
    pytest.importorskip("triton")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", str(_CASES), "-q", "-x", "-p", "no:cacheprovider"],
        check=False,
        cwd=_REPO,
        env=_cases_env(interpret=interpret),
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert result.returncode == 0, f"Triton cases failed:\n{result.stdout[-8000:]}\n{result.stderr[-4000:]}"


def test_triton_kernels_in_the_interpreter_match_the_reference():
    _run_cases(interpret=True)


@pytest.mark.gpu
def test_compiled_triton_kernels_on_cuda_match_the_reference():
    _run_cases(interpret=False)


def test_the_interpreter_run_interprets_on_a_cuda_machine(monkeypatch):
    # Its tensor-parallel cases hold CPU tensors on gloo workers: compiled Triton would refuse them.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert _cases_env(interpret=True)["TRITON_INTERPRET"] == "1"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "TRITON_INTERPRET" not in _cases_env(interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_torch_path_and_reference_on_cuda_at_a_realistic_size(dtype, monkeypatch):
    # Several 4096-wide tiles per row, 32 uneven chunks and, for bf16, 5 vocabulary blocks (the last
    # ragged) in the weight-gradient pass; compiled kernels against the torch path and the fp32 reference.
    monkeypatch.setattr(_engine, "_WEIGHT_BLOCK_BYTES", 2048 * 256 * 4)
    n, hidden_size, vocab = 4000, 256, 10_000
    options = {"label_smoothing": 0.1, "z_loss": 1e-3, "softcap": 15.0}
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, hidden_size, generator=g).to("cuda", dtype)
    weight = (torch.randn(vocab, hidden_size, generator=g) / hidden_size**0.5).to("cuda", dtype)
    labels = torch.randint(0, vocab, (n,), generator=g).cuda()
    labels[::7] = IGNORE
    results, correct = {}, {}
    for impl in ("torch", "triton"):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss, stats = linear_cross_entropy_with_stats(h, w, labels, chunk_size=128, impl=impl, **options)
        loss.backward()
        results[impl] = (loss, h.grad, w.grad, stats.nll, stats.entropy)
        correct[impl] = stats.correct
    assert (correct["triton"] != correct["torch"]).float().mean() < 1e-3  # bf16 near-ties may flip

    ref_hidden, ref_weight = upcast_leaves(hidden, weight)
    z = ref.head_logits(ref_hidden, ref_weight, options["softcap"])
    ref_loss = ref.cross_entropy(z, labels, label_smoothing=0.1, z_loss=1e-3)
    ref_loss.backward()
    stats = ref.token_stats(z, labels)
    expected = (ref_loss, ref_hidden.grad, ref_weight.grad, stats["nll"], stats["entropy"])
    for impl in ("torch", "triton"):
        for got, want in zip(results[impl], expected, strict=True):
            assert_close(got, want, dtype)
