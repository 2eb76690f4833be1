"""Which steps and ranks record: the options' parsing and messages, and the windows' opening."""

from __future__ import annotations

import pytest

from lightning_cp.callbacks import MemoryProfilerCallback
from lightning_cp.callbacks.memory.schedule import StepSchedule


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"steps": "10-12"}, r"steps='10-12' must be a list, e.g. steps=\['10-12'\]"),
        (
            {"steps": ["12-10"]},
            r"steps item '12-10': its first step 12 comes after its last step 10; write '10-12'",
        ),
        ({"steps": ["ten"]}, r"steps item 'ten' must be a step \(10\) or a window"),
        ({"steps": [5, "3-6"]}, r"3-6 and 5-5 overlap"),
        ({"ranks": "first"}, r"ranks='first' must be 'all', 'local_zero' or a list"),
        ({"ranks": [-1]}, r"ranks=\[-1\] must be"),
        ({"max_entries": 0}, r"max_entries=0 must be a positive"),
        ({"stacks": "cpp"}, r"stacks='cpp' must be 'python'"),
    ],
)
def test_malformed_arguments_name_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MemoryProfilerCallback(**kwargs)


def test_windows_are_sorted_and_each_opens_once_per_fit():
    schedule = StepSchedule(["10-12", 3])

    assert schedule.windows == ((3, 3), (10, 12))
    assert [schedule.open_at(step) for step in (2, 3, 3, 9)] == [None, (3, 3), None, None]
    # A run resumed at step 11 starts inside the window: it records from there to the window's end.
    assert schedule.open_at(11) == (11, 12)
    assert schedule.open_at(12) is None
    schedule.reset()
    assert schedule.open_at(10) == (10, 12)
