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

ADVANTAGES = "advantages"
"""Reinforcement learning: ``[B, S]`` float, the advantage of the completion a target token belongs to."""
OLD_LOGPROBS = "old_logprobs"
"""Reinforcement learning: ``[B, S]`` float, each target token's log-probability under the sampling policy."""
REF_LOGPROBS = "ref_logprobs"
"""Reinforcement learning: ``[B, S]`` float, each target token's log-probability under the reference model."""
ROLLOUT_INDEX = "rollout_index"
"""Reinforcement learning: ``[B, S]`` int64, the row of the rollout file every token comes from."""
TARGET_KEYS = (ADVANTAGES, OLD_LOGPROBS, REF_LOGPROBS)
"""Per-token values about a target token. Before sharding they sit on the token itself, like ``labels``;
``shard_batch`` shifts them with the labels, so that after it the value at ``t`` belongs to the label at ``t``
(0 where there is no target)."""

ATTN_IMPLEMENTATION = "lightning_cp"
"""The attention implementation to give ``transformers``: ``from_pretrained(..., attn_implementation="lightning_cp")``
(:mod:`lightning_cp.hf` registers it)."""
