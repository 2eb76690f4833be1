"""How CP attention reaches the other ranks' tokens: all-gathered keys and values, or Ulysses' all-to-all.

The batch's :class:`~lightning_cp.parallel.CPShard` carries an :class:`AttentionMode` (the strategies'
``cp_attention`` and ``kv_heads_per_gather`` arguments), so every attention layer of the batch works the same
way without a setting of its own:

- ``"allgather"``: every rank keeps its own queries and all-gathers the key/value heads, in rounds of
  ``kv_heads_per_gather`` heads (each query head reads only its own key/value head, so the numbers do not
  change): the whole sequence's K/V transient is ``kv_heads_per_gather / Hkv`` of all heads'. Any head counts.
- ``"ulysses"``: one all-to-all gives each rank every token of ``Hq / cp`` query heads and the key/value
  heads they read (replicated when ``Hkv < cp``, as DeepSpeed's Ulysses does), the best single-device kernel
  runs on whole sequences, and one all-to-all brings the output back
  (:mod:`lightning_cp.parallel.head_parallel`). No sequence-sized K/V copy; ``Hq`` must split over ``cp``.
- ``"auto"``: Ulysses where the heads split over ``cp`` (``Hq % cp == 0`` and ``Hkv`` a multiple or a
  divisor of ``cp``), else the all-gather.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from lightning_cp.parallel.layout import heads_split

AttentionKind = Literal["allgather", "ulysses", "auto"]
ATTENTION_KINDS: tuple[AttentionKind, ...] = ("allgather", "ulysses", "auto")

KV_GATHER_MEMORY_FRACTION = 0.25
"""With ``kv_heads_per_gather=None`` on CUDA, the key/value heads of one round keep their two sequence-sized
copies within this fraction of the free device memory."""


@dataclass(frozen=True)
class AttentionMode:
    """The CP attention of a batch: which exchange, and (all-gather) how many key/value heads per round.

    Raises:
        ValueError: an unknown ``kind``, or a ``kv_heads_per_gather`` that is not a positive integer.
    """

    kind: AttentionKind = "allgather"
    kv_heads_per_gather: int | None = None
    """All-gather: key/value heads gathered per round; ``None``: as many as fit
    :data:`KV_GATHER_MEMORY_FRACTION` of the free device memory (CUDA), every head at once elsewhere. A
    value that does not divide the model's ``Hkv`` takes its largest divisor below it."""

    def __post_init__(self) -> None:
        if self.kind not in ATTENTION_KINDS:
            raise ValueError(f"cp_attention={self.kind!r}: choose one of {', '.join(ATTENTION_KINDS)}.")
        heads = self.kv_heads_per_gather
        if heads is not None and (isinstance(heads, bool) or not isinstance(heads, int) or heads < 1):
            raise ValueError(
                f"kv_heads_per_gather={heads!r} must be a positive integer, or None (automatic)."
            )

    def ulysses(self, heads: int, kv_heads: int, cp: int) -> bool:
        """Whether attention of ``heads`` query and ``kv_heads`` key/value heads over ``cp`` ranks is Ulysses'.

        Raises:
            ValueError: ``"ulysses"`` with heads that do not split over ``cp`` (naming the numbers).
        """
        splits = heads_split(heads, kv_heads, cp)
        if self.kind == "ulysses" and not splits:
            raise ValueError(
                f"cp_attention='ulysses' splits the query heads over the CP ranks, but {heads} query heads and "
                f"{kv_heads} key/value heads do not split over cp={cp} (query heads a multiple of cp, key/value "
                "heads a multiple or a divisor of it): use cp_attention='allgather' or 'auto', or another cp."
            )
        return cp > 1 and self.kind != "allgather" and splits

    def gather_rounds(self, kv_heads: int, gathered_bytes_per_head: int, device: torch.device) -> int:
        """How many rounds the all-gather takes for ``kv_heads`` heads (a divisor of ``kv_heads``), each
        gathering ``kv_heads / rounds`` heads whose two sequence-sized copies take
        ``gathered_bytes_per_head`` bytes per head."""
        per_round = self.kv_heads_per_gather
        if per_round is None:
            if device.type != "cuda" or gathered_bytes_per_head == 0:
                return 1
            free, _ = torch.cuda.mem_get_info(device)
            per_round = max(1, int(KV_GATHER_MEMORY_FRACTION * free) // gathered_bytes_per_head)
        per_round = min(per_round, kv_heads)
        while kv_heads % per_round:
            per_round -= 1
        return kv_heads // per_round
