"""The benchmark scripts of ``benchmarks/`` and their shared modules (harness, probes, report), on CPU.

The scripts import their siblings by name (``from _probes import ...``), as ``python benchmarks/x.py``
puts ``benchmarks/`` first on ``sys.path``; the ``bench`` fixture imports them the same way. A script's
``main`` runs in the test's process (:func:`_main`): none starts a process group there, each measures in
workers or ranks of its own, and a second start of torch and Lightning per run is saved.
"""

from __future__ import annotations

import importlib
import itertools
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lightning_cp.constants import IGNORE_INDEX

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
MIB = 2**20


@pytest.fixture(scope="module")
def bench() -> types.SimpleNamespace:
    """``_probes``, ``_harness``, ``_report`` and the benchmark scripts, imported as the scripts import them."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(BENCHMARKS))
        names = (
            "_probes",
            "_harness",
            "_report",
            "_section_base",
            "_loss_section",
            "_layer_section",
            "_hybrid_section",
            "_indexer_section",
            "_sections",
            "loss_memory",
            "attention",
            "hf_llama",
            "fsdp_step",
            "gpu_report",
            "activation_memory",
            "load_memory",
        )
        yield types.SimpleNamespace(**{name: importlib.import_module(name) for name in names})


def _worker_env() -> dict[str, str]:
    """The environment of a script's workers and ranks: the package importable, one thread per process."""
    pythonpath = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {"PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1"}


@pytest.fixture
def run_main(bench, monkeypatch):
    """``run_main(script, *args)``: ``python benchmarks/<script>.py ARGS``, the script's ``main`` reading
    ``sys.argv`` in this process (what it returns); its workers and ranks start as the script starts them,
    in :func:`_worker_env`."""
    for name, value in _worker_env().items():
        monkeypatch.setenv(name, value)

    def run(script: str, *args: str) -> Any:
        module = getattr(bench, script)
        monkeypatch.setattr(sys, "argv", [module.__file__, *args])
        return module.main()

    return run


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
    assert {"ours_lce_torch", "ours_ce", "ours_logprobs", "ours_logprobs_entropy"} <= set(checked)


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


def test_quick_run_of_loss_memory_measures_each_case_with_plains_loss(bench, run_main, tmp_path, capsys):
    """``loss_memory.py --quick`` as a user runs it, on a few cases: the table has their rows, every
    measured loss is the cross-entropy of the problem, and the probes see plain's [N, V] logits."""
    cases = ["plain", "cce", "ours_lce_torch"]  # in the order of loss_memory._CASES
    measured = ["plain", "ours_lce_torch"]
    report = tmp_path / "loss_memory.json"
    run_main(
        "loss_memory",
        "--quick",
        "--device",
        "cpu",
        "--max-mem-gib",
        "8",
        "--json",
        str(report),
        "--cases",
        *cases,
    )

    lines = capsys.readouterr().out.splitlines()
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


def test_the_worker_reports_the_chunk_ours_used_in_the_run_not_one_asked_again(bench, monkeypatch):
    """On CUDA the automatic chunk follows the free memory, which changes between calls: here each call of
    the sizing gives another chunk (64, then 96, then 200 for any later call), and the row reports the
    chunks the two timed runs used (64 and 96), its 1-chunk reference the larger."""
    from lightning_cp.ops import _plan

    sizes = iter([64, 96, 200, 200])
    monkeypatch.setattr(_plan, "auto_chunk_size", lambda *args, **kwargs: next(sizes))
    monkeypatch.setattr(bench.loss_memory, "set_memory_budget", lambda device, budget: None)
    spec = {
        "case": "ours_lce_torch",
        "shape": {"tokens": 300, "vocab": 512, "hidden": 32},
        "dtype": "fp32",
        "device": "cpu",
        "cp": 2,
        "chunk_size": None,
        "chunk_rows": 128,
        "warmup": 0,
        "repeat": 2,
        "max_mem_gib": 8,
    }
    result = bench.loss_memory._measure(spec)

    assert result["status"] == "ok"
    assert (result["chunk_used"], result["chunks_used"]) == (96, [64, 96])
    assert vars(_plan.Plan)["build"].__func__.__name__ == "build"  # the recording is undone


def test_the_loss_section_runs_ours_at_the_chunk_the_plan_picks_and_at_ligers(bench):
    """Qwen3-8B at 32K tokens on one 80 GB GPU: the plan lowers the loss's chunk to its minimum, 1024 tokens,
    and budgets two fp32 [chunk, V] blocks for it besides its input and gradients; Liger's chunk is
    next_pow2(ceil(N / ceil(V / H))) (its docs' example: 16384 x 32000 x 4096 gives 2048). One run of ours
    when the chunks agree, two when they differ."""
    section = bench._loss_section
    targets, shape = section.planned_loss()

    assert shape == (32768, 151936, 4096)
    assert (targets.plan_chunk, targets.liger_chunk) == (1024, 1024)
    assert targets.planned_bytes == 2 * 4 * 1024 * 151936
    assert section.liger_chunk(16384, 32000, 4096) == 2048
    assert section.liger_chunk(1000, 4096, 4096) == 1000  # at most N
    commands = section.loss_commands(targets, shape)
    assert [argv[argv.index("--cases") + 1 :] for argv in commands] == [["ours_lce"], ["liger_flce", "cce"]]
    assert commands[0][commands[0].index("--chunk-size") + 1] == "1024"
    assert commands[0][commands[0].index("--tokens") : commands[0].index("--tokens") + 6] == [
        "--tokens",
        "32768",
        "--vocab",
        "151936",
        "--hidden",
        "4096",
    ]
    apart = section.loss_commands(section.LossTargets(2048, 1024, 0), shape)
    assert [argv[argv.index("--chunk-size") + 1] for argv in apart[:2]] == ["1024", "2048"]


def _loss_row(case: str, time_ms: float, extra_mib: float, status: str = "ok") -> dict:
    return {
        "case": case,
        "shape": "32768x151936x4096",
        "tokens": 32768,
        "vocab": 151936,
        "hidden": 4096,
        "status": status,
        "time_ms": time_ms,
        "peak_extra_bytes": extra_mib * MIB,
    }


@pytest.mark.parametrize(
    ("change", "missed"),
    [
        ({}, None),
        ({"plan_time": 160.0}, "ours_lce@2048 32768x151936x4096: time_target FAIL 1.60 <= 1.5"),
        ({"plan_extra": 1110.0}, "ours_lce@2048 32768x151936x4096: plan_target FAIL 1.11 <= 1.1"),
        ({"liger_extra": 310.0}, "ours_lce@1024 32768x151936x4096: liger_memory_target FAIL 1.03 <= 1"),
    ],
)
def test_the_loss_targets_are_time_at_the_plans_chunk_its_budget_and_ligers_memory_at_ligers_chunk(
    bench, change, missed
):
    """Ours at the plan's chunk (2048 here): time over the faster peer (Liger, 100 ms) at most 1.5, extra memory
    over the plan's 1,000 MiB at most 1.1; ours at Liger's chunk (1024): extra memory over Liger's at most 1.
    CCE's memory is a ratio on ours' rows, never a target. Each target fails alone just over its limit."""
    section = bench._loss_section
    values = {"plan_time": 140.0, "plan_extra": 1050.0, "liger_extra": 290.0, **change}
    rows = [
        _loss_row("ours_lce@2048", values["plan_time"], values["plan_extra"]),
        _loss_row("ours_lce@1024", 200.0, values["liger_extra"]),
        _loss_row("liger_flce", 100.0, 300.0),
        _loss_row("cce", 120.0, 2.0),
    ]
    targets = section.LossTargets(plan_chunk=2048, liger_chunk=1024, planned_bytes=1000 * MIB)
    section.add_loss_figures(rows, targets)
    plan_row, liger_row = rows[0], rows[1]

    assert plan_row["x_best_peer"] == pytest.approx(values["plan_time"] / 100.0)
    assert plan_row["x_cce_memory"] == pytest.approx(values["plan_extra"] / 2.0)
    assert "liger_memory_target" not in plan_row and "time_target" not in liger_row
    assert not any(key.endswith("target") for row in rows[2:] for key in row)
    judged = section.targets_verdict(rows, ["ours_lce@1024", "ours_lce@2048"], section.TARGET_KEYS, "ours")
    if missed is None:
        assert judged.status == "PASS", judged.summary
        assert judged.summary.count("PASS") == 3
    else:
        assert (judged.status, judged.summary) == ("FAIL", f"ours: {missed}")


def test_without_peers_the_loss_section_still_judges_ours_against_the_plan(bench):
    section = bench._loss_section
    rows = [
        _loss_row("ours_lce@1024", 100.0, 900.0),
        _loss_row("cce", 0.0, 0.0, "cut-cross-entropy not installed"),
    ]
    section.add_loss_figures(rows, section.LossTargets(1024, 1024, 1000 * MIB))

    assert rows[0]["x_best_peer"] is None and rows[0]["time_target"] is None
    assert rows[0]["plan_target"] == "PASS 0.90 <= 1.1" and rows[0]["liger_memory_target"] is None
    judged = section.targets_verdict(rows, ["ours_lce@1024"], section.TARGET_KEYS, "ours")
    assert (judged.status, judged.summary) == ("PASS", "ours: plan_target PASS 0.90 <= 1.1")
    nothing = section.targets_verdict(rows[1:], ["liger_flce"], section.TARGET_KEYS, "x")
    assert nothing.status == "FAIL"  # a case that did not run is not a pass


# --------------------------------------------------------------------------------------------------
# the layers section


_TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 64,
    "num_hidden_layers": 2,
}


def test_the_layer_section_takes_the_plans_layouts_for_one_and_eight_gpus_and_one_layers_term(bench):
    """Llama-3.1-8B at 1M: on eight GPUs the first layout that fits 80 GB; on one none fits, so the one with the
    smallest peak. Both checkpoint. The term of one layer is the model's recompute term less the previous
    layer's input, which a one-layer model has none to prefetch: T x d bf16 under FSDP."""
    from lightning_cp.plan import ModelShape, estimate, plan

    section = bench._layer_section
    shape = ModelShape.from_hf_config(json.loads(section.LAYER_MODEL.read_text()))
    one, eight = section.planned_layouts(shape)

    gpu = section.LAYER_GPU_BYTES
    assert next(c for c in plan(shape, 2**20, 8) if c.fits(gpu)) == eight
    assert not any(c.fits(gpu) for c in plan(shape, 2**20, 1))
    assert one.estimate.peak == min(c.estimate.peak for c in plan(shape, 2**20, 1))
    assert one.layout.checkpointing and one.layout.offload and eight.layout.checkpointing
    tokens = 65536
    term, planned = section.planned_layer_term(shape, one.layout, tokens)
    whole = estimate(shape, tokens * one.layout.cp, one.layout).recompute
    assert term == "recompute" and planned == whole - tokens * shape.hidden * 2


def test_one_layer_of_a_planned_layout_runs_as_one_rank_with_the_layouts_savings(bench):
    """On the CPU in fp32 (no peak to read): the one-GPU layout's savings (checkpointing, offload, tiling) give
    the plain layer's input gradient, and offload moves the layer's input; Ulysses at cp 2 runs one rank."""
    from lightning_cp.plan import Layout

    section, cpu, tokens = bench._layer_section, torch.device("cpu"), 512
    plain, expected = section.layer_rank(_TINY_LLAMA, Layout(1, 1), tokens, cpu, torch.float32)
    saving = Layout(1, 1, fsdp=True, checkpointing=True, offload=True, tiled=True, cpu_offload=True)
    row, grad = section.layer_rank(_TINY_LLAMA, saving, tokens, cpu, torch.float32)

    torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6)
    assert row["peak_bytes"] is None and plain["offloaded_bytes"] == 0
    assert row["offloaded_bytes"] == tokens * 64 * 4
    assert plain["tiled_modules"] == 0 and row["tiled_modules"] >= 3  # the MLP, the norms, the projections
    ulysses = Layout(2, 2, fsdp=True, checkpointing=True, offload=True, attention="ulysses")
    row, grad = section.layer_rank(_TINY_LLAMA, ulysses, tokens, cpu, torch.float32)
    assert grad.shape == (1, tokens, 64) and torch.isfinite(grad).all() and row["layout"] == ulysses.name()


def test_the_layer_section_fails_a_layout_over_its_term_and_names_the_term(bench):
    section = bench._layer_section

    def row(layout: str, peak_mib: float) -> dict:
        return {
            "layout": layout,
            "term": "recompute",
            "peak_bytes": peak_mib * MIB,
            "planned_bytes": 1000 * MIB,
        }

    within, over = row("a", 1100), row("b", 1101)
    for judged in (within, over):
        section.judge_layer(judged)

    assert (within["status"], within["target"]) == ("PASS", "PASS 1.10 <= 1.1")
    assert over["status"] == "FAIL: recompute 1,101 MiB measured, 1,000 MiB planned"
    assert section.layers_verdict([within]) == bench._section_base.Section(
        "PASS", "a: recompute PASS 1.10 <= 1.1"
    )
    crashed = {"layout": "c", "term": "recompute", "status": "FAIL: OutOfMemoryError: ..."}
    verdict = section.layers_verdict([within, over, crashed])
    assert verdict.status == "FAIL"
    assert verdict.summary == f"b: {over['status']}; c: FAIL: OutOfMemoryError: ..."


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


def _fake_flash_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None, causal=False
):
    """flash_attn_varlen_func as FlashAttention documents it: token-major pieces, K/V heads shared by groups
    of query heads, the causal mask aligned to the bottom right of every piece; an explicit-mask softmax."""
    assert causal and q.dim() == k.dim() == 3 and q.shape[1] % k.shape[1] == 0
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    assert max(b - a for a, b in itertools.pairwise(bounds_q)) == max_seqlen_q
    assert max(b - a for a, b in itertools.pairwise(bounds_k)) == max_seqlen_k
    group, scale = q.shape[1] // k.shape[1], softmax_scale or q.shape[-1] ** -0.5
    out = []
    for (q0, q1), (k0, k1) in zip(itertools.pairwise(bounds_q), itertools.pairwise(bounds_k)):
        keys, values = (t[k0:k1].repeat_interleave(group, dim=1) for t in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1], keys) * scale
        visible = torch.arange(k1 - k0)[None] <= torch.arange(q1 - q0)[:, None] + (k1 - k0) - (q1 - q0)
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out.append(torch.einsum("hqk,khd->qhd", probs, values))
    return torch.cat(out)


@pytest.mark.parametrize("name", ["fa2", "fa3", "fa4"])
def test_flash_peers_get_the_pieces_of_the_gathered_keys_in_their_apis_order(bench, monkeypatch, name):
    """The peers' builders, against a stand-in of ``flash_attn_varlen_func`` (they need CUDA): the rank's
    rows of full attention. FlashAttention-3 returns ``(out, lse)`` in some versions."""
    attention = bench.attention
    module = attention._FLASH_PEERS[name][0]
    fake = types.ModuleType(module)
    fake.flash_attn_varlen_func = (
        (lambda *a, **kw: (_fake_flash_varlen(*a, **kw), None)) if name == "fa3" else _fake_flash_varlen
    )
    monkeypatch.setitem(sys.modules, module, fake)
    shape = attention.Shape(tokens=66, layout="mixed", cp=2, heads=4, kv_heads=2, head_dim=8)
    problem = attention._make_problem(shape, torch.float64, torch.device("cpu"), 1)
    full = attention._build_ideal(problem)()[0].transpose(0, 1)
    out = next(c for c in attention._CASES if c.name == name).build(problem)()
    valid = problem.tokens >= 0
    torch.testing.assert_close(out[valid], full[problem.tokens[valid]], rtol=1e-9, atol=1e-9)


def test_the_ideal_is_measured_once_per_layout_and_length_and_shared_by_every_cp(run_main, tmp_path):
    report = tmp_path / "attention.json"
    run_main(
        "attention",
        "--device",
        "cpu",
        "--tokens",
        "256",
        "--cp",
        "2",
        "4",
        "--layouts",
        "padded",
        "--cases",
        "ideal",
        "--repeat",
        "1",
        "--warmup",
        "0",
        "--json",
        str(report),
    )
    rows = json.loads(report.read_text())["results"]
    assert [(r["shape"], r["cp"]) for r in rows] == [("padded T=256 cp=2", 2), ("padded T=256 cp=4", 4)]
    assert rows[0]["times_ms"] == rows[1]["times_ms"]
    assert rows[1]["ideal_share_ms"] == pytest.approx(rows[0]["ideal_share_ms"] / 2)


def test_hf_llama_cases_compute_the_same_loss_and_gradients(bench, monkeypatch):
    """ours (lightning_cp attention + fused loss) and HF's own labels= loss on sdpa attention, the second
    with a no-op stand-in of Liger's patch (Liger needs CUDA): one model, one loss, the same gradients."""
    patched = []
    liger = types.ModuleType("liger_kernel.transformers")
    liger.apply_liger_kernel_to_llama = lambda model=None, **options: patched.append(model)
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", liger)
    hf = bench.hf_llama
    results = []
    for case in hf._CASES:
        problem = hf._make_problem(bench._harness.ModelShape("tiny", 64), torch.float32, torch.device("cpu"))
        loss = case.build(problem)()
        loss.backward()
        results.append((loss.detach(), problem.model.get_input_embeddings().weight.grad))
        assert problem.model.config._attn_implementation == (
            "lightning_cp" if case.name == "ours" else "sdpa"
        )
    assert [type(m).__name__ for m in patched] == ["LlamaForCausalLM"]
    (ours_loss, ours_grad), (hf_loss, hf_grad) = results
    torch.testing.assert_close(hf_loss, ours_loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(hf_grad, ours_grad, rtol=1e-4, atol=1e-7)


# --------------------------------------------------------------------------------------------------
# gpu_report.py and its sections


def _summary_table(text: str) -> dict[str, tuple[str, str]]:
    """``{section: (status, summary)}`` of the report's first table."""
    block = text[text.index("| section | status |") :].split("\n\n")[0]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in block.splitlines()[2:]]
    return {row[0]: (row[1], row[3]) for row in rows}


def test_gpu_report_on_the_cpu_runs_the_doctor_and_says_why_every_other_section_is_skipped(
    bench, run_main, tmp_path
):
    output = tmp_path / "report.md"
    assert run_main("gpu_report", "--device", "cpu", "--budget", "900", "--output", str(output)) == 0
    text = output.read_text()
    assert text.startswith("# lightning-cp GPU report") and f"- torch: {torch.__version__}" in text
    table = _summary_table(text)

    assert list(table) == list(bench._sections.SECTIONS)
    status, summary = table.pop("doctor")
    assert status == "PASS" and re.fullmatch(r"\d+ passed, 0 failed, \d+ skipped", summary)
    assert "PASS  attention ulysses cp=4 packed gqa bfloat16" in text  # the doctor's output, in its section
    for name, (status, summary) in table.items():
        assert status == "SKIP" and summary.startswith("no CUDA device: "), (name, summary)
        assert f"## {name}: SKIP" in text
    assert table["indexer"][1] == "no CUDA device: the Triton kernel runs on CUDA only"


def test_a_section_over_its_limit_is_stopped_and_the_report_is_written_all_the_same(run_main, tmp_path):
    output = tmp_path / "report.md"
    sections = ("doctor", "main-job")
    status = run_main(
        "gpu_report", "--device", "cpu", "--budget", "3", "--sections", *sections, "--output", str(output)
    )
    assert status == 1
    text = output.read_text()
    table = _summary_table(text)

    assert table["doctor"] == ("FAIL", "stopped after its limit of 3 s")
    assert table["main-job"][0] == "SKIP"
    assert "## doctor: FAIL" in text and "The end of its output:" in text


def test_time_a_section_leaves_unused_goes_to_the_later_ones(bench):
    share_of, shares = bench.gpu_report.share_of, bench.gpu_report.SHARES
    every = list(shares)
    assert share_of(every[0], every[1:], bench.gpu_report.BUDGET_S) == pytest.approx(
        shares[every[0]]
    )  # default
    assert bench.gpu_report.BUDGET_S == 510
    # The doctor alone, then the loss with what the doctor left (it needed 20 s of its 70).
    assert share_of("doctor", ["loss"], 140) == pytest.approx(70)
    assert share_of("loss", [], 120) == pytest.approx(120)


def test_a_section_that_ends_without_a_verdict_is_a_fail_with_the_end_of_its_output(bench, tmp_path):
    """The loss section's own process, started on a machine without CUDA: the benchmark refuses the device."""
    section = bench.gpu_report.run_section("loss", torch.device("cpu"), 300, tmp_path / "loss.log")
    assert (section.status, section.summary) == ("FAIL", "ended with status 2 and no verdict")
    assert "--device cuda: torch sees no CUDA device here" in section.body


def test_the_attention_section_compares_every_ranks_error_with_sdpas_own(bench, monkeypatch):
    """On the CPU in fp32 the reference is SDPA itself, so ours must be within the floor; 1% off dK fails dK."""
    errors = bench._sections.attention_errors
    for lengths in ([40, 1, 23], [64]):
        rows = errors(torch.device("cpu"), torch.float32, lengths, 2, 4, 2, 8)
        assert [row["quantity"] for row in rows] == ["out", "dq", "dk", "dv"]
        assert all(row["verdict"].startswith("PASS") and row["ours_max"] < 1e-5 for row in rows), rows

    from lightning_cp.parallel import _varlen

    backward = _varlen.torch_backward

    def one_percent_off(*args, **kwargs):
        dq, dk, dv = backward(*args, **kwargs)
        return dq, dk * 1.01, dv

    monkeypatch.setattr(_varlen, "torch_backward", one_percent_off)
    rows = errors(torch.device("cpu"), torch.float32, [40, 1, 23], 2, 4, 2, 8)
    assert [row["verdict"][:4] for row in rows] == ["PASS", "PASS", "FAIL", "PASS"]


@pytest.mark.parametrize("kind", ["gated_deltanet", "mamba2", "short_conv"])
def test_the_hybrid_section_times_one_rank_and_checks_every_ranks_error(bench, kind):
    row = bench._hybrid_section.mixer_rank(kind, torch.device("cpu"), torch.float32, (16,) * 4, 2, repeat=1)
    assert row["status"] == "PASS" and row["worst"].split(": ")[1].startswith("PASS"), row
    assert row["rank_ms"] > 0 and row["x_share"] == pytest.approx(row["rank_ms"] / (row["unsharded_ms"] / 2))
    assert row["kernels"].endswith("causal_conv1d: missing")


def test_the_hybrid_section_fails_a_rank_whose_exchange_is_wrong(bench, monkeypatch):
    from lightning_cp.doctor import _ranks

    all_to_all = _ranks._CountingExchange.all_to_all
    monkeypatch.setattr(
        _ranks._CountingExchange, "all_to_all", lambda self, send: all_to_all(self, send).flip(0)
    )
    row = bench._hybrid_section.mixer_rank(
        "short_conv", torch.device("cpu"), torch.float32, (16,) * 4, 2, repeat=1
    )
    assert row["status"] == "FAIL" and "FAIL" in row["worst"]


def test_the_indexer_section_holds_triton_to_3x_its_ideal_and_both_paths_to_the_same_rows(bench):
    section = bench._indexer_section
    pairs = sum(t + 1 for t in range(5))  # each query's earlier keys and itself
    assert section.score_flops(5, 3, 7) == 2 * 3 * (7 + 1) * pairs
    same = torch.tensor([[3, 1, -1], [0, 2, 4]])
    assert section.same_rows(same, same.flip(1)) == 1.0  # a set, in any order
    assert section.same_rows(same, torch.tensor([[1, 3, -1], [0, 2, 5]])) == 0.5

    def judged(triton_ms: float, agreement: float):
        measured = {"triton": {"time_ms": triton_ms, "peak_extra_bytes": 100 * MIB}}
        measured["torch"] = {"time_ms": 40.0, "peak_extra_bytes": 400 * MIB}
        rows = section.indexer_rows(measured, 10**12, 10**15, 200 * MIB, "T 4")  # ideal: 1 ms
        return rows, section.indexer_verdict(rows, agreement)

    rows, good = judged(2.9, 0.99)
    assert [(r["case"], r["x_ideal"], r["tflops"], r["target"]) for r in rows] == [
        ("ideal", 1.0, pytest.approx(1000), None),
        ("triton", pytest.approx(2.9), pytest.approx(1000 / 2.9), "PASS 2.90 <= 3"),
        ("torch", pytest.approx(40), pytest.approx(25), None),
    ]
    assert [r["x_plan"] for r in rows] == [None, 0.5, 2.0]
    assert good.status == "PASS" and good.summary.startswith(
        "triton 2.9 ms (2.90x ideal, target 3x), torch 40.0"
    )
    slow = judged(4.0, 1.0)[1]
    assert slow.status == "FAIL" and slow.summary.endswith("FAIL: time: triton T 4: target FAIL 4.00 <= 3")
    apart = judged(2.0, 0.98)[1]
    assert apart.status == "FAIL" and apart.summary.endswith("FAIL: agreement 0.9800 < 0.99")


def test_the_indexer_section_runs_both_paths_and_restores_the_kernel(bench, monkeypatch):
    """On the CPU both cases run the torch path; the section's plumbing (shard, timing, rows, table) at a tiny
    shape, and the torch case's switch undone."""
    from lightning_cp.parallel import _indexer_triton

    section = bench._indexer_section
    monkeypatch.setattr(section, "INDEXER_SHAPE", {"tokens": 96, "heads": 2, "dim": 16, "topk": 8})
    monkeypatch.setattr(section, "RATE_SIZE", 64)
    x = torch.zeros(1, dtype=torch.bfloat16)
    with section.torch_path():
        assert not _indexer_triton.available(x)
    assert _indexer_triton.available(x) == (_indexer_triton.triton is not None)
    result = section.indexer(torch.device("cpu"))
    assert "rows agreeing 1.0000" in result.summary
    table = result.body[result.body.index("| case |") :].splitlines()
    assert [line.split(" | ")[0] for line in table[2:]] == ["| ideal", "| triton", "| torch"]


def test_the_sections_read_the_verdicts_of_pytest_the_doctor_and_the_main_job(bench, tmp_path):
    s = bench._sections
    assert s.pytest_verdict(0, "..s\n2 passed, 1 skipped in 4.20s\n") == s.Section(
        "PASS", "2 passed, 1 skipped in 4.20s", "```\n2 passed, 1 skipped in 4.20s\n```"
    )
    failed = s.pytest_verdict(
        1, "F.\nFAILED tests/x.py::t - AssertionError\n=== 1 failed, 1 passed in 3.00s ===\n"
    )
    assert (failed.status, failed.summary) == ("FAIL", "1 failed, 1 passed in 3.00s")
    assert "FAILED tests/x.py::t - AssertionError" in failed.body
    assert s.pytest_verdict(2, "ImportError\n").summary == "pytest ended with status 2 and no summary"

    doctor = s.doctor_verdict(
        1, "checks on cuda\n  PASS  a  ok\n  FAIL  b x  worse\n\n1 passed, 1 failed, 0 skipped\n"
    )
    assert (doctor.status, doctor.summary) == ("FAIL", "1 passed, 1 failed, 0 skipped: b x")

    closing = "lightning-cp: training finished after 200 steps\n  val/loss:         {}  (perplexity 1.01)\n"
    memory = tmp_path / "runs/gpu_single/csv/version_0/memory_snapshots"
    memory.mkdir(parents=True)
    (memory / "step_5.md").write_text("| peak | 1.2 GiB |")
    passed = s.main_job_verdict(0, "Epoch 0\n" + closing.format("0.0069"), tmp_path)
    assert (passed.status, passed.summary) == ("PASS", "training finished after 200 steps, val/loss 0.0069")
    assert passed.body.endswith("| peak | 1.2 GiB |")
    assert s.main_job_verdict(0, closing.format("6.2400"), tmp_path).status == "FAIL"
    assert (
        s.main_job_verdict(1, "Traceback\n", tmp_path).summary
        == "lightning-cp fit ended with status 1, not finished"
    )


def test_load_memory_reports_both_methods_for_a_tiny_model(run_main, capsys):
    """The script runs end to end (2 spawned ranks per method) and prints one Markdown row per method; the
    figures themselves are the benchmark's, not asserted here."""
    run_main("load_memory", "--hidden", "64", "--layers", "2", "--vocab", "512", "--world", "2")
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    assert [row.split("|")[1].strip() for row in rows[1:]] == ["from_pretrained", "load_pretrained + FSDP"]


# --------------------------------------------------------------------------------------------------
# activation_memory.py


def test_activation_memory_quick_keeps_the_loss_and_moves_the_checkpointed_inputs(run_main, tmp_path):
    """The GPT rows of ``--quick``: every case has plain's loss and gradient norm; checkpointing keeps far less
    than plain; offload moves the layer inputs (T x d fp32 per layer, plus the RoPE tables) off the device."""
    report = tmp_path / "activation_memory.json"
    run_main("activation_memory", "--quick", "--models", "gpt", "--json", str(report))
    rows = {row["case"]: row for row in json.loads(report.read_text())["results"]}
    assert list(rows) == ["plain", "checkpointing", "checkpointing+offload", "+tiled"]
    assert all(row["status"] == "ok" and row["same"] == "yes" for row in rows.values())
    layer_input = 512 * 128 * 4  # tokens x dim, fp32
    assert rows["plain"]["offloaded"] == rows["checkpointing"]["offloaded"] == 0
    for case in ("checkpointing+offload", "+tiled"):
        assert rows[case]["offloaded"] >= 2 * layer_input
    assert rows["checkpointing"]["resident_per_layer"] < rows["plain"]["resident_per_layer"] / 10
    assert rows["checkpointing+offload"]["resident_per_layer"] < rows["checkpointing"]["resident_per_layer"]


# --------------------------------------------------------------------------------------------------
# hybrid.py


def test_hybrid_quick_measures_every_case_and_cp1_computes_the_unsharded_loss(tmp_path):
    """``hybrid.py --quick`` as a user runs it (two invocations side by side, two cases each: each worker spends
    ~5 s importing lightning and transformers, ~15 s in all on two idle cores): every case measured, the CP ranks
    hold their share of the tokens, and ``cp1`` (the package's attention and adapted Gated DeltaNet, no exchange)
    has the loss of ``transformers``' own model on the same weights; cp2 / cp4 see zeros for their peers, so their
    losses are only finite."""
    env = {**os.environ, **_worker_env()}
    runs = []
    for cases in (("unsharded", "cp1"), ("cp2", "cp4")):
        report = tmp_path / f"hybrid_{'_'.join(cases)}.json"
        command = [sys.executable, str(BENCHMARKS / "hybrid.py"), "--quick", "--device", "cpu"]
        command += ["--max-mem-gib", "8", "--json", str(report), "--cases", *cases]
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        runs.append((proc, report))
    rows = {}
    for proc, report in runs:
        _, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-3000:]
        rows.update({row["case"]: row for row in json.loads(report.read_text())["results"]})

    assert list(rows) == ["unsharded", "cp1", "cp2", "cp4"]
    assert all(row["status"] == "ok" and row["shape"] == "padded T=512" for row in rows.values()), rows
    assert [rows[case]["local_tokens"] for case in rows] == [512, 512, 256, 128]
    assert [rows[case]["ideal_mem_ratio"] for case in rows] == [1.0, 1.0, 0.5, 0.25]
    assert rows["cp1"]["loss"] == pytest.approx(rows["unsharded"]["loss"], rel=1e-4)
    assert rows["cp1"]["mem_ratio"] is not None and rows["unsharded"]["mem_ratio"] == 1.0
    assert all(0 < rows[case]["loss"] < 20 for case in ("cp2", "cp4"))
