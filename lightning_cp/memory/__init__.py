"""Memory savings beyond activation checkpointing: the MLP computed over sequence tiles, and the inputs of
checkpointed layers held in host memory between forward and backward."""

from lightning_cp.memory.offload import (
    MIN_OFFLOAD_BYTES,
    ActivationOffload,
    OffloadStats,
    offload_checkpointed,
)
from lightning_cp.memory.tiled_mlp import auto_tile_tokens, tile_mlps, tiled_mlp

__all__ = [
    "MIN_OFFLOAD_BYTES",
    "ActivationOffload",
    "OffloadStats",
    "auto_tile_tokens",
    "offload_checkpointed",
    "tile_mlps",
    "tiled_mlp",
]
