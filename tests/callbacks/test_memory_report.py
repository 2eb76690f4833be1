"""The offline report's classification of blocks by the tensors in them, on a snapshot written by hand.

The snapshot below is laid out so that every rule of the classification has a block to catch it, and
its peak and per-category numbers are worked out by hand in the docstring of :func:`_classified_snapshot`.
"""

from __future__ import annotations

import sys

import matplotlib.image
import numpy as np
import pytest

from lightning_cp.callbacks import _memory_report
from lightning_cp.callbacks._memory_report import (
    ACTIVATIONS,
    BUFFERS,
    GRADIENTS,
    OPTIMIZER_STATE,
    OTHER,
    PARAMETERS,
)

MiB = 2**20
KiB = 2**10
_P = 256 * MiB  # segment allocated before the trace: blocks A, B, C, D
_S = 512 * MiB  # segment the trace allocates: blocks E, then F at the same address
_FRAMES_E = [{"filename": "/home/me/project/model.py", "line": 12, "name": "forward"}]
_FRAMES_F = [
    {"filename": "/venv/lib/python3.11/site-packages/torch/autograd/graph.py", "line": 8, "name": "run"}
]


def _classified_snapshot() -> dict:
    """One device. Before the trace: A 4 MiB (parameters: weight and bias), B 2 MiB (optimizer state),
    C 2 MiB (the previous step's gradient, freed in the trace), D 1 MiB (holds no known tensor): 9 MiB.

    Events: 0 segment +8 MiB (9); 1 alloc E 3 MiB, an activation (12 = peak); 2-3 free C (10);
    4-5 free E (7); 6 alloc F 2 MiB at E's address, the new gradient (9).

    At the peak (index 2, "at event 1"): parameters 4, activations 3, gradients 2 (C), optimizer state 2,
    other 1 = 12 MiB; shares 33.3 / 25.0 / 16.7 / 16.7 / 8.3 %.
    """

    def ev(action: str, addr: int, size: int, frames: list[dict] = ()) -> dict:
        return {"action": action, "addr": addr, "size": size, "stream": 0, "frames": list(frames)}

    trace = [
        ev("segment_alloc", _S, 8 * MiB),
        ev("alloc", _S, 3 * MiB, _FRAMES_E),
        ev("free_requested", _P + 6 * MiB, 2 * MiB),
        ev("free_completed", _P + 6 * MiB, 2 * MiB),
        ev("free_requested", _S, 3 * MiB),
        ev("free_completed", _S, 3 * MiB),
        ev("alloc", _S, 2 * MiB, _FRAMES_F),
    ]

    def block(addr: int, size: int, state: str, frames: list[dict] = ()) -> dict:
        return {"address": addr, "size": size, "requested_size": size, "state": state, "frames": list(frames)}

    def segment(addr: int, size: int, blocks: list[dict]) -> dict:
        return {"device": 0, "address": addr, "total_size": size, "stream": 0, "blocks": blocks}

    return {
        "segments": [
            segment(
                _P,
                10 * MiB,
                [
                    block(_P, 4 * MiB, "active_allocated"),  # A
                    block(_P + 4 * MiB, 2 * MiB, "active_allocated"),  # B
                    block(_P + 6 * MiB, 2 * MiB, "inactive"),  # C, freed
                    block(_P + 8 * MiB, 1 * MiB, "active_allocated"),  # D
                    block(_P + 9 * MiB, 1 * MiB, "inactive"),
                ],
            ),
            segment(
                _S,
                8 * MiB,
                [block(_S, 2 * MiB, "active_allocated", _FRAMES_F), block(_S + 2 * MiB, 6 * MiB, "inactive")],
            ),
        ],
        "device_traces": [trace],
    }


# The tensors when the snapshot is taken (``tensors``) and when recording started (``tensors_at_start``).
_TENSORS = {
    (_P + 3 * MiB, _P + 3 * MiB + 4 * KiB): (PARAMETERS, "layers.0.bias"),  # listed first, lies after weight
    (_P, _P + 3 * MiB): (PARAMETERS, "layers.0.weight"),
    (_P + 4 * MiB, _P + 6 * MiB): (OPTIMIZER_STATE, "exp_avg of layers.0.weight"),
    (_S, _S + 2 * MiB): (GRADIENTS, "layers.0.weight"),  # F: live now; E, freed, is at the same address
    (_P + 7 * MiB, _P + 7 * MiB + KiB): (GRADIENTS, "in C, which is freed"),
    (_P + 9 * MiB - KiB, _P + 9 * MiB + KiB): (BUFFERS, "straddles D's end"),
    (64 * MiB, 65 * MiB): (PARAMETERS, "in no block"),
}
_TENSORS_AT_START = {
    (_P + 6 * MiB, _P + 8 * MiB): (GRADIENTS, "layers.0.weight"),  # C
    (_P + 8 * MiB, _P + 8 * MiB + KiB): (GRADIENTS, "in D, which stays live"),
    (_P, _P + 3 * MiB): (GRADIENTS, "in A, which stays live"),
}


def _timeline() -> _memory_report.MemoryTimeline:
    return _memory_report.analyze(_classified_snapshot(), 0, _TENSORS, _TENSORS_AT_START)


def test_blocks_are_classified_by_the_tensors_that_live_in_them():
    blocks = {a.addr: a for a in _timeline().allocations if a.freed_at is None or a.allocated_at is None}
    e = next(a for a in _timeline().allocations if a.allocated_at == 1)

    # Several tensors in one block, named in address order; a tensor on the block's edge still fits.
    assert (blocks[_P].category, blocks[_P].tensors) == (PARAMETERS, ("layers.0.weight", "layers.0.bias"))
    assert (blocks[_P + 4 * MiB].category, blocks[_P + 4 * MiB].tensors) == (
        OPTIMIZER_STATE,
        ("exp_avg of layers.0.weight",),
    )
    # Freed in the trace, allocated before it: the tensors at the start of recording say what it held.
    assert (blocks[_P + 6 * MiB].category, blocks[_P + 6 * MiB].tensors) == (GRADIENTS, ("layers.0.weight",))
    # Live at the end: only the tensors at the snapshot count (not those at the start, nor one that
    # runs past the block's end).
    assert (blocks[_P + 8 * MiB].category, blocks[_P + 8 * MiB].tensors) == (OTHER, ())
    # E and then F at the same address: the gradient there now is F's, E held activations.
    assert (blocks[_S].category, blocks[_S].tensors, blocks[_S].allocated_at) == (
        GRADIENTS,
        ("layers.0.weight",),
        6,
    )
    assert (e.category, e.tensors) == (ACTIVATIONS, ())


def test_a_block_shared_by_categories_goes_to_the_one_with_the_most_bytes():
    tensors = {
        (_P, _P + MiB): (GRADIENTS, "small"),
        (_P + MiB, _P + 3 * MiB): (PARAMETERS, "large"),
        (_P + 3 * MiB, _P + 3 * MiB + 1): (GRADIENTS, "tiny"),
    }
    [a] = [a for a in _memory_report.analyze(_classified_snapshot(), 0, tensors).allocations if a.addr == _P]

    assert (a.category, a.tensors) == (PARAMETERS, ("large", "small", "tiny"))


def test_memory_by_category_adds_up_to_the_allocated_memory_over_the_trace():
    timeline = _timeline()

    assert list(timeline.by_category) == [PARAMETERS, ACTIVATIONS, GRADIENTS, OPTIMIZER_STATE, OTHER]
    in_mib = {c: (series / MiB).tolist() for c, series in timeline.by_category.items()}
    assert in_mib[ACTIVATIONS] == [0, 0, 3, 3, 3, 3, 0, 0]
    assert in_mib[GRADIENTS] == [2, 2, 2, 2, 0, 0, 0, 2]
    assert in_mib[PARAMETERS] == [4] * 8
    np.testing.assert_array_equal(sum(timeline.by_category.values()), timeline.allocated)
    assert (timeline.allocated / MiB).tolist() == [9, 9, 12, 12, 10, 10, 7, 9]
    assert timeline.peak_by_category() == {
        PARAMETERS: 4 * MiB,
        ACTIVATIONS: 3 * MiB,
        GRADIENTS: 2 * MiB,
        OPTIMIZER_STATE: 2 * MiB,
        OTHER: 1 * MiB,
    }


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
    png, md = _memory_report.write_report(
        _classified_snapshot(),
        tmp_path / "r",
        title="t",
        tensors=_TENSORS,
        tensors_at_start=_TENSORS_AT_START,
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
    snapshot = _classified_snapshot()
    snapshot["device_traces"][0].append(
        {"action": "alloc", "addr": _S + 2 * MiB, "size": 6 * MiB, "frames": _FRAMES_E}
    )
    tensors = {**_TENSORS, (_S + 2 * MiB, _S + 8 * MiB): (OPTIMIZER_STATE, "exp_avg_sq of w")}
    _, md = _memory_report.write_report(snapshot, tmp_path / "r", title="t", tensors=tensors)

    [first, *_] = _table(md.read_text(), "Largest live allocations at the peak (top 5)")
    assert first[5:] == [OPTIMIZER_STATE, "exp_avg_sq of w<br>`/home/me/project/model.py:12 forward`"]


def test_png_stacks_the_categories(tmp_path):
    png, _ = _memory_report.write_report(_classified_snapshot(), tmp_path / "r", title="t", tensors=_TENSORS)

    image = matplotlib.image.imread(png)[..., :3]
    assert image.shape[:2] == (400, 1000)
    # The stacked areas are drawn in the categories' colors (matplotlib's tab:blue, tab:green, tab:red).
    for rgb in ((0x1F, 0x77, 0xB4), (0x2C, 0xA0, 0x2C), (0xD6, 0x27, 0x28)):
        assert (np.abs(image * 255 - rgb).max(axis=-1) < 2).sum() > 1000, rgb


def test_without_matplotlib_the_markdown_is_still_written(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    png, md = _memory_report.write_report(_classified_snapshot(), tmp_path / "r", title="t", tensors=_TENSORS)

    assert not _memory_report.can_plot()
    assert png is None and not (tmp_path / "r.png").exists()
    assert "| parameters | 4.00 MiB |" in md.read_text()


def test_a_failing_plot_is_not_mistaken_for_a_missing_matplotlib(tmp_path, monkeypatch):
    def broken(*args):
        raise ModuleNotFoundError("No module named 'PIL'", name="PIL")

    monkeypatch.setattr(_memory_report, "_plot", broken)
    with pytest.raises(ModuleNotFoundError, match="PIL"):
        _memory_report.write_report(_classified_snapshot(), tmp_path / "r", title="t")
