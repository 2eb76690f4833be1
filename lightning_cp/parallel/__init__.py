"""Distributed building blocks: plain functions over torch.distributed, no Lightning imports.

- :class:`ParallelLayout`, :func:`current_layout`: sizes, coordinates and groups of the DP x CP x TP grid.
- :class:`CPSplit`, :func:`shard_batch`, :func:`unshard`, :class:`CPShard`: the load-balanced split of
  sequences over CP ranks, and what attention needs of it (computed once per batch, carrying its CP group).
- :class:`GroupExchange`: the collectives of a CP group, the one seam through which layers reach peers.
- :func:`context_parallel_attention`: causal attention over whole sequences from each rank's shard.

The modules the strategy drives are imported from themselves: :mod:`~lightning_cp.parallel.groups`
(creating and destroying Megatron-core's groups) and ``layout.set_current_layout`` (what the running
strategy makes current).
"""

from lightning_cp.parallel.attention import context_parallel_attention
from lightning_cp.parallel.exchange import GroupExchange
from lightning_cp.parallel.layout import ParallelLayout, current_layout
from lightning_cp.parallel.shard import CPShard
from lightning_cp.parallel.sharding import shard_batch, unshard
from lightning_cp.parallel.split import CPSplit

__all__ = [
    "CPShard",
    "CPSplit",
    "GroupExchange",
    "ParallelLayout",
    "context_parallel_attention",
    "current_layout",
    "shard_batch",
    "unshard",
]
