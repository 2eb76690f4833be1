"""Memory savings beyond activation checkpointing: the MLPs, experts and norms computed over sequence tiles, and the
inputs of checkpointed layers held in host memory between forward and backward."""

from lightning_cp.memory.offload import (
    MIN_OFFLOAD_BYTES,
    ActivationOffload,
    OffloadStats,
    offload_checkpointed,
)
from lightning_cp.memory.tiling import (
    auto_tile_tokens,
    has_experts,
    tile_experts,
    tile_mlps,
    tile_model,
    tile_norms,
    tile_projections,
    tiled_mlp,
)

__all__ = [
    "MIN_OFFLOAD_BYTES",
    "ActivationOffload",
    "OffloadStats",
    "auto_tile_tokens",
    "has_experts",
    "offload_checkpointed",
    "tile_experts",
    "tile_mlps",
    "tile_model",
    "tile_norms",
    "tile_projections",
    "tiled_mlp",
]
