"""A snapshot replayed: blocks classified by the tensors in them, memory by category over the trace."""

from __future__ import annotations

import numpy as np

from lightning_cp.callbacks.memory import timeline
from lightning_cp.callbacks.memory.tensors import ACTIVATIONS, GRADIENTS, OPTIMIZER_STATE, OTHER, PARAMETERS
from tests.callbacks.memory._classified import TENSORS, TENSORS_AT_START, MiB, P, S, classified_snapshot


def _replayed() -> timeline.MemoryTimeline:
    return timeline.analyze(classified_snapshot(), 0, TENSORS, TENSORS_AT_START)


def test_blocks_are_classified_by_the_tensors_that_live_in_them():
    blocks = {a.addr: a for a in _replayed().allocations if a.freed_at is None or a.allocated_at is None}
    e = next(a for a in _replayed().allocations if a.allocated_at == 1)

    # Several tensors in one block, named in address order; a tensor on the block's edge still fits.
    assert (blocks[P].category, blocks[P].tensors) == (PARAMETERS, ("layers.0.weight", "layers.0.bias"))
    assert (blocks[P + 4 * MiB].category, blocks[P + 4 * MiB].tensors) == (
        OPTIMIZER_STATE,
        ("exp_avg of layers.0.weight",),
    )
    # Freed in the trace, allocated before it: the tensors at the start of recording say what it held.
    assert (blocks[P + 6 * MiB].category, blocks[P + 6 * MiB].tensors) == (GRADIENTS, ("layers.0.weight",))
    # Live at the end: only the tensors at the snapshot count (not those at the start, nor one that
    # runs past the block's end).
    assert (blocks[P + 8 * MiB].category, blocks[P + 8 * MiB].tensors) == (OTHER, ())
    # E and then F at the same address: the gradient there now is F's, E held activations.
    assert (blocks[S].category, blocks[S].tensors, blocks[S].allocated_at) == (
        GRADIENTS,
        ("layers.0.weight",),
        6,
    )
    assert (e.category, e.tensors) == (ACTIVATIONS, ())


def test_a_block_shared_by_categories_goes_to_the_one_with_the_most_bytes():
    tensors = {
        (P, P + MiB): (GRADIENTS, "small"),
        (P + MiB, P + 3 * MiB): (PARAMETERS, "large"),
        (P + 3 * MiB, P + 3 * MiB + 1): (GRADIENTS, "tiny"),
    }
    [a] = [a for a in timeline.analyze(classified_snapshot(), 0, tensors).allocations if a.addr == P]

    assert (a.category, a.tensors) == (PARAMETERS, ("large", "small", "tiny"))


def test_memory_by_category_adds_up_to_the_allocated_memory_over_the_trace():
    timeline = _replayed()

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
