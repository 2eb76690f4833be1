"""Per-rank memory of one training step of a decoder under a layout: pure arithmetic over a ModelShape.

:func:`estimate` puts together the terms of :class:`MemoryEstimate`, each counted by its function of
:mod:`lightning_cp.plan.terms` (the saved activations per token: :mod:`lightning_cp.plan.activations`). Every
term counts the tensors the package's code holds (see docs/design.md, "Memory plan"), as
``tests/plan/test_measured.py`` measures them. One sequence of ``seq_len`` tokens per rank and micro-batch
(packed documents count the same), ``tp = 1``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from lightning_cp.plan.activations import PRECISIONS, Precision, local_tokens, mlp_side_per_token
from lightning_cp.plan.layout import Layout
from lightning_cp.plan.lora import LoRA
from lightning_cp.plan.shape import ModelShape
from lightning_cp.plan.terms import (
    Step,
    activations,
    attention_transient,
    cp_communication,
    dequantized,
    frozen_norms,
    layer_saved,
    loss_transient,
    mixer_transient,
    mlp_transient,
    model_state,
    recompute,
    sparse_terms,
    wrapper_communication,
)

GiB = 2**30
RESERVE_BYTES = 2 * GiB
"""Reserve for what the allocator's count misses: the CUDA context, NCCL's buffers, the caching allocator's
own fragmentation floor."""
RESERVE_FRACTION = 0.05
"""... plus this fraction of everything counted (fragmentation grows with the allocations)."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank, by what holds them; :attr:`peak` is what the device must hold."""

    parameters: int
    """Master weights (sharded over ``dp * cp`` under FSDP); under LoRA the frozen base (in the compute
    dtype, QLoRA's linear weights in NF4) and the adapters' master weights."""
    gradients: int
    """Gradients, plus DDP's bucket copy when DDP wraps the model (``gradient_as_bucket_view`` off)."""
    optimizer: int
    """AdamW's two states per parameter, in the master weights' dtype."""
    fsdp_gathered: int
    """FSDP only: the unsharded root (the head, the final norm, and the token embedding when tied) in the
    compute dtype for the step, and two decoder units' parameters plus one unit's gradients (in compute
    dtype and fp32 for the reduce-scatter). An untied embedding is a unit of its own, gathered only for its
    forward and its backward, away from the peak."""
    activations: int
    """Saved for backward over the whole forward: every layer's saved tensors, or only each layer's input
    under checkpointing (none of them on the device under offload); the final norm's and the embedding's
    (:data:`~lightning_cp.plan.terms.TOKEN_BYTES`); under ``bf16-mixed`` with DDP and without checkpointing, autocast's bf16 copies
    of the layers' weights, which the projections save (FSDP gathers them in bf16). The loss's own
    buffers are in :attr:`loss`."""
    selections: int
    """Sparse attention only: the int32 ``[T_local, n]`` selection of every layer with a full indexer, kept
    for the backward (with checkpointing too: the next layer's call holds it)."""
    attention: int
    """Transient of one layer's attention backward: its local gradients (``dq``, ``dout``, ``dk``, ``dv``);
    under the all-gather three sequence-sized copies of one round's K and V (``kv_heads_per_gather / Hkv``
    of the heads), and on the blocked kernel its score blocks; under Ulysses the heads' side gradients and
    the exchange's buffers.
    For a hybrid, the larger of that and a mixer layer's backward: its kernels' gradients (the size of what
    they saved) and the head-parallel exchange's buffers."""
    sparse_attention: int
    """Sparse attention only: transient of one layer's attention backward (its local gradients, and one
    round's fp32 key/value gradient buffers three times: :func:`~lightning_cp.plan.sparse.sparse_layer_bytes`)."""
    indexer: int
    """Sparse attention only: transient of one layer's selection in the forward (the gathered indexer keys,
    the int64 result, a block of scores or of the running top-k)."""
    mlp: int
    """Transient of one layer's MLP backward: the gradient of its ``[T_local, ffn]`` intermediate (two for
    a gated MLP), or one tile's forward and backward. Under QLoRA this, :attr:`attention` and
    :attr:`sparse_attention` each hold one dequantized weight besides (the largest)."""
    loss: int
    """Transient of the fused loss: two fp32 ``[chunk, vocab]`` blocks, and its preallocated gradients of
    the hidden states and of the head weight."""
    recompute: int
    """Checkpointing only: one layer's saved tensors, rebuilt in its backward, and the larger of its
    attention (beyond :attr:`mlp_side`) and MLP transients; under offload also the previous layer's input,
    prefetched from the host while this layer recomputes and back-propagates."""
    mlp_side: int
    """One layer's MLP side among its saved tensors (:func:`mlp_side_per_token`: the second norm's and the
    MLP's), which its backward frees before its attention's (or mixer's) backward begins: the peak counts
    the :attr:`attention` and :attr:`sparse_attention` transients beyond it."""
    reserve: int
    """:data:`RESERVE_BYTES` plus :data:`RESERVE_FRACTION` of the rest."""
    host: int
    """Host memory per rank (not on the device): the offloaded layer inputs (on CUDA each in 64 MiB pinned
    pages, the last rounded up to a power of two: :func:`~lightning_cp.plan.terms.pinned_bytes`), and under
    ``cpu_offload`` the rank's shards of the parameters, gradients and AdamW state (on CUDA the parameters' and
    gradients' pinned one block each, rounded up to a power of two:
    :meth:`~lightning_cp.plan.ModelShape.pinned_shard_ratio`)."""
    host_transfer: int
    """Bytes copied between host and device per step besides the batch: the offloaded layer inputs out and
    back, and under ``cpu_offload`` the parameter shards in for every unit's forward and backward gather and
    the gradient shards out."""
    communication: int
    """Bytes each rank sends per step: the gradient all-reduce (DDP) or FSDP's gathers and reduce-scatter,
    and :attr:`cp_communication`."""
    cp_communication: int
    """Of :attr:`communication`, context parallelism's: CP attention's K/V all-gathers and dK/dV
    reduce-scatters (ring volumes) or Ulysses' all-to-alls, the indexer keys, the hybrid mixers' all-to-alls."""

    @property
    def transient(self) -> int:
        """The largest of the transients as the peak counts them (they never coexist): the attention's
        beyond :attr:`mlp_side`."""
        return max(self.counted_transient(name) for name in TRANSIENTS)

    @property
    def largest_transient(self) -> str:
        """Which transient is :attr:`transient`."""
        return max(TRANSIENTS, key=self.counted_transient)

    def counted_transient(self, name: str) -> int:
        """The transient ``name`` (one of :data:`TRANSIENTS`) as the peak counts it."""
        freed = self.mlp_side if name in ("attention", "sparse_attention") else 0
        return getattr(self, name) - freed

    @property
    def peak(self) -> int:
        """Static state, saved activations, the largest transient and the reserve."""
        return self.counted + self.reserve

    @property
    def counted(self) -> int:
        """Everything but the reserve."""
        static = self.parameters + self.gradients + self.optimizer + self.fsdp_gathered
        return static + self.activations + self.selections + self.transient

    def as_dict(self) -> dict[str, int]:
        """The fields and :attr:`peak`, in bytes."""
        return {field.name: getattr(self, field.name) for field in fields(self)} | {"peak": self.peak}


TRANSIENTS = ("attention", "sparse_attention", "indexer", "mlp", "loss", "recompute")
"""The transient fields of :class:`MemoryEstimate`, of which the peak counts the largest."""


def estimate(
    shape: ModelShape,
    seq_len: int,
    layout: Layout,
    *,
    precision: Precision = "bf16-mixed",
    loss_chunk: int | None = None,
    device: str = "cuda",
    flash: bool = True,
    lora: LoRA | None = None,
) -> MemoryEstimate:
    """Per-rank bytes of one training step (forward, backward, AdamW step) of ``shape`` on ``layout``: each
    term of :class:`MemoryEstimate` from the function that counts it.

    Args:
        shape: the model.
        seq_len: tokens per sequence (one sequence per rank and micro-batch; split over ``layout.cp``).
        layout: ranks, CP size, wrapper and memory savings.
        precision: ``Trainer(precision=...)``: ``bf16-mixed`` keeps fp32 master weights, AdamW state and
            gradients and computes in bf16; ``bf16-true`` keeps everything in bf16; ``32-true`` in fp32.
        loss_chunk: tokens per chunk of the fused loss (``chunk_size``); ``None``: the automatic one.
        device: ``"cuda"`` or ``"cpu"`` (the loss's automatic chunk and the attention kernel differ).
        flash: the attention runs FlashAttention-2 (CUDA, bf16/fp16); else the blocked kernel, whose
            score blocks count.
        lora: LoRA adapters on a frozen base (:class:`~lightning_cp.plan.lora.LoRA`): the static terms count
            the base held in the compute dtype (QLoRA: its linear weights in NF4) and the adapters' master
            weights, gradients and AdamW state; the layers' transients a dequantized weight under QLoRA.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: choose one of {', '.join(PRECISIONS)}.")
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be positive.")
    step = Step(shape, layout, precision, device, flash, local_tokens(seq_len, layout.cp), lora)
    state = model_state(step)
    layer = layer_saved(step)
    saved, offloaded, moved = activations(step, layer)
    # Under QLoRA every layer's forward and backward dequantizes its weights beside its own transients.
    dequant = dequantized(step)
    dense = attention_transient(step) + dequant
    sparse = sparse_terms(step)
    if shape.sparse is not None:
        sparse = replace(sparse, backward=sparse.backward + dequant)
    mlp_side = step.tokens * (
        mlp_side_per_token(shape, tiled=layout.tiled, **step.dtypes) - frozen_norms(step)[1]
    )
    # A layer's attention backward runs after its MLP's, which has freed the layer's MLP side.
    layer_transient = max(dense, sparse.backward) - mlp_side
    attention = dense if shape.mixer is None else max(dense, mixer_transient(step) + dequant)
    mlp = mlp_transient(step) + dequant
    cp_sent = cp_communication(step, sparse.index_sent)
    unreserved = MemoryEstimate(
        parameters=state.parameters,
        gradients=state.gradients,
        optimizer=state.optimizer,
        fsdp_gathered=state.gathered,
        activations=saved + sparse.absorbed,
        selections=sparse.selections,
        attention=attention,
        sparse_attention=sparse.backward,
        indexer=sparse.indexer,
        mlp=mlp,
        loss=loss_transient(step, loss_chunk),
        recompute=recompute(step, layer, max(layer_transient, mlp, sparse.indexer), mlp),
        mlp_side=mlp_side,
        reserve=0,
        host=state.host + offloaded,
        host_transfer=state.host_transfer + moved,
        communication=wrapper_communication(step) + cp_sent,
        cp_communication=cp_sent,
    )
    return replace(unreserved, reserve=RESERVE_BYTES + int(RESERVE_FRACTION * unreserved.counted))
