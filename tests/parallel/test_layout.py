"""ParallelLayout: validation messages, the single-process layout, the current layout."""

import pytest
import torch.distributed as dist

from lightning_cp.parallel import ParallelLayout, current_layout
from lightning_cp.parallel.layout import check_size, data_parallel_size, set_current_layout

G = object()  # stands for a process group: the layout never calls into it


def test_single_process_layout():
    layout = ParallelLayout()
    assert (layout.dp, layout.cp, layout.tp, layout.world_size) == (1, 1, 1, 1)
    assert (layout.cp_group, layout.tp_group, layout.dp_group, layout.loss_group) == (None,) * 4
    assert layout.tag() == "dp0-cp0-tp0"
    assert current_layout() == layout  # no strategy, no process group


def test_a_valid_grid_position():
    # rank = tp_rank + tp * (cp_rank + cp * dp_rank) = 1 + 2 * (0 + 2 * 1) = 5
    layout = ParallelLayout(
        dp=2,
        cp=2,
        tp=2,
        rank=5,
        dp_rank=1,
        cp_rank=0,
        tp_rank=1,
        cp_group=G,
        tp_group=G,
        dp_group=G,
        loss_group=G,
    )
    assert layout.world_size == 8 and layout.tag() == "dp1-cp0-tp1"


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"cp": 2.0}, TypeError, r"cp=2\.0: cp must be an integer"),
        ({"tp": 0}, ValueError, r"tp=0: tp must be >= 1"),
        (
            {"dp": 2, "rank": 2, "dp_rank": 0, "dp_group": G, "loss_group": G},
            ValueError,
            r"rank 2 is outside",
        ),
        (
            {"cp": 2, "cp_rank": 2, "cp_group": G, "loss_group": G},
            ValueError,
            r"cp_rank 2 is outside \[0, cp=2\)",
        ),
        (
            {"dp": 2, "cp": 2, "rank": 1, "dp_rank": 1, "cp_group": G, "dp_group": G, "loss_group": G},
            ValueError,
            r"with TP fastest, then CP, then DP that is rank 2",
        ),
        ({"cp": 2, "loss_group": G}, ValueError, r"cp_group is missing for a dimension of size 2"),
        ({"cp_group": G}, ValueError, r"cp_group is given for a dimension of size 1"),
    ],
)
def test_invalid_layouts_say_what_is_wrong(kwargs, error, match):
    with pytest.raises(error, match=match):
        ParallelLayout(**kwargs)


def test_sizes_are_checked_with_the_arithmetic():
    assert data_parallel_size(8, 2, 2) == 2
    with pytest.raises(ValueError, match=r"world size 3 is not divisible by cp\(2\) \* tp\(1\) = 2"):
        data_parallel_size(3, 2, 1)
    with pytest.raises(TypeError, match="cp=True"):
        check_size("cp", True)


def _plain_ddp_layout():
    layout = current_layout()
    return layout.dp, layout.dp_rank, layout.loss_group is dist.group.WORLD, layout.cp_group


def test_without_a_strategy_the_current_layout_is_plain_data_parallelism(world2):
    assert world2.run(_plain_ddp_layout) == [(2, 0, True, None), (2, 1, True, None)]


def test_set_current_layout_and_back():
    layout = ParallelLayout(cp=2, cp_group=G, loss_group=G)
    set_current_layout(layout)
    try:
        assert current_layout() is layout
    finally:
        set_current_layout(None)
    assert current_layout() == ParallelLayout()
