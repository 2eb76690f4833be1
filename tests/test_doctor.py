"""``lightning-cp doctor``: it runs and passes on a healthy install, and it fails when the code it checks is wrong.

The checks themselves compare to float64 references computed by plain PyTorch (SDPA, ``F.cross_entropy``,
``log_softmax``, the mixer layer on each document), so a check that cannot fail would be worthless: every
family of checks is run here once against a deliberately broken package (a wrong key index in the attention
layout, 1% off key gradients, an all-to-all that returns another rank's rows, a mode that silently runs
another exchange, attention that ignores autocast, a wrong label in the loss, 1% off log-probabilities, the
loss's gradient matmuls in fp32 under autocast, a sparse layer's keys one row late, a tiling that does not
tile, recomputes 1% off or outside autocast, a reduce-scatter that does not sum, an exchange that all-reduces
where the group reduce-scatters) and must report FAIL, with exit status 1. Under a launcher, a rank that fails
a check alone must not leave the others out of step: every rank reports and exits with the same status.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import os
import re
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from lightning_cp import ops
from lightning_cp.cli import doctor
from lightning_cp.doctor import _ranks, attention, collectives, sparse
from lightning_cp.doctor._compare import MAX_TOLERANCE, CheckResult, compare, relative_error, tolerance
from lightning_cp.doctor.attention import attention_checks, autocast_attention_checks
from lightning_cp.doctor.loss import autocast_loss_checks, loss_checks
from lightning_cp.doctor.mixers import mixer_checks
from lightning_cp.doctor.sparse import sparse_checks
from lightning_cp.doctor.tiling import tiling_checks
from lightning_cp.memory import tiling
from lightning_cp.ops import _plan
from lightning_cp.parallel import _key_selection, _varlen, key_indexer
from lightning_cp.parallel import attention as cp_attention
from lightning_cp.parallel.attention_mode import AttentionMode
from lightning_cp.parallel.exchange import GroupExchange

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
    assert re.search(
        r"^  fused loss +impl='auto' -> torch; automatic chunk of this process: \d+ tokens", out, re.MULTILINE
    )
    assert re.search(
        r"^  hybrid token mixers +head-parallel: .*\(transformers' torch kernels\)", out, re.MULTILINE
    )
    assert re.search(r"^  mamba-ssm \(Mamba2 scan\) +not installed$", out, re.MULTILINE)
    lines = _check_lines(out)
    statuses = list(lines.values())
    assert set(statuses) == {"PASS", "SKIP"}
    # 2 dtypes x (2 layouts x 5 (exchange, CP size) of attention + sparse attention + 2 loss functions x 2
    # backends), under autocast: attention and the 2 x 2 loss checks, 3 mixers in fp32, 2 tilings (fp32,
    # autocast), the collectives and cpu_offload's mixed-backend exchange.
    assert len(lines) == 2 * (10 + 1 + 4) + (1 + 4) + 3 + 2 + 2
    # Triton and the collectives need CUDA / torchrun here.
    assert statuses.count("PASS") == 2 * (10 + 1 + 2) + (1 + 2) + 3 + 2
    for mode, exchanges in attention.FORWARD_EXCHANGES.items():
        checked = [line for line in lines if line.startswith(f"attention {mode} cp=")]
        assert len(checked) == 4 * len(attention.SIMULATED[mode]) + (mode == "allgather")  # + autocast
        assert all(line.endswith(f"fwd: {', '.join(exchanges)}]") for line in checked)
    # No bf16 GEMM with an fp32 output on the CPU: the weight gradient's fp32 sum is an fp32 matmul there.
    autocast_loss = [
        line for line in lines if line.startswith("loss") and "autocast" in line and "PASS" in lines[line]
    ]
    assert len(autocast_loss) == 2 and all("float32 on bfloat16 values" in line for line in autocast_loss)
    assert sum(line.endswith("[mlp calls per layer: 3 fwd, 3 bwd]") for line in lines) == 1
    # The autocast tiling: the tiled projections' weight gradients are fp32 sums of bf16 products (one bf16 GEMM
    # into fp32 on CUDA; fp32 matmuls of bf16 values here), every other matmul bf16.
    tiling = [line for line in lines if line.startswith("tiling") and "autocast" in line]
    assert len(tiling) == 1
    assert re.search(r"\[matmul FLOPs: bfloat16 \d+%, float32 on bfloat16 values \d+%\]$", tiling[0])
    assert sum(line.endswith("[fwd: all_gather, all_gather]") for line in lines) == 2  # the indexer's, K/V's
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
    one_process = ("collectives", collectives.MIXED_CHECK)
    assert {s for name, s in lines.items() if not name.startswith(one_process)} == {"PASS"}
    bf16_attention = [name for name in lines if name.startswith("attention") and "bfloat16" in name]
    assert len(bf16_attention) == 11 and all("[flash-varlen; fwd: " in name for name in bf16_attention)
    assert sum(name.startswith("loss linear_cross_entropy triton") for name in lines) == 3
    # Under autocast the weight gradient is a bf16 GEMM summed in fp32 (torch.mm(..., out_dtype=float32)).
    autocast_loss = [name for name in lines if name.startswith("loss") and "autocast" in name]
    assert len(autocast_loss) == 4 and all("bfloat16 -> float32 out" in name for name in autocast_loss)


def test_a_wrong_key_order_in_the_attention_layout_fails_the_attention_checks(run_doctor, monkeypatch):
    select = _key_selection.select_keys

    def shifted_keys(*args):  # every piece reads its keys one position late
        selection = select(*args)
        return dataclasses.replace(selection, order=selection.order.roll(1))

    monkeypatch.setattr(_key_selection, "select_keys", shifted_keys)
    status, lines = run_doctor()

    assert status == 1
    attention = {name: s for name, s in lines.items() if name.startswith("attention")}
    assert len(attention) == 21 and set(attention.values()) == {"FAIL"}  # autocast's too
    assert {s for name, s in lines.items() if name.startswith("loss")} == {"PASS", "SKIP"}
    # No key selection in the mixers, the sparse layer (its own rows) or a model without CP (the tiled GPT).
    assert {s for name, s in lines.items() if name.startswith(("mixer", "sparse", "tiling"))} == {"PASS"}


def test_a_wrong_label_in_the_loss_fails_the_loss_checks(monkeypatch):
    fused = ops.linear_cross_entropy
    monkeypatch.setattr(
        ops, "linear_cross_entropy", lambda h, w, labels, **kw: fused(h, w, labels.roll(1), **kw)
    )
    failed = {r.name for r in loss_checks(CPU, DTYPES) if r.status == "FAIL"}
    assert failed == {f"loss linear_cross_entropy torch {dtype}" for dtype in ("float32", "bfloat16")}


def test_a_one_percent_error_in_the_key_gradients_fails_in_every_dtype(monkeypatch):
    backward = _varlen.torch_backward

    def one_percent_off(*args, **kwargs):
        dq, dk, dv = backward(*args, **kwargs)
        return dq, dk * 1.01, dv

    monkeypatch.setattr(_varlen, "torch_backward", one_percent_off)
    monkeypatch.setattr(attention, "SIMULATED", {"allgather": (2, 4)})  # every exchange runs this kernel
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
        "FAIL  attention allgather cp=2 padded gqa float32  "
        "RuntimeError: no kernel image is available for execution on the device"
    )


def test_an_all_to_all_that_returns_another_ranks_rows_fails_ulysses_and_the_mixers(monkeypatch):
    """The exchange the head-parallel layers use, broken: every rank gets the rows of the ranks in reverse
    order. The all-gathered attention does not use it and passes."""
    all_to_all = _ranks._CountingExchange.all_to_all
    monkeypatch.setattr(
        _ranks._CountingExchange, "all_to_all", lambda self, send: all_to_all(self, send).flip(0)
    )
    results = {r.name: r.status for r in attention_checks(CPU, (torch.float32,)) + mixer_checks(CPU)}

    assert {name: s for name, s in results.items() if "ulysses" in name or "mixer" in name} == {
        name: "FAIL" for name in results if "ulysses" in name or "mixer" in name
    }
    assert sum("ulysses" in name for name in results) == 4 and sum("mixer" in name for name in results) == 3
    assert {s for name, s in results.items() if "allgather" in name} == {"PASS"}


def test_a_mode_that_runs_another_exchange_fails_although_its_numbers_are_right(monkeypatch):
    """Ulysses that silently all-gathers computes the same numbers: the check names the exchange that ran."""
    monkeypatch.setattr(AttentionMode, "ulysses", lambda self, heads, kv_heads, cp: False)
    ranks = _ranks.SimulatedRanks(2)
    result = attention.check_attention("x", ranks, CPU, torch.float32, "packed", "ulysses")
    assert result == CheckResult("x", "FAIL", "fwd: all_gather; ulysses makes all_to_all, all_to_all")


def test_attention_that_ignores_autocast_fails_although_its_numbers_are_right(monkeypatch):
    """Attention computing fp32 inputs in fp32 under bf16 autocast is more exact than SDPA, and twice as large."""
    monkeypatch.setattr(cp_attention, "compute_dtype", lambda q, k, v: torch.float32)
    (result,) = autocast_attention_checks(CPU)
    assert result == CheckResult(
        "attention allgather cp=2 packed gqa float32 under bfloat16 autocast",
        "FAIL",
        "output in float32, SDPA's in bfloat16 [fwd: all_gather]",
    )


def test_the_loss_s_gradient_matmuls_in_fp32_under_autocast_fail_the_autocast_loss_checks(monkeypatch):
    """The loss before it kept autocast's dtype for the backward: the forward's matmul in bf16 (autocast's), the
    gradients' in fp32 (2/3 of the FLOPs; 3/4 for the log-probabilities, whose backward recomputes the logits)."""
    monkeypatch.setattr(_plan, "_autocast_dtype", lambda device, dtype: None)
    results = {r.name: r for r in autocast_loss_checks(CPU)}
    for function, share in (("linear_cross_entropy", "67%"), ("token_logprobs", "75%")):
        result = results[f"loss {function} torch float32 under bfloat16 autocast"]
        assert result.status == "FAIL" and result.detail.startswith(
            f"{share} of the matmul FLOPs ran in float32 (at most 1%) [matmul FLOPs: float32 {share}, bfloat16"
        ), result.detail
    assert {r.status for r in loss_checks(CPU, DTYPES)} == {"PASS", "SKIP"}  # no autocast, no change


def test_a_sparse_selection_one_row_late_fails_the_sparse_checks(monkeypatch):
    scores_of = key_indexer.indexer_scores

    def one_row_late(*args):
        scores = scores_of(*args)  # each key scored as the one before it: the selection a row late
        return torch.cat([scores[:, :1], scores[:, :-1]], dim=1)

    monkeypatch.setattr(key_indexer, "indexer_scores", one_row_late)
    assert [r.status for r in sparse_checks(CPU, DTYPES)] == ["FAIL", "FAIL"]


def test_the_sparse_check_s_draw_has_no_near_tie_at_any_top_k_th_score():
    """A tie there would leave the model's own selection arbitrary; the least gap is far above fp32 rounding."""
    index = sparse.indexer_inputs(attention.PACKED_CU[-1])
    gaps = []
    for a, b in itertools.pairwise(attention.PACKED_CU):
        q, w, k = index["iq"][0, :, a:b], index["iw"][0, :, a:b, 0], index["ik"][0, 0, a:b]
        scores = (w[:, :, None] * torch.relu(q.double() @ k.double().T * sparse.INDEX_SCALE)).sum(0)
        for i in range(sparse.TOPK, b - a):  # the queries with more earlier keys than TOPK
            ranked = scores[i, : i + 1].sort(descending=True).values
            gaps.append(float((ranked[sparse.TOPK - 1] - ranked[sparse.TOPK]) / ranked.abs().max()))
    assert len(gaps) > 100 and min(gaps) > 1e-4


def _recomputed(change):
    """``tiling._tiled`` whose backward recomputes each tile through ``change(forward, tiles)``."""
    tiled = tiling._tiled

    def recomputed(forward, *args, **kwargs):
        def changed(*tiles):
            return change(forward, tiles) if torch.is_grad_enabled() else forward(*tiles)

        return tiled(changed, *args, **kwargs)

    return recomputed


@pytest.mark.parametrize(
    ("broken", "failed"),
    [
        ("nothing tiled", {"float32": "mlp calls per layer: 1 fwd, 0 bwd; 3 tiles", "autocast": "mlp calls"}),
        ("recomputed 1% off", {"float32": "worst d", "autocast": "worst d"}),
        ("recomputed outside autocast", {"autocast": "ran in float32"}),
    ],
)
def test_a_tiling_that_does_not_tile_or_recomputes_otherwise_fails_the_tiling_checks(
    monkeypatch, broken, failed
):
    if broken == "nothing tiled":
        monkeypatch.setattr(tiling, "_tile", lambda found, *args: [name for name, _, _ in found])
    elif broken == "recomputed 1% off":
        monkeypatch.setattr(tiling, "_tiled", _recomputed(lambda forward, tiles: forward(*tiles) * 1.01))
    else:

        def in_fp32(forward, tiles):
            with torch.autocast("cpu", enabled=False):
                return forward(*(t.float() for t in tiles))

        monkeypatch.setattr(tiling, "_tiled", _recomputed(in_fp32))
    results = {("autocast" if "autocast" in r.name else "float32"): r for r in tiling_checks(CPU)}
    assert {kind for kind, r in results.items() if r.status == "FAIL"} == set(failed), results
    for kind, detail in failed.items():
        assert detail in results[kind].detail, results[kind]


def _two_exchanges(ranks: _ranks.SimulatedRanks, rank: int) -> torch.Tensor:
    """Rank ``r`` sends ``100 r + p`` to rank ``p``, then sends back ``10 x`` what it received: the second
    exchange depends on the first, as Ulysses' and the mixers' way back do."""
    exchange = ranks.exchange(rank)
    received = exchange.all_to_all(torch.tensor([[100.0 * rank + peer] for peer in range(ranks.cp)]))
    return exchange.all_to_all(10 * received)


def test_simulated_ranks_answer_chained_exchanges_as_a_real_group_would():
    ranks = _ranks.SimulatedRanks(3)
    results = ranks.run(lambda rank: _two_exchanges(ranks, rank))
    # Rank r first receives 100 p + r from every p, sends 10 x that back to p: rank r gets 10 (100 r + p).
    assert [t.flatten().tolist() for t in results] == [
        [10.0 * (100 * r + p) for p in range(3)] for r in range(3)
    ]
    assert ranks.calls == {rank: ["all_to_all", "all_to_all"] for rank in range(3)}


def test_simulated_ranks_that_make_different_exchanges_fail_instead_of_hanging():
    """What ranks that size their all-gather rounds from their own free memory would do to a real group."""
    ranks = _ranks.SimulatedRanks(2)

    def rounds(rank: int) -> list[torch.Tensor]:
        return [ranks.exchange(rank).all_gather(torch.ones(2)) for _ in range(rank + 1)]

    with pytest.raises(RuntimeError, match=r"rank 0: all_gather; rank 1: all_gather, all_gather"):
        ranks.run(rounds)


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


def _doctor(fail_local_on_rank_1: bool = False, fail_exchanges_on_rank_1: bool = False) -> tuple[int, str]:
    """``lightning-cp doctor`` on this rank, its local checks and the mixers' left out (``test_doctor_runs_...``
    and the simulated checks cover them), the collectives in fp32: its status and what it printed. Rank 1
    alone can fail a local check (``fail_local_on_rank_1``), and (``fail_exchanges_on_rank_1``) the padded
    check of ``allgather x2 rounds`` before its exchanges and the first all-to-all it makes (Ulysses, padded)
    in the middle, its peer waiting on that check's group at most until its timeout (10 s here)."""
    rank = torch.distributed.get_rank()
    with contextlib.ExitStack() as stack:
        patch = stack.enter_context(pytest.MonkeyPatch.context())
        failed = [CheckResult("loss x", "FAIL", "wrong on rank 1")]
        local = failed if fail_local_on_rank_1 and rank == 1 else []
        patch.setattr(doctor, "_local_checks", lambda device: local)
        patch.setattr(doctor, "DTYPES", (torch.float32,))
        patch.setattr(collectives, "mixer_names", lambda cp: {})
        if fail_exchanges_on_rank_1:  # long enough for a loaded machine to connect each check's group
            patch.setattr(collectives, "CHECK_TIMEOUT", timedelta(seconds=10))
        if fail_exchanges_on_rank_1 and rank == 1:
            inputs, all_to_all = attention.attention_inputs, _ranks._CountingExchange.all_to_all
            made, sent = [], []

            def failing_inputs(layout, dtype):  # the third attention check: allgather x2 rounds, padded
                made.append(layout)
                if len(made) == 3:
                    raise RuntimeError("out of memory on rank 1")
                return inputs(layout, dtype)

            def failing_all_to_all(self, send):  # the first all-to-all: Ulysses, padded
                sent.append(send)
                if len(sent) == 1:
                    raise RuntimeError("an error in the middle of the exchanges")
                return all_to_all(self, send)

            patch.setattr(attention, "attention_inputs", failing_inputs)
            patch.setattr(_ranks._CountingExchange, "all_to_all", failing_all_to_all)
        out = stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
        status = doctor.main(["--device", "cpu"])
    return status, out.getvalue()


def test_under_a_launcher_every_rank_checks_the_collectives_and_reports(world2):
    (status0, out0), (status1, out1) = world2.run(_doctor)

    assert (status0, status1) == (0, 0)
    lines = {name.split("  ")[0]: status for name, status in _check_lines(out0).items()}
    assert len(lines) == 4 + 3 * 2 + 1  # 3 exchanges x 2 layouts, cpu_offload's mixed backend (CUDA only)
    assert {name for name, status in lines.items() if status != "PASS"} == {collectives.MIXED_CHECK}
    assert re.search(r"^  fused loss .* automatic chunk of this process \(rank 0\): ", out0, re.MULTILINE)
    assert out0.endswith("rank 0 of 2: 0 of its 11 checks failed; exit status 0\n")
    assert out1 == "rank 1 of 2: 0 of its 11 checks failed; exit status 0\n"  # rank 0 prints the report


def test_a_check_that_fails_on_one_rank_only_fails_the_doctor_on_every_rank(world2):
    (status0, out0), (status1, out1) = world2.run(_doctor, True)

    assert (status0, status1) == (1, 1)
    assert set(_check_lines(out0).values()) == {"PASS", "SKIP"}  # rank 0's own lines
    assert "\n  rank 1: FAIL  loss x  wrong on rank 1\n" in out0
    assert out0.endswith("rank 0 of 2: 0 of its 11 checks failed; exit status 1\n")
    assert out1 == "rank 1 of 2: 1 of its 12 checks failed; exit status 1\n"


def test_one_ranks_failure_leaves_the_others_in_step_and_every_rank_reports_it(world2):
    (status0, out0), (status1, out1) = world2.run(_doctor, True, True)

    assert (status0, status1) == (1, 1)
    lines = {name.split("  ")[0]: status for name, status in _check_lines(out0).items()}
    rank1 = [line for line in out0.splitlines() if line.startswith("  rank 1: FAIL")]
    assert rank1.pop(0) == "  rank 1: FAIL  loss x  wrong on rank 1"  # a failure of rank 1's alone
    failed = {
        "attention allgather x2 rounds cp=2 padded gqa float32 across the group",
        "attention ulysses cp=2 padded gqa float32 across the group",
    }
    # Rank 0 fails the same two checks (its peer did not come, or left), and passes every other one.
    assert {name for name, status in lines.items() if status == "FAIL"} == failed
    assert {status for name, status in lines.items() if name not in failed | {collectives.MIXED_CHECK}} == {
        "PASS"
    }
    assert "rank(s) [1] of the group failed before the exchanges" in out0
    assert len(rank1) == 2 and "out of memory on rank 1" in rank1[0] and "in the middle" in rank1[1]
    assert out1 == "rank 1 of 2: 3 of its 12 checks failed; exit status 1\n"


def _collective_checks() -> list[tuple[str, str]]:
    """The collective checks in fp32 with a reduce-scatter that forgets to sum the other ranks' contributions."""
    original = GroupExchange.reduce_scatter

    def own_share_only(self, full):
        size, rank = torch.distributed.get_world_size(self.group), torch.distributed.get_rank(self.group)
        rows = full.shape[0] // size
        return full[rank * rows : (rank + 1) * rows].clone()

    GroupExchange.reduce_scatter = own_share_only
    try:
        return [(r.name, r.status) for r in collectives.collective_checks(CPU, (torch.float32,))]
    finally:
        GroupExchange.reduce_scatter = original


def test_on_four_ranks_a_reduce_scatter_that_does_not_sum_fails_the_all_gathered_attention_only(world4):
    """Ulysses (its two key/value heads replicated over 4 ranks) and the mixers' all-to-all pass across the
    real group; every check that needs the reduce-scatter fails."""
    for results in world4.run(_collective_checks):
        statuses = dict(results)
        assert results[0] == ("process group gloo world=4", "PASS")
        assert statuses["exchange all_gather"] == "PASS"
        assert statuses["exchange reduce_scatter"] == "FAIL"
        for name, status in results[4:-1]:
            assert status == ("FAIL" if name.startswith("attention allgather") else "PASS"), name
        assert results[-1] == (collectives.MIXED_CHECK, "SKIP")  # no CUDA here
        assert len(results) == 4 + 6 + 3 + 1


def _exchange_backends(backends: dict[str, str]) -> CheckResult:
    """cpu_offload's check on a ``cpu:gloo`` group of the gloo pool, told that the group's backend per device
    is ``backends``."""
    return collectives.in_step("x", collectives.check_backends, CPU, backends, backend="cpu:gloo")


def test_the_exchange_over_a_gloo_group_sums_and_agrees_on_the_host(world2):
    for result in world2.run(_exchange_backends, {"cpu": "gloo"}):
        assert result.status == "PASS" and result.detail.endswith("; agreement on cpu (gloo): min 10")
        assert result.detail.startswith("cpu (gloo): all-gather, ")  # the reduce-scatter as gloo runs it


def test_an_exchange_that_all_reduces_where_the_group_s_backend_is_nccl_fails(world2):
    """What the exchange did on cpu_offload's ``cpu:gloo,cuda:nccl`` groups before it read their backend per
    device (twice the bytes). A gloo group stands for one here: its exchange all-reduces (the package's choice
    for gloo) and the check is told the group's CPU backend is NCCL."""
    for result in world2.run(_exchange_backends, {"cpu": "nccl"}):
        assert result == CheckResult(
            "x",
            "FAIL",
            "wrong: all-reduce where the cpu backend is nccl; "
            "cpu (nccl): all-gather, all-reduce; agreement on cpu (nccl): min 10",
        )
