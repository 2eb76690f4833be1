"""Names and values every part of the package shares: the batch contract's keys and the ignore label.

This module imports nothing itself (importing it still runs ``lightning_cp/__init__.py``, which imports
Lightning but never Megatron-core). The batch contract is described in ``docs/design.md`` ("The batch
contract").
"""

IGNORE_INDEX = -100
"""Label of positions that are not targets (matches ``torch.nn.functional.cross_entropy``)."""

INPUT_IDS = "input_ids"
"""``[B, S]`` (padded) or ``[1, T]`` (packed) integer token ids; the only required key."""
LABELS = "labels"
"""Before sharding: aligned with ``input_ids`` (not shifted). After: the next token, or ``IGNORE_INDEX``."""
LOSS_MASK = "loss_mask"
"""1 where the token is a target (before sharding) / where the label counts (after)."""
POSITION_IDS = "position_ids"
"""Each token's position inside its sequence (restarting at 0 in every packed document)."""
INPUT_MASK = "input_mask"
"""True on real tokens, False on padding (collate padding and the padding added by the CP split)."""
CU_SEQLENS = "cu_seqlens"
"""Packed batches: ``[n + 1]`` boundaries of the documents (before sharding: of the full row; after: local)."""
CU_SEQLENS_PADDED = "cu_seqlens_padded"
"""Packed batches after sharding: ``[n + 1]`` boundaries of the documents padded to a multiple of ``2 * cp``."""
CP_SHARD = "cp_shard"
"""After sharding: the :class:`lightning_cp.parallel.CPShard` of the batch (what attention needs)."""
