"""Which collectives a CP group ran: every :class:`~lightning_cp.parallel.GroupExchange` call, recorded.

The attention modes give the same numbers, so a test that checks *which* mode ran (Ulysses' all-to-all, the
all-gather in so many rounds) counts the collectives instead: within :func:`recorded_collectives` every call
of a ``GroupExchange`` method in this process is appended to the list it yields, with the kind, dtype and
shape of what it sent.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from lightning_cp.parallel.exchange import GroupExchange

_RECORDED = ("all_gather", "reduce_scatter", "all_to_all", "agree_min")


@dataclass(frozen=True)
class Collective:
    kind: str
    """The ``GroupExchange`` method: ``all_gather``, ``reduce_scatter``, ``all_to_all`` or ``agree_min``."""
    dtype: torch.dtype | None
    shape: tuple[int, ...]


@contextlib.contextmanager
def recorded_collectives() -> Iterator[list[Collective]]:
    """Within: every ``GroupExchange`` collective of this process, in call order."""
    calls: list[Collective] = []
    originals = {name: getattr(GroupExchange, name) for name in _RECORDED}

    def recording(name, method):
        @functools.wraps(method)
        def record(self, sent, *args, **kwargs):
            if isinstance(sent, torch.Tensor):
                calls.append(Collective(name, sent.dtype, tuple(sent.shape)))
            else:
                calls.append(Collective(name, None, ()))
            return method(self, sent, *args, **kwargs)

        return record

    for name, method in originals.items():
        setattr(GroupExchange, name, recording(name, method))
    try:
        yield calls
    finally:
        for name, method in originals.items():
            setattr(GroupExchange, name, method)


def kinds(calls: list[Collective]) -> list[str]:
    return [call.kind for call in calls]
