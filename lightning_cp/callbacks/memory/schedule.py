"""Which steps and ranks :class:`~lightning_cp.callbacks.MemoryProfilerCallback` records.

``steps`` such as ``[3, "10-12"]`` become inclusive windows ``((3, 3), (10, 12))``, each recorded once per
fit; ``ranks`` is ``"all"``, ``"local_zero"`` or a list of global ranks. Malformed options fail at
construction with the option, the value and an example of a valid one.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Literal

Window = tuple[int, int]
"""``(first, last)`` global steps, inclusive."""

Ranks = Literal["all", "local_zero"] | list[int]


class StepSchedule:
    """The windows of ``steps``, each opened once between :meth:`reset` calls.

    Raises:
        ValueError: if ``steps`` is not a list of steps and ``"first-last"`` windows, or windows overlap.
    """

    def __init__(self, steps: Sequence[int | str] | None) -> None:
        self.windows = parse_steps(steps)
        self._done: set[Window] = set()

    def reset(self) -> None:
        """Every window may open again (a new fit)."""
        self._done.clear()

    def open_at(self, step: int) -> Window | None:
        """``(step, last)`` if ``step`` lies in a window not opened yet (which is then opened), else ``None``.

        A window starts at ``step``, not at its first step, when the fit begins inside it (a resumed run).
        """
        window = next((w for w in self.windows if w[0] <= step <= w[1] and w not in self._done), None)
        if window is None:
            return None
        self._done.add(window)
        return step, window[1]


def parse_steps(steps: Sequence[int | str] | None) -> tuple[Window, ...]:
    """``[3, "10-12"]`` -> ``((3, 3), (10, 12))``: sorted, disjoint, inclusive windows; ``None`` -> ``()``."""
    if steps is None:
        return ()
    if isinstance(steps, (str, int)):
        # ValueError like every other malformed ``steps``, as the callback's docstring promises.
        raise ValueError(f"steps={steps!r} must be a list, e.g. steps=[{steps!r}].")  # noqa: TRY004
    windows = []
    for item in steps:
        text = str(item).strip()
        first, sep, last = text.partition("-")
        try:
            window = (int(first), int(last) if sep else int(first))
        except ValueError:
            raise ValueError(
                f"steps item {item!r} must be a step (10) or a window 'first-last' ('10-12')."
            ) from None
        if window[0] > window[1]:
            raise ValueError(
                f"steps item {item!r}: its first step {window[0]} comes after its last step {window[1]}; "
                f"write '{window[1]}-{window[0]}'."
            )
        windows.append(window)
    windows.sort()
    for before, after in itertools.pairwise(windows):
        if after[0] <= before[1]:
            raise ValueError(
                f"steps={list(steps)!r}: {before[0]}-{before[1]} and {after[0]}-{after[1]} overlap; "
                "merge them into one window."
            )
    return tuple(windows)


def check_ranks(ranks: object) -> None:
    """Raise ``ValueError`` unless ``ranks`` is ``"all"``, ``"local_zero"`` or a list of global ranks."""
    if ranks in ("all", "local_zero"):
        return
    if not isinstance(ranks, list) or not all(isinstance(r, int) and r >= 0 for r in ranks):
        raise ValueError(
            f"ranks={ranks!r} must be 'all', 'local_zero' or a list of global ranks, e.g. [0, 3]."
        )


def rank_selected(ranks: Ranks, global_rank: int, local_rank: int) -> bool:
    """Whether the process of ``global_rank`` / ``local_rank`` records under ``ranks``."""
    if ranks == "all":
        return True
    if ranks == "local_zero":
        return local_rank == 0
    return global_rank in ranks
