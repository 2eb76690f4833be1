"""The offline report: the markdown table of the peak and the PNG, on snapshots written by hand."""

from __future__ import annotations

import sys

import matplotlib.image
import numpy as np
import pytest

from lightning_cp.callbacks.memory import report
from lightning_cp.callbacks.memory.tensors import ACTIVATIONS, GRADIENTS, OPTIMIZER_STATE, OTHER, PARAMETERS
from tests.callbacks._fake_cuda import recorded_snapshot
from tests.callbacks.memory._classified import (
    FRAMES_E,
    TENSORS,
    TENSORS_AT_START,
    MiB,
    S,
    classified_snapshot,
)


def _table(text: str, header: str) -> list[list[str]]:
    """The rows of the markdown table under ``header``, as lists of cells."""
    lines = text.split(f"## {header}\n\n", 1)[1].splitlines()[2:]
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split(" | ")])
    return rows


def test_markdown_breaks_the_peak_down_by_category(tmp_path):
    png, md = report.write_report(
        classified_snapshot(),
        tmp_path / "r",
        title="t",
        tensors=TENSORS,
        tensors_at_start=TENSORS_AT_START,
    )
    text = md.read_text()

    assert f"peak allocated: 12.00 MiB ({12 * MiB} bytes), reached at event 1" in text
    assert _table(text, "The peak by category") == [
        [PARAMETERS, "4.00 MiB", str(4 * MiB), "33.3%"],
        [ACTIVATIONS, "3.00 MiB", str(3 * MiB), "25.0%"],
        [GRADIENTS, "2.00 MiB", str(2 * MiB), "16.7%"],
        [OPTIMIZER_STATE, "2.00 MiB", str(2 * MiB), "16.7%"],
        [OTHER, "1.00 MiB", str(1 * MiB), "8.3%"],
        ["total", "12.00 MiB", str(12 * MiB), "100.0%"],
    ]
    rows = _table(text, "Largest live allocations at the peak (top 5)")
    # size, where, category, contents; ties in size keep the order of the trace (C freed, then B)
    assert [(r[2], r[4], r[5], r[6]) for r in rows] == [
        (str(4 * MiB), "before the trace", PARAMETERS, "layers.0.weight (+1 more)"),
        (str(3 * MiB), "1", ACTIVATIONS, "`/home/me/project/model.py:12 forward`"),
        (str(2 * MiB), "before the trace", GRADIENTS, "layers.0.weight"),
        (str(2 * MiB), "before the trace", OPTIMIZER_STATE, "exp_avg of layers.0.weight"),
        (str(1 * MiB), "before the trace", OTHER, "(no stack recorded)"),
    ]
    assert png is not None and png.stat().st_size > 0


def test_a_block_with_tensors_and_a_stack_shows_both(tmp_path):
    snapshot = classified_snapshot()
    snapshot["device_traces"][0].append(
        {"action": "alloc", "addr": S + 2 * MiB, "size": 6 * MiB, "frames": FRAMES_E}
    )
    tensors = {**TENSORS, (S + 2 * MiB, S + 8 * MiB): (OPTIMIZER_STATE, "exp_avg_sq of w")}
    _, md = report.write_report(snapshot, tmp_path / "r", title="t", tensors=tensors)

    [first, *_] = _table(md.read_text(), "Largest live allocations at the peak (top 5)")
    assert first[5:] == [OPTIMIZER_STATE, "exp_avg_sq of w<br>`/home/me/project/model.py:12 forward`"]


def test_png_stacks_the_categories(tmp_path):
    png, _ = report.write_report(classified_snapshot(), tmp_path / "r", title="t", tensors=TENSORS)

    image = matplotlib.image.imread(png)[..., :3]
    assert image.shape[:2] == (400, 1000)
    # The stacked areas are drawn in the categories' colors (matplotlib's tab:blue, tab:green, tab:red).
    for rgb in ((0x1F, 0x77, 0xB4), (0x2C, 0xA0, 0x2C), (0xD6, 0x27, 0x28)):
        assert (np.abs(image * 255 - rgb).max(axis=-1) < 2).sum() > 1000, rgb


def test_without_matplotlib_the_markdown_is_still_written(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    png, md = report.write_report(classified_snapshot(), tmp_path / "r", title="t", tensors=TENSORS)

    assert not report.can_plot()
    assert png is None and not (tmp_path / "r.png").exists()
    assert "| parameters | 4.00 MiB |" in md.read_text()


def test_a_failing_plot_is_not_mistaken_for_a_missing_matplotlib(tmp_path, monkeypatch):
    def broken(*args):
        raise ModuleNotFoundError("No module named 'PIL'", name="PIL")

    monkeypatch.setattr(report, "_plot", broken)
    with pytest.raises(ModuleNotFoundError, match="PIL"):
        report.write_report(classified_snapshot(), tmp_path / "r", title="t")


def test_offline_report_matches_the_peak_worked_out_by_hand(tmp_path):
    png, md = report.write_report(recorded_snapshot(), tmp_path / "report", title="step_000001.rank00")

    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert matplotlib.image.imread(png).shape[:2] == (400, 1000)
    text = md.read_text()
    assert f"peak allocated: 10.00 MiB ({10 * MiB} bytes), reached at event 5" in text
    assert "reserved at the peak: 18.00 MiB" in text
    assert "allocated when the trace starts: 1.50 MiB" in text
    assert "OOM at event 11: requested 64.00 MiB" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and line[2].isdigit()]
    # Live at the peak, largest first: E (4), D (3), C (2), A (1); B was freed before the peak.
    assert [row.split(" | ")[2] for row in rows] == [str(4 * MiB), str(3 * MiB), str(2 * MiB), str(1 * MiB)]
    assert (
        "`/home/me/project/model.py:61 big_buffer`<br>`/home/me/project/model.py:70 training_step`" in rows[0]
    )
    assert "40.0%" in rows[0]
    # Python frames only, without nn.Module's call plumbing; site-packages prefixes dropped.
    assert "`torch/nn/modules/linear.py:125 forward`<br>`/home/me/project/model.py:42 forward`" in rows[2]
    assert "before the trace" in rows[3] and "model.py:5 __init__" in rows[3]
