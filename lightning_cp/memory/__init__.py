"""Memory savings beyond activation checkpointing: the MLP computed over sequence tiles."""

from lightning_cp.memory.tiled_mlp import auto_tile_tokens, tile_mlps, tiled_mlp

__all__ = ["auto_tile_tokens", "tile_mlps", "tiled_mlp"]
