"""Which layouts fit: every candidate on a number of GPUs, ordered by communication, and the longest
sequence that fits."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_cp.parallel.layout import heads_split
from lightning_cp.plan.memory import Layout, MemoryEstimate, Precision, estimate
from lightning_cp.plan.shape import ModelShape

SAVINGS: tuple[tuple[bool, bool, bool], ...] = (
    (False, False, False),
    (False, False, True),
    (True, False, False),
    (True, False, True),
    (True, True, False),
    (True, True, True),
)
"""``(checkpointing, offload, tiled)`` combinations tried, from no recomputation to the most."""


@dataclass(frozen=True)
class Candidate:
    """A layout and its estimate."""

    layout: Layout
    estimate: MemoryEstimate

    def fits(self, gpu_bytes: int) -> bool:
        """The peak (reserve included) is within ``gpu_bytes``."""
        return self.estimate.peak <= gpu_bytes

    def cost(self) -> tuple[int, int, int]:
        """Sort key: bytes communicated per step, then recomputation (checkpointing, tiles), then host copies."""
        layout = self.layout
        return (self.estimate.communication, layout.checkpointing + layout.tiled, int(layout.offload))


def layouts(gpus: int, shape: ModelShape | None = None) -> list[Layout]:
    """Every candidate on ``gpus`` ranks: ``cp`` a power of two dividing ``gpus`` (and, for a hybrid
    ``shape``, splitting its mixers' heads: the cap the head counts put on ``cp``), DDP or FSDP, each
    combination of :data:`SAVINGS`, and under CP each attention of :func:`attentions`."""
    if gpus < 1:
        raise ValueError(f"gpus={gpus} must be positive.")
    sizes = [cp for cp in (2**i for i in range(gpus.bit_length())) if gpus % cp == 0]
    if shape is not None and shape.mixer is not None:
        sizes = [cp for cp in sizes if shape.mixer.splits(cp)]
    return [
        Layout(gpus, cp, fsdp, checkpointing, offload, tiled, attention, heads_per_gather)
        for cp in sizes
        for attention, heads_per_gather in attentions(cp, shape)
        for fsdp in (False, True)
        for checkpointing, offload, tiled in SAVINGS
    ]


def attentions(cp: int, shape: ModelShape | None = None) -> list[tuple[str, int | None]]:
    """The CP attentions tried at ``cp``: ``(cp_attention, kv_heads_per_gather)``. The all-gather of every
    key/value head at once; with ``shape``, also one head per round (the smallest K/V transient, the same
    bytes sent) and Ulysses where the heads split over ``cp``
    (:func:`~lightning_cp.parallel.layout.heads_split`). Without CP, none."""
    if cp == 1 or shape is None:
        return [("allgather", None)]
    found: list[tuple[str, int | None]] = [("allgather", None)]
    if shape.kv_heads > 1:
        found.append(("allgather", 1))
    if heads_split(shape.heads, shape.kv_heads, cp):
        found.append(("ulysses", None))
    return found


def plan(
    shape: ModelShape,
    seq_len: int,
    gpus: int,
    *,
    precision: Precision = "bf16-mixed",
    loss_chunk: int | None = None,
) -> list[Candidate]:
    """Every candidate of :func:`layouts`, cheapest in communication first (see :meth:`Candidate.cost`)."""
    found = [
        Candidate(layout, estimate(shape, seq_len, layout, precision=precision, loss_chunk=loss_chunk))
        for layout in layouts(gpus, shape)
    ]
    return sorted(found, key=Candidate.cost)


def max_seq_len(
    shape: ModelShape,
    layout: Layout,
    gpu_bytes: int,
    *,
    precision: Precision = "bf16-mixed",
    loss_chunk: int | None = None,
    step: int = 1024,
) -> int:
    """The longest sequence, a multiple of ``step``, whose peak on ``layout`` is within ``gpu_bytes``
    (0 when not even ``step`` tokens fit). The peak grows with the length, so a bisection finds it."""

    def fits(tokens: int) -> bool:
        return estimate(shape, tokens, layout, precision=precision, loss_chunk=loss_chunk).peak <= gpu_bytes

    if not fits(step):
        return 0
    low, high = 1, 2
    while fits(high * step):
        low, high = high, 2 * high
        if high > 2**40 // step:
            raise ValueError("max_seq_len: the peak does not grow with the length; check the model shape.")
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle * step) else (low, middle)
    return low * step
