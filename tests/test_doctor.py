"""``lightning-cp doctor``: it runs and passes on a healthy install, and it fails when the code it checks is wrong.

The checks themselves compare to float64 references computed by plain PyTorch (SDPA, ``F.cross_entropy``,
``log_softmax``), so a check that cannot fail would be worthless: every family of checks is run here once
against a deliberately broken package (a wrong key index in the attention layout, 1% off key gradients, a
wrong label in the loss, 1% off log-probabilities) and must report FAIL, with exit status 1.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_cp import ops
from lightning_cp.cli import doctor
from lightning_cp.doctor import collectives
from lightning_cp.doctor._compare import MAX_TOLERANCE, CheckResult, compare, relative_error, tolerance
from lightning_cp.doctor.attention import attention_checks
from lightning_cp.doctor.loss import loss_checks
from lightning_cp.parallel import _varlen
from lightning_cp.parallel.exchange import GroupExchange
from lightning_cp.parallel.sharding import CPShard

CONSOLE_SCRIPT = Path(sys.executable).with_name("lightning-cp")
CPU = torch.device("cpu")
DTYPES = (torch.float32, torch.bfloat16)
_LINE = re.compile(r"^  (PASS|FAIL|SKIP)  (\S.*)$")


def _check_lines(out: str) -> dict[str, str]:
    """``{check name + detail: status}`` of every check line of the report."""
    return {m.group(2): m.group(1) for line in out.splitlines() if (m := _LINE.match(line))}


def test_doctor_runs_and_passes_on_this_machine():
    result = subprocess.run(
        [str(CONSOLE_SCRIPT), "doctor", "--device", "cpu"],
        # Triton's interpreter would run the Triton checks on the CPU: the counts below assume it is off.
        env={**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    for section in ("versions", "attention kernels", "devices", "kernels the package picks on cpu"):
        assert f"\n{section}\n" in out
    assert re.search(r"^  torch +" + re.escape(torch.__version__) + "$", out, re.MULTILINE)
    assert re.search(r"^  fused loss +impl='auto' -> torch; automatic chunk: \d+ tokens", out, re.MULTILINE)
    assert re.search(
        r"^  hybrid token mixers +head-parallel: .*\(transformers' torch kernels\)", out, re.MULTILINE
    )
    assert re.search(r"^  mamba-ssm \(Mamba2 scan\) +not installed$", out, re.MULTILINE)
    lines = _check_lines(out)
    statuses = list(lines.values())
    assert set(statuses) == {"PASS", "SKIP"}
    # 2 dtypes x (2 layouts x 2 CP sizes of attention + 2 loss functions x 2 backends), + collectives.
    assert len(lines) == 2 * (4 + 4) + 1
    assert statuses.count("PASS") == 2 * (4 + 2)  # Triton and the collectives need CUDA / torchrun here
    assert re.search(r"(\d+) passed, 0 failed, (\d+) skipped$", out.strip())


@pytest.fixture
def run_doctor(capsys):
    def run() -> tuple[int, dict[str, str]]:
        status = doctor.main(["--device", "cpu"])
        return status, _check_lines(capsys.readouterr().out)

    return run


@pytest.mark.gpu
def test_doctor_passes_on_the_gpu_with_flash_attention_and_triton(capsys):
    status = doctor.main(["--device", "cuda"])
    lines = _check_lines(capsys.readouterr().out)
    assert status == 0, lines
    assert {s for name, s in lines.items() if not name.startswith("collectives")} == {"PASS"}
    bf16_attention = [name for name in lines if name.startswith("attention") and "bfloat16" in name]
    assert len(bf16_attention) == 4 and all(name.endswith("[flash-varlen]") for name in bf16_attention)
    assert sum(name.startswith("loss linear_cross_entropy triton") for name in lines) == 2


def test_a_wrong_key_order_in_the_attention_layout_fails_the_attention_checks(run_doctor, monkeypatch):
    keys = CPShard.keys

    def shifted_keys(shard, window=None):  # every piece reads its keys one position late
        selection = keys(shard, window)
        return dataclasses.replace(selection, order=selection.order.roll(1))

    monkeypatch.setattr(CPShard, "keys", shifted_keys)
    status, lines = run_doctor()

    assert status == 1
    attention = {name: s for name, s in lines.items() if name.startswith("attention")}
    assert len(attention) == 8 and set(attention.values()) == {"FAIL"}
    assert {s for name, s in lines.items() if name.startswith("loss")} == {"PASS", "SKIP"}


def test_a_wrong_label_in_the_loss_fails_the_loss_checks(run_doctor, monkeypatch):
    fused = ops.linear_cross_entropy
    monkeypatch.setattr(
        ops, "linear_cross_entropy", lambda h, w, labels, **kw: fused(h, w, labels.roll(1), **kw)
    )
    status, lines = run_doctor()

    assert status == 1
    failed = {name.split("  ")[0] for name, s in lines.items() if s == "FAIL"}
    assert failed == {f"loss linear_cross_entropy torch {dtype}" for dtype in ("float32", "bfloat16")}


def test_a_one_percent_error_in_the_key_gradients_fails_in_every_dtype(monkeypatch):
    backward = _varlen.torch_backward

    def one_percent_off(*args, **kwargs):
        dq, dk, dv = backward(*args, **kwargs)
        return dq, dk * 1.01, dv

    monkeypatch.setattr(_varlen, "torch_backward", one_percent_off)
    results = attention_checks(CPU, DTYPES)
    assert [r.status for r in results] == ["FAIL"] * 8, [r.line() for r in results]
    assert all(r.detail.startswith("worst dk") for r in results)


def test_a_one_percent_error_in_the_log_probabilities_fails_in_every_dtype(monkeypatch):
    logprobs = ops.token_logprobs
    monkeypatch.setattr(ops, "token_logprobs", lambda *a, **kw: logprobs(*a, **kw) * 1.01)
    results = {r.name: r for r in loss_checks(CPU, DTYPES)}
    for dtype in ("float32", "bfloat16"):
        assert results[f"loss token_logprobs torch {dtype}"].status == "FAIL"
        assert results[f"loss linear_cross_entropy torch {dtype}"].status == "PASS"


def test_an_exception_in_a_check_is_its_fail_line(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no kernel image is available for execution on the device\nmore")

    monkeypatch.setattr(_varlen, "torch_forward", broken)
    result = attention_checks(CPU, (torch.float32,))[0]
    assert result.line() == (
        "FAIL  attention cp=2 padded gqa float32  "
        "RuntimeError: no kernel image is available for execution on the device"
    )


def test_tolerance_is_relative_to_torchs_own_error_and_never_above_one_percent():
    assert tolerance(torch.float32, 0.0) == pytest.approx(1e-5)
    assert tolerance(torch.bfloat16, 2e-3) == pytest.approx(5e-3)
    assert tolerance(torch.bfloat16, 0.2) == MAX_TOLERANCE == 1e-2
    want = torch.ones(100, dtype=torch.float64)
    assert relative_error(want * 1.01, want) == pytest.approx(1e-2)
    torchs = torch.full((100,), 1.005)  # PyTorch's own error 5e-3: 2x that + the floor is capped at 1%
    result = compare("x", torch.bfloat16, {"out": (want * 1.012, want, torchs)})
    assert result.status == "FAIL" and "rel err 1.2e-02 > tol 1.0e-02" in result.detail
    nan = compare("x", torch.float32, {"out": (want * float("nan"), want, want)})
    assert nan == CheckResult("x", "FAIL", "out is NaN")


# --------------------------------------------------------------------------------------------------
# torchrun: the real collectives (here on the shared gloo pools)


def _doctor_on_every_rank() -> int:
    return doctor.main(["--device", "cpu"])


def test_under_a_launcher_every_rank_checks_the_collectives_and_passes(world2):
    assert world2.run(_doctor_on_every_rank) == [0, 0]


def _collective_checks(break_reduce_scatter: bool) -> list[tuple[str, str]]:
    if not break_reduce_scatter:
        return [(r.name, r.status) for r in collectives.collective_checks(CPU, DTYPES)]
    original = GroupExchange.reduce_scatter

    def own_share_only(self, full):  # forgets to sum the other ranks' contributions
        size, rank = torch.distributed.get_world_size(self.group), torch.distributed.get_rank(self.group)
        rows = full.shape[0] // size
        return full[rank * rows : (rank + 1) * rows].clone()

    GroupExchange.reduce_scatter = own_share_only
    try:
        return [(r.name, r.status) for r in collectives.collective_checks(CPU, DTYPES)]
    finally:
        GroupExchange.reduce_scatter = original


def test_collective_checks_pass_on_four_ranks_and_fail_when_the_reduce_scatter_does_not_sum(world4):
    for results in world4.run(_collective_checks, False):
        assert [s for _, s in results] == ["PASS"] * 7
        assert results[0][0] == "process group gloo world=4"
    for results in world4.run(_collective_checks, True):
        statuses = dict(results)
        assert statuses["exchange all_gather"] == "PASS"
        assert statuses["exchange reduce_scatter"] == "FAIL"
        assert {s for name, s in results if name.startswith("attention")} == {"FAIL"}
