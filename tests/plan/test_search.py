"""The layouts tried, their order, and the longest sequence that fits."""

from __future__ import annotations

import pytest

from lightning_cp.models.gpt import GPTConfig
from lightning_cp.plan import Layout, ModelShape, estimate, layouts, max_seq_len, plan

GiB = 2**30


@pytest.fixture(scope="module")
def shape() -> ModelShape:
    return ModelShape.from_gpt_config(GPTConfig(vocab_size=32768, n_layer=8, n_head=8, n_embd=1024))


def test_layouts_cover_every_cp_power_of_two_wrapper_and_saving() -> None:
    found = layouts(8)
    assert {layout.cp for layout in found} == {1, 2, 4, 8}
    assert len(found) == 4 * 2 * 6 and len(set(found)) == len(found)
    assert {layout.cp for layout in layouts(6)} == {1, 2}
    with pytest.raises(ValueError, match="gpus=0"):
        layouts(0)


def test_plan_orders_by_communication(shape: ModelShape) -> None:
    candidates = plan(shape, 1 << 16, 8)
    costs = [c.cost() for c in candidates]
    assert costs == sorted(costs)
    first = candidates[0].layout
    assert (first.cp, first.checkpointing, first.tiled_mlp, first.offload) == (1, False, False, False)


@pytest.mark.parametrize(
    "layout", [Layout(8, 8), Layout(8, 4, fsdp=True, checkpointing=True, tiled_mlp=True)]
)
def test_max_seq_len_is_the_longest_that_fits(shape: ModelShape, layout: Layout) -> None:
    memory = 20 * GiB
    longest = max_seq_len(shape, layout, memory)
    assert longest > 0 and longest % 1024 == 0
    assert estimate(shape, longest, layout).peak <= memory < estimate(shape, longest + 1024, layout).peak


def test_max_seq_len_is_zero_when_nothing_fits(shape: ModelShape) -> None:
    assert max_seq_len(shape, Layout(1, 1), 1 * GiB) == 0
