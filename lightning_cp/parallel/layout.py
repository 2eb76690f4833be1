"""The parallel layout of a run: DP x CP x TP sizes, this rank's coordinates and its process groups.

One frozen :class:`ParallelLayout` answers "what is my dp / cp / tp rank and group?" for the whole
package. :class:`~lightning_cp.MegatronCPStrategy` builds it from Megatron-core's groups in
``setup_distributed`` (``strategy.layout``) and makes it the :func:`current_layout`; the loss mixin, the
metrics, the memory profiler and the models read it from there. Without the strategy the current layout
is that of plain data parallelism over the default process group, or of a single process.

Groups follow one rule: a group is ``None`` exactly when its dimension has size 1, and ``None`` always
means "no communication" (never "the world", as in ``torch.distributed``'s convention). Ranks are
ordered as Megatron orders them, TP fastest, then CP, then DP: ``rank = tp_rank + tp * (cp_rank + cp *
dp_rank)`` (see ``docs/design.md``, "Parallel layout").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

ProcessGroup = dist.ProcessGroup


def check_size(name: str, value: object, owner: str = "") -> int:
    """``value`` as a parallel size: an ``int >= 1``, else a ``TypeError`` / ``ValueError`` naming ``name``.

    ``owner`` (e.g. ``"MegatronCPStrategy"``) prefixes the message as ``owner(name=value)``.
    """
    where = f"{owner}({name}={value!r})" if owner else f"{name}={value!r}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{where}: {name} must be an integer >= 1, e.g. {name}=2.")
    if value < 1:
        raise ValueError(f"{where}: {name} must be >= 1 (1 disables it).")
    return value


def heads_split(heads: int, shared: int, cp: int) -> bool:
    """Whether ``heads`` split over ``cp`` ranks, ``heads / cp`` each, with the ``shared`` heads they read
    (key/value heads, Mamba2's B/C groups; head ``h`` reads shared head ``h // (heads / shared)``): each rank
    then reads whole shared heads (``shared`` a multiple of ``cp``) or a share of one (a divisor of ``cp``).
    The rule of the head-parallel exchange (Ulysses' attention, the hybrid models' token mixers), and of the
    plan's candidates."""
    return heads % cp == 0 and heads % shared == 0 and (shared % cp == 0 or cp % shared == 0)


def data_parallel_size(world_size: int, cp: int, tp: int) -> int:
    """``dp = world_size / (cp * tp)``, or a ``ValueError`` that shows the arithmetic."""
    if world_size % (cp * tp):
        raise ValueError(
            f"world size {world_size} is not divisible by cp({cp}) * tp({tp}) = {cp * tp}: "
            f"dp * cp * tp must equal the world size. Use a number of processes that is a multiple of "
            f"{cp * tp}, or change cp / tp."
        )
    return world_size // (cp * tp)


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes, coordinates and process groups of this rank in the DP x CP x TP grid.

    ``ParallelLayout()`` is the single-process layout (every size 1, no groups). Validated on
    construction: the sizes multiply to ``world_size``, the coordinates are in range and agree with
    ``rank``, and each group is given exactly when its dimension is larger than 1.

    Example::

        layout = trainer.strategy.layout        # or lightning_cp.parallel.current_layout()
        if layout.cp > 1:
            shard = shard_batch(batch, layout.cp, layout.cp_rank, cp_group=layout.cp_group)
    """

    dp: int = 1
    """Data-parallel size: replicas that see different samples."""
    cp: int = 1
    """Context-parallel size: ranks that share every sequence, each holding ``2`` of its ``2 * cp`` chunks."""
    tp: int = 1
    """Tensor-parallel size: ranks that share every layer's weights."""
    rank: int = 0
    """Global rank of this process."""
    dp_rank: int = 0
    cp_rank: int = 0
    tp_rank: int = 0
    cp_group: ProcessGroup | None = None
    """The ``cp`` ranks that hold the same samples and the same weights (attention all-gathers over it)."""
    tp_group: ProcessGroup | None = None
    """The ``tp`` ranks that split the weights (the vocabulary-parallel loss reduces over it)."""
    dp_group: ProcessGroup | None = None
    """The ``dp`` ranks with this rank's CP and TP coordinates (per-sequence metrics reduce over it)."""
    loss_group: ProcessGroup | None = None
    """The ``dp * cp`` ranks of DP x CP: gradients, token counts and loss sums are reduced over it."""

    def __post_init__(self) -> None:
        for name in ("dp", "cp", "tp"):
            check_size(name, getattr(self, name))
        world = self.world_size
        if not 0 <= self.rank < world:
            raise ValueError(f"rank {self.rank} is outside the world of dp * cp * tp = {world} ranks.")
        for name, size in (("dp", self.dp), ("cp", self.cp), ("tp", self.tp)):
            coordinate = getattr(self, f"{name}_rank")
            if not 0 <= coordinate < size:
                raise ValueError(f"{name}_rank {coordinate} is outside [0, {name}={size}).")
        expected = self.tp_rank + self.tp * (self.cp_rank + self.cp * self.dp_rank)
        if self.rank != expected:
            raise ValueError(
                f"rank {self.rank} does not sit at (dp_rank={self.dp_rank}, cp_rank={self.cp_rank}, "
                f"tp_rank={self.tp_rank}): with TP fastest, then CP, then DP that is rank {expected}."
            )
        for name, size in (("cp", self.cp), ("tp", self.tp), ("dp", self.dp), ("loss", self.dp * self.cp)):
            group = getattr(self, f"{name}_group")
            if (group is None) != (size == 1):
                state = "missing" if group is None else "given"
                raise ValueError(
                    f"{name}_group is {state} for a dimension of size {size}: a group is None exactly when "
                    "its size is 1 (None means no communication)."
                )

    @property
    def world_size(self) -> int:
        """``dp * cp * tp``."""
        return self.dp * self.cp * self.tp

    def tag(self) -> str:
        """``dp1-cp0-tp0``: this rank's coordinates, for file names and log messages."""
        return f"dp{self.dp_rank}-cp{self.cp_rank}-tp{self.tp_rank}"

    @classmethod
    def data_parallel(cls) -> ParallelLayout:
        """Plain data parallelism over the default process group (plain DDP), or one process without one."""
        if not (dist.is_available() and dist.is_initialized()):
            return cls()
        world, rank = dist.get_world_size(), dist.get_rank()
        group = dist.group.WORLD if world > 1 else None
        return cls(dp=world, rank=rank, dp_rank=rank, dp_group=group, loss_group=group)


_current: ParallelLayout | None = None


def current_layout() -> ParallelLayout:
    """The layout of the running :class:`~lightning_cp.MegatronCPStrategy`, if one is set up.

    Otherwise :meth:`ParallelLayout.data_parallel`: plain data parallelism over the default process group
    (what DDP reduces over), or the single-process layout.
    """
    return _current if _current is not None else ParallelLayout.data_parallel()


def set_current_layout(layout: ParallelLayout | None) -> None:
    """Make ``layout`` the :func:`current_layout` of this process (``None``: back to the default).

    The strategy calls it in ``setup_distributed`` and ``teardown``; tests that build Megatron's groups
    without a strategy call it themselves.
    """
    global _current
    _current = layout
