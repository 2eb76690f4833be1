"""Which layouts fit: every candidate on a number of GPUs, ordered by communication, and the longest
sequence that fits."""

from __future__ import annotations

from dataclasses import dataclass, replace

from lightning_cp.parallel.layout import heads_split
from lightning_cp.plan.activations import Precision, local_tokens
from lightning_cp.plan.layout import Layout
from lightning_cp.plan.lora import LoRA
from lightning_cp.plan.memory import TRANSIENTS, MemoryEstimate, estimate
from lightning_cp.plan.shape import Architecture, ModelShape
from lightning_cp.plan.terms import loss_chunk_tokens

MIN_LOSS_CHUNK = 1024
"""The smallest chunk (tokens) the plan gives the fused loss to lower the peak: a ``[1024, d] x [d, vocab]``
product still fills a GPU."""

SAVINGS: tuple[tuple[bool, bool, bool], ...] = (
    (False, False, False),
    (False, False, True),
    (True, False, False),
    (True, False, True),
    (True, True, False),
    (True, True, True),
)
"""``(checkpointing, offload, tiled)`` combinations tried, from no recomputation to the most."""

MODULE_CLASSES: dict[Architecture, str] = {
    "gpt": "lightning_cp.models.GPTModule",
    "hf": "lightning_cp.models.HFCausalLM",
}
"""The ``LightningModule`` that trains each :attr:`~lightning_cp.plan.ModelShape.architecture`: the class the
plan's model arguments (``tiled``, ``chunk_size``) are given to, which takes every one of them."""


@dataclass(frozen=True)
class Candidate:
    """A layout, the fused loss's chunk it is planned with, and its estimate."""

    layout: Layout
    estimate: MemoryEstimate
    loss_chunk: int | None = None
    """Tokens per chunk of the fused loss (``chunk_size``); ``None``: the automatic one."""
    precision: Precision = "bf16-mixed"
    """The ``Trainer(precision=...)`` the estimate assumes."""
    lora: LoRA | None = None
    """The LoRA adapters the estimate assumes (``HFCausalLM(lora=...)``); ``None``: full fine-tuning."""

    def fits(self, gpu_bytes: int, host_bytes: int | None = None) -> bool:
        """The peak (reserve included) is within ``gpu_bytes``, and what the rank keeps on the host within
        ``host_bytes`` (``None``: not checked)."""
        host = host_bytes is None or self.estimate.host <= host_bytes
        return self.estimate.peak <= gpu_bytes and host

    def cost(self) -> tuple[int, int, int, int]:
        """Sort key: the model state on the host last (its transfers and the optimizer step on the host CPU
        are slower than any collective), then bytes communicated per step, recomputation (checkpointing,
        tiles), and the offloaded activations' copies."""
        layout = self.layout
        return (
            int(layout.cpu_offload),
            self.estimate.communication,
            layout.checkpointing + layout.tiled,
            int(layout.offload),
        )

    def arguments(self, shape: ModelShape) -> dict[str, dict[str, object]]:
        """What gives this layout: ``{"strategy": MegatronCP(FSDP)Strategy's init_args, "model":
        HFCausalLM's}``, the arguments that differ from their defaults."""
        layout = self.layout
        strategy: dict[str, object] = {"cp": layout.cp}
        if layout.checkpointing:
            strategy["activation_checkpointing"] = list(shape.layer_classes)
        if layout.offload:
            strategy["offload_activations"] = layout.offload_layers or True
        if layout.cp > 1 and layout.attention == "ulysses":
            strategy["cp_attention"] = "ulysses"
        if layout.cp > 1 and layout.kv_heads_per_gather is not None:
            strategy["kv_heads_per_gather"] = layout.kv_heads_per_gather
        if layout.cpu_offload:
            strategy["cpu_offload"] = True
        model: dict[str, object] = {}
        if layout.tiled:
            model["tiled"] = True
        if self.loss_chunk is not None:
            model["chunk_size"] = self.loss_chunk
        if self.lora is not None:
            model["lora"] = self.lora.argument()
            if self.precision == "bf16-mixed":  # the frozen base in bf16, as counted; the adapters in fp32
                model["dtype"] = "bfloat16"
        return {"strategy": strategy, "model": model}

    def config(self, shape: ModelShape) -> dict[str, dict[str, object]]:
        """The part of a ``lightning-cp fit`` config that gives this layout: the Trainer's precision, the
        strategy's class and :meth:`arguments`, and the class of :data:`MODULE_CLASSES` that trains ``shape``
        with its own (the model's config and the data are the user's)."""
        arguments = self.arguments(shape)
        strategy = "MegatronCPFSDPStrategy" if self.layout.fsdp else "MegatronCPStrategy"
        model: dict[str, object] = {"class_path": MODULE_CLASSES[shape.architecture]}
        if arguments["model"]:
            model["init_args"] = arguments["model"]
        return {
            "trainer": {
                "precision": self.precision,
                "strategy": {"class_path": f"lightning_cp.{strategy}", "init_args": arguments["strategy"]},
            },
            "model": model,
        }


def layouts(gpus: int, shape: ModelShape | None = None) -> list[Layout]:
    """Every candidate on ``gpus`` ranks: ``cp`` a power of two dividing ``gpus`` (and, for a hybrid
    ``shape``, splitting its mixers' heads: the cap the head counts put on ``cp``), DDP, FSDP or FSDP with
    the model state on the host, each combination of :data:`SAVINGS`, and under CP each attention of
    :func:`attentions`."""
    if gpus < 1:
        raise ValueError(f"gpus={gpus} must be positive.")
    sizes = [cp for cp in (2**i for i in range(gpus.bit_length())) if gpus % cp == 0]
    if shape is not None and shape.mixer is not None:
        sizes = [cp for cp in sizes if shape.mixer.splits(cp)]
    wrappers = ((False, False), (True, False), (True, True))  # (fsdp, cpu_offload)
    return [
        Layout(gpus, cp, fsdp, checkpointing, offload, tiled, attention, heads_per_gather, cpu_offload)
        for cp in sizes
        for attention, heads_per_gather in attentions(cp, shape)
        for fsdp, cpu_offload in wrappers
        for checkpointing, offload, tiled in SAVINGS
    ]


def attentions(cp: int, shape: ModelShape | None = None) -> list[tuple[str, int | None]]:
    """The CP attentions tried at ``cp``: ``(cp_attention, kv_heads_per_gather)``. The all-gather of every
    key/value head at once; with ``shape``, also one head per round (the smallest K/V transient, the same
    bytes sent) and Ulysses where the heads split over ``cp``
    (:func:`~lightning_cp.parallel.layout.heads_split`) and the attention is dense (sparse attention
    all-gathers). Without CP, none."""
    if cp == 1 or shape is None:
        return [("allgather", None)]
    found: list[tuple[str, int | None]] = [("allgather", None)]
    if shape.kv_heads > 1:
        found.append(("allgather", 1))
    if shape.sparse is None and heads_split(shape.heads, shape.kv_heads, cp):
        found.append(("ulysses", None))
    return found


def plan(
    shape: ModelShape,
    seq_len: int,
    gpus: int,
    *,
    precision: Precision = "bf16-mixed",
    loss_chunk: int | None = None,
    lora: LoRA | None = None,
    host_bytes: int | None = None,
) -> list[Candidate]:
    """Every candidate of :func:`layouts` (:func:`candidate`), cheapest first (see :meth:`Candidate.cost`)."""
    found = [
        candidate(shape, seq_len, layout, precision, loss_chunk, lora, host_bytes)
        for layout in layouts(gpus, shape)
    ]
    return sorted(found, key=Candidate.cost)


def candidate(
    shape: ModelShape,
    seq_len: int,
    layout: Layout,
    precision: Precision = "bf16-mixed",
    loss_chunk: int | None = None,
    lora: LoRA | None = None,
    host_bytes: int | None = None,
) -> Candidate:
    """``layout`` planned with the fused loss's ``loss_chunk``; when that is ``None`` (automatic) and the loss
    is the step's largest transient, with the chunk that brings it down to the next largest
    (:func:`memory_chunk`), which lowers the peak. Where ``host_bytes`` of host memory per rank cannot hold
    every offloaded layer input, only as many layers' go to the host as it holds (:func:`host_split`)."""
    options = {"precision": precision, "lora": lora}
    layout = host_split(shape, seq_len, layout, host_bytes, loss_chunk=loss_chunk, **options)
    planned = estimate(shape, seq_len, layout, loss_chunk=loss_chunk, **options)
    chunk = memory_chunk(shape, seq_len, layout, planned) if loss_chunk is None else None
    if chunk is None:
        return Candidate(layout, planned, loss_chunk, precision, lora)
    chunked = estimate(shape, seq_len, layout, loss_chunk=chunk, **options)
    return Candidate(layout, chunked, chunk, precision, lora)


def host_split(
    shape: ModelShape, seq_len: int, layout: Layout, host_bytes: int | None, **options: object
) -> Layout:
    """``layout`` with as many layers' inputs offloaded (:attr:`~lightning_cp.plan.Layout.offload_layers`) as
    keep what it holds on the host within ``host_bytes``, the others' inputs kept on the GPU; ``layout``
    itself when it offloads nothing, the host holds every layer's input, or not even one's (it does not fit).
    ``options``: :func:`estimate`'s."""
    if not layout.offload or host_bytes is None or layout.offload_layers is not None:
        return layout
    if estimate(shape, seq_len, layout, **options).host <= host_bytes:
        return layout

    def host(layers: int) -> int:
        return estimate(shape, seq_len, replace(layout, offload_layers=layers), **options).host

    if host(1) > host_bytes:
        return layout
    low, high = 1, shape.layers  # host(low) fits, host(high) does not
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if host(middle) <= host_bytes else (low, middle)
    return replace(layout, offload_layers=low)


def memory_chunk(shape: ModelShape, seq_len: int, layout: Layout, planned: MemoryEstimate) -> int | None:
    """The fused loss's chunk (tokens) whose transient is no larger than the other transients of ``planned``
    (``layout``'s estimate with the automatic chunk): a multiple of :data:`MIN_LOSS_CHUNK`, at least that.
    ``None`` when the loss is not the largest transient or that chunk is not smaller than the automatic one.

    Only the loss's two fp32 ``[chunk, vocab]`` blocks depend on the chunk: the rest of its transient stays."""
    if planned.largest_transient != "loss":
        return None
    tokens = local_tokens(seq_len, layout.cp)
    automatic = min(loss_chunk_tokens(shape, tokens), tokens)
    blocks = 2 * 4 * shape.vocab  # bytes of the two fp32 blocks per chunk token
    rest = planned.loss - automatic * blocks
    others = max(planned.counted_transient(name) for name in TRANSIENTS if name != "loss")
    chunk = max(MIN_LOSS_CHUNK, (others - rest) // blocks // MIN_LOSS_CHUNK * MIN_LOSS_CHUNK)
    return chunk if chunk < automatic else None


def max_seq_len(
    shape: ModelShape,
    layout: Layout,
    gpu_bytes: int,
    *,
    precision: Precision = "bf16-mixed",
    loss_chunk: int | None = None,
    host_bytes: int | None = None,
    lora: LoRA | None = None,
    step: int = 1024,
) -> int:
    """The longest sequence, a multiple of ``step``, that :func:`candidate` fits within ``gpu_bytes`` (and
    ``host_bytes`` of host memory per rank, when given); 0 when not even ``step`` tokens fit. The peak grows
    with the length, so a bisection finds it."""

    def fits(tokens: int) -> bool:
        found = candidate(shape, tokens, layout, precision, loss_chunk, lora, host_bytes)
        return found.fits(gpu_bytes, host_bytes)

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
