"""The CP ranks a check runs in this process, and how they reach each other: simulated, or a real group.

A check shards one batch for every rank it runs, calls the package's layers on each shard and compares the
result with a reference on the whole sequence. :class:`CheckRanks` is what differs between the two places the
doctor runs a check:

- :class:`SimulatedRanks`: every rank of a CP group of ``cp`` in this process (one process, no peers). Its
  exchanges answer exactly as the collectives of a real group would, for any number of exchanges per pass and
  exchanges that depend on each other (Ulysses' two all-to-alls, the all-gather in several rounds, a mixer's
  exchange there and back): each call of a pass goes to a
  :class:`~lightning_cp.parallel.simulated.SimulatedCPGroup` of its own, every rank's pass is recorded as many
  times as it makes calls (so what a rank sends after receiving is recorded from exact data), then run exactly.
  Ranks that make different numbers of exchanges, which would hang a real group, are an error.
- :class:`GroupRanks`: this process's rank of a real CP process group (``torchrun``).

Both count the exchanges every rank made in its (last, exact) pass, by kind, so that a check can say which
exchange ran.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_cp.parallel.exchange import GroupExchange
from lightning_cp.parallel.layout import ProcessGroup
from lightning_cp.parallel.simulated import SimulatedCPGroup

T = TypeVar("T")


class CheckRanks(ABC):
    """The ranks of a CP group of :attr:`cp` that this process runs, and their exchanges."""

    def __init__(self, cp: int, ranks: Sequence[int]) -> None:
        self.cp = cp
        self.ranks = tuple(ranks)
        """The ranks this process runs, in order: all of them (simulated), or its own (a real group)."""
        self.calls: dict[int, list[str]] = {rank: [] for rank in self.ranks}
        """The exchanges (``all_gather``, ``reduce_scatter``, ``all_to_all``) each rank made in its last
        :meth:`run`, in order."""

    @abstractmethod
    def exchange(self, rank: int) -> GroupExchange:
        """Rank ``rank``'s exchange: what ``shard_batch(..., cp_group=)`` gives the shard of that rank."""

    @abstractmethod
    def run(self, step: Callable[[int], T]) -> list[T]:
        """``step(rank)`` for every rank of :attr:`ranks`, its exchanges answered as the group's collectives
        would: the results, in the order of :attr:`ranks`. ``step`` may be called more than once per rank (a
        backward needs ``retain_graph=True``)."""

    @abstractmethod
    def sum(self, per_rank: list[Tensor]) -> Tensor:
        """The sum over every rank of the group of a tensor each rank holds (``per_rank``: one per rank of
        :attr:`ranks`), e.g. the gradient of a parameter every rank uses."""


class _CountingExchange(GroupExchange):
    """A rank's exchange that notes every call in ``calls`` before it makes it through ``answer``."""

    def __init__(
        self, rank: int, size: int, calls: dict[int, list[str]], answer: Callable[[int], GroupExchange]
    ):
        super().__init__(None)
        self._rank, self._size, self._calls, self._answer = rank, size, calls, answer

    @property
    def size(self) -> int:
        return self._size

    @property
    def rank(self) -> int:
        return self._rank

    def _next(self, kind: str) -> GroupExchange:
        self._calls[self._rank].append(kind)
        return self._answer(len(self._calls[self._rank]) - 1)

    def all_gather(self, local: Tensor) -> Tensor:
        return self._next("all_gather").all_gather(local)

    def reduce_scatter(self, full: Tensor) -> Tensor:
        return self._next("reduce_scatter").reduce_scatter(full)

    def all_to_all(self, send: Tensor) -> Tensor:
        return self._next("all_to_all").all_to_all(send)


class SimulatedRanks(CheckRanks):
    """Every rank of a CP group of ``cp`` in this process; exact for any exchanges (see the module docstring).

    Raises (from :meth:`run`):
        RuntimeError: the ranks made different numbers or kinds of exchanges in a pass.
    """

    def __init__(self, cp: int) -> None:
        super().__init__(cp, range(cp))
        self._groups: list[SimulatedCPGroup] = []
        """The current :meth:`run`'s groups, one per call of a pass."""
        self._recording: contextlib.ExitStack | None = None
        self._exchanges = {
            rank: _CountingExchange(
                rank, cp, self.calls, lambda call, rank=rank: self._group(call).exchange(rank)
            )
            for rank in self.ranks
        }

    def exchange(self, rank: int) -> GroupExchange:
        return self._exchanges[rank]

    def _group(self, call: int) -> SimulatedCPGroup:
        while len(self._groups) <= call:
            self._groups.append(SimulatedCPGroup(self.cp))
            if self._recording is not None:
                self._recording.enter_context(self._groups[-1].recording())
        return self._groups[call]

    def _pass(self, step: Callable[[int], T], *, recording: bool) -> list[T]:
        for calls in self.calls.values():
            calls.clear()
        with contextlib.ExitStack() as stack:
            if recording:
                for group in self._groups:
                    stack.enter_context(group.recording())
                self._recording = stack
            try:
                results = [step(rank) for rank in self.ranks]
            finally:
                self._recording = None
        patterns = {tuple(calls) for calls in self.calls.values()}
        if len(patterns) > 1:
            made = "; ".join(
                f"rank {rank}: {', '.join(calls) or 'none'}" for rank, calls in self.calls.items()
            )
            raise RuntimeError(
                f"the simulated CP ranks made different exchanges, which hangs a real group: {made}"
            )
        return results

    def run(self, step: Callable[[int], T]) -> list[T]:
        self._groups = []
        self._pass(step, recording=True)
        # A rank sends what it received in an earlier call at most (its number of calls - 1) calls deep: that
        # many more recordings make every recorded send exact.
        for _ in range(len(self.calls[0]) - 1):
            self._pass(step, recording=True)
        return self._pass(step, recording=False)

    def sum(self, per_rank: list[Tensor]) -> Tensor:
        return torch.stack(per_rank).sum(0)


class GroupRanks(CheckRanks):
    """This process's rank of the real CP process group ``group``, whose collectives run on ``device``.

    Before its first exchange the ranks agree that every one of them got there (:meth:`agree`): a rank whose
    check failed before its exchanges says so (``agree(False)``) instead of leaving the others waiting in a
    collective it never joins, and every rank's check then fails at once.
    """

    def __init__(self, group: ProcessGroup, device: torch.device) -> None:
        rank = dist.get_rank(group)
        super().__init__(dist.get_world_size(group), [rank])
        self.group, self.device = group, device
        self.agreed = False
        """Whether the ranks agreed, so that this rank's exchanges started."""
        real = GroupExchange(group)
        self._exchange = _CountingExchange(rank, self.cp, self.calls, lambda call: real)

    def exchange(self, rank: int) -> GroupExchange:
        return self._exchange

    def agree(self, ready: bool) -> None:
        """Tell every rank whether this one is ready for the check's exchanges, and learn whether they all are.

        Raises:
            RuntimeError: another rank is not (naming it); also on a rank that is not, once all have answered.
        """
        flag = torch.tensor([float(ready)], device=self.device)
        flags = [torch.empty_like(flag) for _ in range(self.cp)]
        dist.all_gather(flags, flag, group=self.group)
        self.agreed = True
        failed = [rank for rank, f in enumerate(flags) if not f.item()]
        if failed:
            raise RuntimeError(f"rank(s) {failed} of the group failed before the exchanges (see their lines)")

    def run(self, step: Callable[[int], T]) -> list[T]:
        if not self.agreed:
            self.agree(True)
        self.calls[self.ranks[0]].clear()
        return [step(self.ranks[0])]

    def sum(self, per_rank: list[Tensor]) -> Tensor:
        (total,) = per_rank
        total = total.clone()
        dist.all_reduce(total, group=self.group)
        return total
