"""Distributed building blocks: plain functions over torch.distributed, no Lightning imports."""

from lightning_cp.parallel import groups
from lightning_cp.parallel.attention import context_parallel_attention
from lightning_cp.parallel.collectives import all_gather
from lightning_cp.parallel.sharding import shard_batch, unshard

__all__ = ["all_gather", "context_parallel_attention", "groups", "shard_batch", "unshard"]
