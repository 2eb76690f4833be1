"""The benchmark scripts of ``benchmarks/`` and their shared modules (harness, probes, report), on CPU.

The scripts import their siblings by name (``from _probes import ...``), as ``python benchmarks/x.py``
puts ``benchmarks/`` first on ``sys.path``; the ``bench`` fixture imports them the same way.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lightning_cp.constants import IGNORE_INDEX

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
MIB = 2**20


@pytest.fixture(scope="module")
def bench() -> types.SimpleNamespace:
    """``_probes``, ``_harness``, ``_report``, ``loss_memory`` and ``attention``, imported as the scripts
    import them."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(BENCHMARKS))
        names = ("_probes", "_harness", "_report", "loss_memory", "attention")
        yield types.SimpleNamespace(**{name: importlib.import_module(name) for name in names})


# --------------------------------------------------------------------------------------------------
# _probes


def test_cuda_memory_budget_on_a_device_without_index_sets_the_current_devices_fraction(bench, monkeypatch):
    """``--device cuda`` reaches the worker as ``torch.device("cuda")``; torch's
    ``set_per_process_memory_fraction`` rejects a device without an index, so every CUDA case failed."""
    calls = []

    def set_per_process_memory_fraction(fraction, device=None):
        # The checks torch.cuda.memory.set_per_process_memory_fraction makes before the allocator.
        if isinstance(device, torch.device):
            if device.type != "cuda" or device.index is None:
                raise ValueError(
                    f"Expected a torch.device with a specified index or an integer, but got:{device}"
                )
            device = device.index
        if not isinstance(fraction, float) or not 0 <= fraction <= 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        calls.append((fraction, device))

    def get_device_properties(device):
        # Like the real one, it takes a device without index for the current device.
        assert device.type == "cuda" and (device.index is None or device.index == 1)
        return types.SimpleNamespace(total_memory=80 * 2**30)

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", get_device_properties)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", set_per_process_memory_fraction)

    bench._probes.set_memory_budget(torch.device("cuda"), 20 * 2**30)
    bench._probes.set_memory_budget(torch.device("cuda", 1), 200 * 2**30)

    assert calls == [(0.25, 1), (1.0, 1)]


def test_measure_reports_the_peak_above_the_start_minus_what_the_step_keeps(bench):
    """A step holding a 32 MiB scratch and an 8 MiB result at once, the result "retained" (like gradients
    are): 32 MiB in every repetition. Run in a worker's environment: under glibc's default mmap threshold
    the previous repetition's freed result often stays resident and hides 8 MiB of the next one."""
    script = (
        "import json, torch\n"
        "from _probes import MIB, measure\n"
        "def run():\n"
        "    scratch = torch.ones(32 * MIB // 4)\n"
        "    return scratch[: 8 * MIB // 4].clone()\n"
        "m, out = measure(run, torch.device('cpu'), warmup=1, repeat=4, retained=lambda: 8 * MIB)\n"
        "print(json.dumps({**m.summary(), 'out_bytes': out.nbytes}))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=BENCHMARKS,
        env={**os.environ, **bench._probes.CPU_WORKER_ENV, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout)

    assert summary["out_bytes"] == 8 * MIB
    assert len(summary["peak_extra_bytes_all"]) == len(summary["times_ms"]) == len(summary["cpu_ms_all"]) == 4
    for peak in summary["peak_extra_bytes_all"]:
        assert 31 * MIB < peak < 34 * MIB
    assert summary["peak_extra_bytes"] == max(summary["peak_extra_bytes_all"])


# --------------------------------------------------------------------------------------------------
# _report


def test_add_ratios_divides_by_the_baseline_on_the_same_shape(bench):
    ok = {"status": "ok"}
    rows = [
        {"case": "plain", "shape": "A", **ok, "peak_extra_bytes": 100, "time_ms": 10.0, "cpu_ms": 20.0},
        {"case": "x", "shape": "A", **ok, "peak_extra_bytes": 50, "time_ms": 30.0, "cpu_ms": 10.0},
        {"case": "plain", "shape": "B", "status": "OOM"},
        {"case": "x", "shape": "B", **ok, "peak_extra_bytes": 7, "time_ms": 1.0, "cpu_ms": 1.0},
        {"case": "y", "shape": "A", "status": "needs CUDA"},
    ]

    bench._report.add_ratios(rows, "plain")

    ratios = [(r["mem_ratio"], r["time_ratio"], r["cpu_ratio"]) for r in rows]
    assert ratios == [(1.0, 1.0, 1.0), (0.5, 3.0, 0.5), (None,) * 3, (None,) * 3, (None,) * 3]


def test_format_table_aligns_text_and_writes_markdown(bench):
    report = bench._report
    columns = [report.CASE, report.Column("peak extra MiB", "peak", ",.0f", scale=MIB), report.STATUS]
    rows = [
        {"case": "plain", "peak": 1536 * MIB, "status": "ok"},
        {"case": "liger_flce", "peak": None, "status": "needs CUDA"},
    ]

    assert report.format_table(rows, columns).splitlines() == [
        "case        peak extra MiB  status",
        "----------  --------------  ----------",
        "plain                1,536  ok",
        "liger_flce               -  needs CUDA",
    ]
    assert report.format_table(rows, columns, markdown=True).splitlines() == [
        "| case | peak extra MiB | status |",
        "| --- | ---: | --- |",
        "| plain | 1,536 | ok |",
        "| liger_flce | - | needs CUDA |",
    ]


# --------------------------------------------------------------------------------------------------
# _harness and the cases of loss_memory


def test_select_cases_takes_exact_names_with_brackets_and_shell_patterns(bench):
    select, cases = bench._harness.select_cases, bench.loss_memory._CASES

    assert [c.name for c in select(cases, ["torch_lce[rows]"])] == ["torch_lce[rows]"]
    assert [c.name for c in select(cases, ["ours_lce_*", "plain"])] == [
        "plain",
        "ours_lce_torch",
        "ours_lce_triton",
    ]
    with pytest.raises(SystemExit, match=r"--cases nope matches no case; the cases are: plain, "):
        select(cases, ["plain", "nope"])


def test_list_cases_says_why_the_cuda_peers_cannot_run(bench, capsys):
    bench.loss_memory.main(["--device", "cpu", "--list-cases", "--cases", "plain", "liger_flce", "cce"])
    lines = capsys.readouterr().out.splitlines()

    assert [line.split()[0] for line in lines] == ["plain", "liger_flce", "cce"]
    assert "not run" not in lines[0]
    assert lines[1].endswith("[not run on cpu: needs CUDA; liger-kernel not installed]")
    assert lines[2].endswith("[not run on cpu: needs CUDA; cut-cross-entropy not installed]")
    peers = {c.name: c for c in bench.loss_memory._CASES}
    assert peers["cce"].unavailable(torch.device("cuda")) == "cut-cross-entropy not installed"


def _fake_cce(e, c, targets, bias=None, ignore_index=IGNORE_INDEX, reduction="mean", impl="cce", **options):
    """cut_cross_entropy.linear_cross_entropy as its docs define it, with the shape checks it makes."""
    assert e.size()[:-1] == targets.size() and e.size(-1) == c.size(1) and bias is None
    return F.cross_entropy((e @ c.T).float(), targets, ignore_index=ignore_index, reduction=reduction)


class _FakeLigerLoss(torch.nn.Module):
    """liger_kernel.transformers.LigerFusedLinearCrossEntropyLoss as its docs define it."""

    def __init__(self, ignore_index: int = IGNORE_INDEX, reduction: str = "mean") -> None:
        super().__init__()
        self.ignore_index, self.reduction = ignore_index, reduction

    def forward(self, lin_weight, _input, target, bias=None):
        assert _input.size(0) == target.size(0) and _input.size(1) == lin_weight.size(1)
        logits = (_input @ lin_weight.T).float()
        return F.cross_entropy(logits, target, ignore_index=self.ignore_index, reduction=self.reduction)


def _check_case_against_full_logits(loss_memory, case, grad_scale: int = 1) -> None:
    """Build ``case`` on a small fp32 problem (3 chunks, some labels ignored), run forward + backward and
    compare the loss and both gradients to F.cross_entropy on the full logits."""
    p = loss_memory._make_problem(
        loss_memory.Shape(48, 80, 16), torch.float32, torch.device("cpu"), 3, 16, 16
    )
    assert (p.labels == IGNORE_INDEX).any()
    hidden, weight = p.hidden.detach().clone().requires_grad_(), p.weight.detach().clone().requires_grad_()
    expected = F.cross_entropy(hidden @ weight.T, p.labels, ignore_index=IGNORE_INDEX)
    expected.backward()

    with case.context():
        loss = case.build(p)()
        loss.backward()

    def msg(text: str) -> str:
        return f"{case.name}: {text}"

    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0, msg=msg)
    torch.testing.assert_close(p.hidden.grad * grad_scale, hidden.grad, rtol=1e-4, atol=1e-7, msg=msg)
    torch.testing.assert_close(p.weight.grad * grad_scale, weight.grad, rtol=1e-4, atol=1e-7, msg=msg)


def test_every_case_that_runs_on_cpu_computes_the_mean_cross_entropy_and_its_gradients(bench):
    checked = []
    for case in bench.loss_memory._CASES:
        if case.unavailable(torch.device("cpu")) is None:
            # cp_allgather's backward keeps this rank's share of the gathered rows' gradient; the peers'
            # shares, which a reduce-scatter would add, are not simulated.
            _check_case_against_full_logits(bench.loss_memory, case, 3 if case.name == "cp_allgather" else 1)
            checked.append(case.name)

    assert {"plain", "cp_allgather", "chunked_cat", "torch_lce[rows]", "megatron_vocab_ce"} <= set(checked)
    assert {"ours_lce_torch", "ours_ce", "ours_logprobs"} <= set(checked)


@pytest.mark.parametrize("name", ["liger_flce", "cce"])
def test_cuda_peers_get_hidden_weight_and_labels_in_their_apis_order(bench, monkeypatch, name):
    """The peers' builders, against stand-ins of their libraries (which need CUDA)."""
    fakes = {
        "cut_cross_entropy": {"linear_cross_entropy": _fake_cce},
        "liger_kernel": {},
        "liger_kernel.transformers": {"LigerFusedLinearCrossEntropyLoss": _FakeLigerLoss},
    }
    for module, attributes in fakes.items():
        fake = types.ModuleType(module)
        fake.__dict__.update(attributes)
        monkeypatch.setitem(sys.modules, module, fake)

    _check_case_against_full_logits(
        bench.loss_memory, next(c for c in bench.loss_memory._CASES if c.name == name)
    )


def test_quick_run_of_loss_memory_measures_each_case_with_plains_loss(bench, tmp_path):
    """``loss_memory.py --quick`` as a user runs it, on a few cases: the table has their rows, every
    measured loss is the cross-entropy of the problem, and the probes see plain's [N, V] logits."""
    cases = ["plain", "cce", "ours_lce_torch"]  # in the order of loss_memory._CASES
    measured = ["plain", "ours_lce_torch"]
    report = tmp_path / "loss_memory.json"
    pythonpath = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "loss_memory.py"), "--quick", "--device", "cpu"]
        + ["--max-mem-gib", "8", "--json", str(report), "--cases", *cases],
        env={**os.environ, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]

    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("case "))
    table = lines[header + 2 : lines.index("", header)]
    rows = {line.split()[0]: line for line in table}
    assert list(rows) == cases
    for case in measured:
        assert rows[case].startswith(f"{case} ") and rows[case].endswith("  ok"), rows[case]
    assert rows["cce"].endswith("needs CUDA; cut-cross-entropy not installed")

    results = {r["case"]: r for r in json.loads(report.read_text())["results"]}
    lm = bench.loss_memory
    shape = lm.Shape(512, 4096, 256)
    assert results["plain"]["shape"] == shape.label()
    p = lm._make_problem(shape, torch.float32, torch.device("cpu"), 2, 128, 128)
    with torch.no_grad():
        expected = F.cross_entropy(p.hidden @ p.weight.T, p.labels, ignore_index=IGNORE_INDEX).item()
    for case in measured:
        assert results[case]["loss"] == pytest.approx(expected, rel=1e-5), case
    logits_bytes = shape.tokens * shape.vocab * 4
    assert results["plain"]["peak_extra_bytes"] >= logits_bytes
    assert results["plain"]["mem_ratio"] == 1.0
    assert results["ours_lce_torch"]["peak_extra_bytes"] < logits_bytes


# --------------------------------------------------------------------------------------------------
# attention.py


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("layout", ["padded", "mixed"])
@pytest.mark.parametrize("rank", [0, 1])
def test_attention_cases_compute_the_rank_s_rows_of_full_attention(bench, layout, rank, window):
    """The simulated rank's outputs, by ours and by the previous implementation, are its rows of the ideal
    (whole-sequence) attention: the simulation gives each case the inputs a real CP rank would have."""
    attention = bench.attention
    shape = attention.Shape(tokens=66, layout=layout, cp=2, heads=4, kv_heads=2, head_dim=8, window=window)
    problem = attention._make_problem(shape, torch.float64, torch.device("cpu"), rank)
    assert len(problem.lengths) > 2 or layout == "padded"
    full = attention._build_ideal(problem)()[0].transpose(0, 1)  # [T, H, D]
    mine = problem.tokens
    valid = mine >= 0
    for build in (attention._build_ours, attention._build_previous):
        out = build(problem)()
        torch.testing.assert_close(out[valid], full[mine[valid]], rtol=1e-9, atol=1e-9)
