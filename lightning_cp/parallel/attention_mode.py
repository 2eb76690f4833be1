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
  (:mod:`lightning_cp.parallel.head_parallel`). Each rank holds the whole sequences' K/V of the key/value
  heads it reads (``max(Hkv, cp) / cp`` heads' worth), not every head's; ``Hq`` must split over ``cp``.
- ``"auto"``: Ulysses where the heads split over ``cp`` (``Hq % cp == 0`` and ``Hkv`` a multiple or a
  divisor of ``cp``), else the all-gather.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from lightning_cp.parallel.exchange import GroupExchange
from lightning_cp.parallel.layout import heads_split

AttentionKind = Literal["allgather", "ulysses", "auto"]
ATTENTION_KINDS: tuple[AttentionKind, ...] = ("allgather", "ulysses", "auto")

KV_GATHER_MEMORY_FRACTION = 0.25
"""With ``kv_heads_per_gather=None`` on CUDA, the key/value heads of one round keep their copies at the
backward's peak (:func:`gathered_bytes_per_head`) within this fraction of the least memory free on any rank
of the CP group."""

ROUND_COPIES = 3
"""Sequence-sized copies of one all-gather round's keys and values (in their dtype) alive at once at the
backward's peak. In bf16 (CUDA): the gathered keys and values and their fp32 gradients, added at their
gathered rows of the buffer that is reduce-scattered (the FlashAttention path and the sparse attention hold
them so); in fp32 (the CPU's torch path): the keys and values, their gradients in sequence order and at the
gathered rows (measured on the CPU)."""


def gathered_bytes_per_head(tokens: int, key_dim: int, value_dim: int, element_size: int) -> int:
    """Bytes one key/value head of an all-gather round takes at the backward's peak, for ``tokens`` gathered
    keys of ``key_dim`` and values of ``value_dim``: :data:`ROUND_COPIES` copies. What the rounds' budget
    divides (:meth:`AttentionMode.heads_per_gather`) and the memory plan counts, one definition for both."""
    return ROUND_COPIES * tokens * (key_dim + value_dim) * element_size


@dataclass(frozen=True)
class AttentionMode:
    """The CP attention of a batch: which exchange, and (all-gather) how many key/value heads per round.

    Raises:
        ValueError: an unknown ``kind``, a ``kv_heads_per_gather`` that is not a positive integer, or one
            given with ``kind="ulysses"`` (which gathers no key/value heads).
    """

    kind: AttentionKind = "allgather"
    kv_heads_per_gather: int | None = None
    """All-gather: key/value heads gathered per round; ``None``: as many as fit
    :data:`KV_GATHER_MEMORY_FRACTION` of the free device memory (CUDA; agreed over the CP group once per
    batch, :meth:`gather_budget`), every head at once elsewhere. A value that does not divide the model's
    ``Hkv`` takes its largest divisor below it."""

    def __post_init__(self) -> None:
        if self.kind not in ATTENTION_KINDS:
            raise ValueError(f"cp_attention={self.kind!r}: choose one of {', '.join(ATTENTION_KINDS)}.")
        heads = self.kv_heads_per_gather
        if heads is not None and (isinstance(heads, bool) or not isinstance(heads, int) or heads < 1):
            raise ValueError(
                f"kv_heads_per_gather={heads!r} must be a positive integer, or None (automatic)."
            )
        if heads is not None and self.kind == "ulysses":
            raise ValueError(
                f"kv_heads_per_gather={heads} sizes the rounds of the key/value all-gather, which "
                "cp_attention='ulysses' never runs: remove kv_heads_per_gather, or use cp_attention='allgather' "
                "(or 'auto', which gathers where the heads do not split)."
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

    def gather_budget(self, device: torch.device, exchange: GroupExchange | None) -> int | None:
        """The bytes one all-gather round's key/value copies may take on every rank of ``exchange``'s CP
        group, for a batch on ``device``; ``None``: no budget (every key/value head in one round, or
        :attr:`kv_heads_per_gather` per round).

        Only ``kv_heads_per_gather=None`` on CUDA under CP has a budget: :data:`KV_GATHER_MEMORY_FRACTION` of
        the *least* memory free for the process (the device's free memory and what torch's caching allocator
        holds unused) on any rank of the group. The rounds set how many collectives run over the group, so
        every rank must size them alike: :func:`~lightning_cp.parallel.shard_batch` asks once per batch and
        the shard carries the answer to every layer (and to a checkpointed layer's recomputation).

        Communication: on CUDA under CP with ``kv_heads_per_gather=None``, one all-reduce (MIN) of one
        integer over the group, read back on the host; otherwise none.
        """
        if self.kv_heads_per_gather is not None or self.kind == "ulysses":
            return None
        if exchange is None or exchange.size == 1 or not _is_cuda(device):
            return None
        free, _ = torch.cuda.mem_get_info(device)
        available = free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(KV_GATHER_MEMORY_FRACTION * exchange.agree_min(available))

    def heads_per_gather(self, kv_heads: int, gathered_bytes_per_head: int, budget: int | None) -> int:
        """Key/value heads per all-gather round (a divisor of ``kv_heads``) for heads whose copies take
        ``gathered_bytes_per_head`` bytes each (:func:`gathered_bytes_per_head`): :attr:`kv_heads_per_gather`, else as many as
        ``budget`` (:meth:`gather_budget`) holds, else all of them. A count that does not divide
        ``kv_heads`` takes its largest divisor below it. From its arguments only, so every rank given the
        same shapes and budget gathers alike."""
        per_round = self.kv_heads_per_gather
        if per_round is None:
            if budget is None or gathered_bytes_per_head == 0:
                return kv_heads
            per_round = max(1, budget // gathered_bytes_per_head)
        per_round = min(per_round, kv_heads)
        while kv_heads % per_round:
            per_round -= 1
        return per_round


def _is_cuda(device: torch.device) -> bool:
    """Whether ``device`` is a CUDA device, the only kind whose free memory sizes the rounds."""
    return device.type == "cuda"
