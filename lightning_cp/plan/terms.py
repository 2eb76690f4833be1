"""The terms of one training step's per-rank memory, one function each, for :func:`~lightning_cp.plan.estimate`.

Each function counts what the package's code holds for one term of :class:`~lightning_cp.plan.MemoryEstimate`
(see docs/design.md, "Memory plan"), from a :class:`Step`: the model, the layout, the dtypes and this rank's
tokens. The block sizes of the kernels are read from the kernels (:func:`~lightning_cp.parallel.attention.
blocked_kernel_score_bytes`, :func:`~lightning_cp.parallel.attention_mode.gathered_bytes_per_head`), not
re-derived.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from lightning_cp.memory.offload import HOST_PAGE_BYTES
from lightning_cp.memory.tiling import auto_tile_tokens
from lightning_cp.ops._plan import chunk_budget, chunk_tokens
from lightning_cp.parallel.attention import blocked_kernel_score_bytes
from lightning_cp.parallel.attention_mode import gathered_bytes_per_head
from lightning_cp.plan.activations import (
    Precision,
    norm_bytes,
    qk_norm_bytes,
    residual_bytes,
    saved_per_token,
)
from lightning_cp.plan.layout import Layout
from lightning_cp.plan.lora import LoRA
from lightning_cp.plan.shape import ModelShape
from lightning_cp.plan.sparse import sparse_layer_bytes

TOKEN_BYTES = 8
"""Saved per token outside the layers: the embedding's int64 ids."""


def loss_chunk_tokens(shape: ModelShape, tokens: int, device: str = "cuda") -> int:
    """The fused loss's automatic chunk (tokens) for ``tokens`` local tokens: the rule of
    :func:`lightning_cp.ops._plan.auto_chunk_size` without its cap by the device's free memory, which only
    the running process knows."""
    return chunk_tokens(tokens, shape.vocab, chunk_budget(device, shape.vocab))


@dataclass(frozen=True)
class Step:
    """What every term of one step's estimate reads: the model, the layout, the dtypes, the local tokens."""

    shape: ModelShape
    layout: Layout
    precision: Precision
    device: str
    flash: bool
    tokens: int
    """This rank's tokens (the sequence padded to ``2 * cp`` chunks, over ``cp``)."""
    lora: LoRA | None = None
    """LoRA adapters on a frozen base (QLoRA: the base's linear weights in NF4); ``None``: every parameter
    trained."""

    @property
    def trained(self) -> int:
        """Parameters with a master copy, a gradient and AdamW state: all of them, or the adapters."""
        return self.shape.params if self.lora is None else self.lora.adapters(self.shape)

    @property
    def frozen(self) -> int:
        """Bytes of the frozen base (0 when every parameter is trained)."""
        return 0 if self.lora is None else self.lora.base_bytes(self.shape, self.compute)

    @property
    def unit_trained(self) -> int:
        """One decoder layer's trained parameters."""
        shape = self.shape
        return shape.layer_params if self.lora is None else self.lora.adapters(shape) // shape.layers

    @property
    def unit_frozen(self) -> int:
        """Bytes of one decoder layer's frozen base."""
        return 0 if self.lora is None else self.lora.layer_base_bytes(self.shape, self.compute)

    @property
    def padded(self) -> int:
        """The whole sequence, padded: every rank's tokens."""
        return self.tokens * self.layout.cp

    @property
    def master(self) -> int:
        """Bytes of a master weight, gradient or AdamW state element."""
        return 2 if self.precision == "bf16-true" else 4

    @property
    def compute(self) -> int:
        """Bytes of an element the forward and backward compute in."""
        return 4 if self.precision == "32-true" else 2

    @property
    def dtypes(self) -> dict[str, int]:
        """The residual stream's and the compute dtype's bytes. Under LoRA the frozen embedding is held in
        the compute dtype, so the stream is in it under either wrapper."""
        stream = self.compute if self.lora else residual_bytes(self.precision, self.layout.fsdp)
        return {"residual_bytes": stream, "compute_bytes": self.compute}

    @property
    def ulysses(self) -> bool:
        return self.layout.attention == "ulysses" and self.layout.cp > 1

    @property
    def local_grads(self) -> int:
        """An attention layer's local ``dq``, ``dout``, ``dk`` and ``dv``."""
        shape = self.shape
        return self.tokens * (shape.q_dim + shape.out_dim + shape.kv_dim + shape.v_dim) * self.compute

    @property
    def ulysses_sent(self) -> int:
        """Bytes an Ulysses layer's all-to-alls move per direction: ``q``, ``k``, ``v`` to the heads and the
        output back (the key/value heads replicated when ``Hkv < cp``)."""
        shape = self.shape
        replicated = max(shape.kv_heads, self.layout.cp) * shape.head_dim
        return self.tokens * (2 * shape.q_dim + 2 * replicated) * self.compute


@dataclass(frozen=True)
class ModelState:
    parameters: int
    gradients: int
    optimizer: int
    gathered: int
    host: int
    host_transfer: int


def model_state(step: Step) -> ModelState:
    """The trained weights, their gradients and AdamW state, and the frozen base under LoRA (sharded under
    FSDP, on the host under ``cpu_offload``), DDP's bucket copy of the gradients, and what FSDP gathers for
    the step: the root and two units in the compute dtype (the frozen base as it is held), one unit's
    gradients in the compute dtype and fp32."""
    shape, layout, compute = step.shape, step.layout, step.compute
    ranks = layout.gpus if layout.fsdp else 1
    shard = math.ceil(step.trained / ranks) * step.master
    frozen = math.ceil(step.frozen / ranks)
    buckets = step.trained * step.master if (not layout.fsdp and layout.gpus > 1) else 0
    gathered = 0
    if layout.fsdp:
        root = shape.params - shape.layers * shape.layer_params
        if not shape.tied:  # an untied token embedding is a unit of its own, gathered only to use it
            root -= shape.vocab * shape.hidden
        gathered = root * compute + 2 * step.unit_frozen + step.unit_trained * (3 * compute + 4)
    if not layout.cpu_offload:
        return ModelState(frozen + shard, shard + buckets, 2 * shard, gathered, 0, 0)
    # The state on the host; a unit's shard copied in before each gather; the shards in for the forward and
    # the backward, the gradients out.
    gathered += math.ceil(step.unit_trained / ranks) * step.master + math.ceil(step.unit_frozen / ranks)
    # The shards of the weights (the frozen base too) and of their gradients each pinned in a block of its own,
    # rounded up to a power of two on CUDA; AdamW's state in plain host memory.
    pinned = shape.pinned_shard_ratio(ranks, step.master) if step.device == "cuda" else 1.0
    host = math.ceil((frozen + 2 * shard) * pinned) + buckets + 2 * shard
    return ModelState(0, 0, 0, gathered, host, 2 * frozen + 3 * shard)


@dataclass(frozen=True)
class LayerSaved:
    attention_layer: int
    """What an attention layer saves."""
    mixer_layer: int
    """What a hybrid's mixer layer saves (0 without one)."""
    weight_copies: int
    """Autocast's bf16 copies of a layer's weights (DDP's ``bf16-mixed``), which its projections save."""
    layer_input: int
    """A layer's input: what a checkpointed layer saves."""


def layer_saved(step: Step) -> LayerSaved:
    shape, layout, tokens, compute = step.shape, step.layout, step.tokens, step.compute
    dtypes = step.dtypes
    per_token = saved_per_token(shape, cp=layout.cp, tiled=layout.tiled, ulysses=step.ulysses, **dtypes)
    if step.lora is not None:
        per_token += step.lora.saved_per_token(shape, compute) - sum(frozen_norms(step))
    attention_layer = tokens * per_token
    mixer_layer = 0
    if (
        shape.mixer is not None
    ):  # a hybrid's other layers: the attention's tensors replaced by the mixer's (fp32)
        attention_part = (shape.q_dim + shape.out_dim + shape.kv_dim + shape.v_dim + shape.heads) * compute
        attention_part += qk_norm_bytes(shape, layout.tiled, compute)
        mixer_layer = attention_layer - tokens * attention_part
        mixer_layer += math.ceil(tokens * shape.mixer.saved_per_token(step.device)) * 4
    # Autocast's copies of the trained weights (a frozen base is held in bf16 already).
    weight_copies = step.unit_trained * compute if step.precision == "bf16-mixed" and not layout.fsdp else 0
    layer_input = tokens * shape.hidden * dtypes["residual_bytes"]
    return LayerSaved(attention_layer, mixer_layer, weight_copies, layer_input)


def frozen_norms(step: Step) -> tuple[int, int]:
    """Per token, what an untiled layer's norms save only for their weights' gradients, which frozen norms
    (under LoRA) do not save: ``(attention side, MLP side)``: the first norm's normalized input (the stream's
    dtype) and the queries' and keys' norms' (the compute dtype); the second norm's. Tiled norms save only
    their inputs: nothing."""
    if step.lora is None or step.layout.tiled:
        return 0, 0
    shape, stream = step.shape, step.dtypes["residual_bytes"]
    qk = (shape.q_dim + shape.kv_dim) * step.compute if shape.qk_norm else 0
    return stream * shape.hidden + qk, stream * shape.hidden


def pinned_bytes(nbytes: int, device: str) -> int:
    """Host bytes one offloaded copy of ``nbytes`` holds. The offload keeps it in pinned pages of
    :data:`~lightning_cp.memory.offload.HOST_PAGE_BYTES` (the last one shorter), and on CUDA PyTorch's
    caching host allocator rounds every pinned block up to a power of two and keeps freed blocks for reuse
    (torch 2.13: ``CachingHostAllocatorImpl::allocate`` in ``ATen/core/CachingHostAllocator.h``): the full
    pages take their size, the last one its next power of two. On the CPU the pages are plain tensors."""
    if device != "cuda" or nbytes == 0:
        return nbytes
    full, rest = divmod(nbytes, HOST_PAGE_BYTES)
    return full * HOST_PAGE_BYTES + (1 << (rest - 1).bit_length() if rest else 0)


def activations(step: Step, layer: LayerSaved) -> tuple[int, int, int]:
    """``(on the device, on the host, copied between them)``: what the forward saves for the backward.
    Offloaded layer inputs take their pinned pages on the host (:func:`pinned_bytes`); their bytes
    cross twice."""
    shape, layout, tokens = step.shape, step.layout, step.tokens
    stream = step.dtypes["residual_bytes"]
    # The final norm's saved tensors (its output goes to the fused loss, which saves none of it).
    final_norm = stream * shape.hidden if layout.tiled else norm_bytes(shape.hidden, stream)
    if step.lora is not None and not layout.tiled:
        final_norm -= stream * shape.hidden  # its normalized input: for the frozen weight's gradient
    final = tokens * (TOKEN_BYTES + final_norm)
    if layout.offload:  # the first layers' inputs on the host, the rest's on the device
        offloaded = layout.offloaded_layers(shape.layers)
        host = offloaded * pinned_bytes(layer.layer_input, step.device)
        kept = (shape.layers - offloaded) * layer.layer_input
        return final + kept, host, 2 * offloaded * layer.layer_input
    if layout.checkpointing:
        return final + shape.layers * layer.layer_input, 0, 0
    mixer_layers = shape.mixer.layers if shape.mixer is not None else 0
    saved = final + shape.attention_layers * layer.attention_layer + mixer_layers * layer.mixer_layer
    return saved + shape.layers * layer.weight_copies, 0, 0


def attention_transient(step: Step) -> int:
    """One dense attention layer's backward: its local gradients and, under CP, a round's gathered K/V copies
    (and the blocked kernel's score blocks), or Ulysses' side gradients and buffers."""
    shape, layout, tokens, compute = step.shape, step.layout, step.tokens, step.compute
    if shape.dense_attention_layers == 0:
        return 0
    if layout.cp == 1:
        return step.local_grads  # the fused SDPA kernel: its gradients, no K/V copy
    if shape.latent_dim is not None:  # MLA: the latent gathered under either mode, expanded by rounds
        return _latent_transient(step)
    if step.ulysses:  # the heads' side gradients and the exchange's buffers (the heads' K/V among the saved)
        # (A whole sequence on one rank runs the fused SDPA kernel where FlashAttention does not: no blocks.)
        replicated = max(shape.kv_heads, layout.cp) * shape.head_dim
        return 2 * tokens * (shape.q_dim + replicated) * compute + step.ulysses_sent
    return _round_transient(step, layout.gathered_kv_heads(shape.kv_heads)) + step.local_grads


def _round_transient(step: Step, per_round: int) -> int:
    """A round of ``per_round`` key/value heads at the backward's peak: their K/V copies, as the rounds'
    budget counts them, and the blocked kernel's score blocks."""
    shape, compute = step.shape, step.compute
    attention = per_round * gathered_bytes_per_head(step.padded, shape.head_dim, shape.v_head_dim, compute)
    if not step.flash:  # a score block and its softmax gradient, for a piece of tokens / 2 queries
        heads = shape.heads * per_round // shape.kv_heads  # a round's query heads
        attention += 2 * min(blocked_kernel_score_bytes(), 4 * heads * (step.tokens // 2) * step.padded)
    return attention


def _latent_transient(step: Step) -> int:
    """An MLA layer's backward under CP (:mod:`lightning_cp.parallel.latent_attention`): its local gradients
    (the latent's in place of the keys' and values'), the gathered latent (compute dtype: the weight's gradient
    is a GEMM of it summed into fp32, no fp32 copy), its gradient at the gathered rows (fp32), and a round's
    expanded heads. Every head is one round under Ulysses, which sizes no rounds."""
    shape, layout, compute = step.shape, step.layout, step.compute
    local = step.tokens * (shape.q_dim + shape.out_dim + shape.latent_dim) * compute
    latent = step.padded * shape.latent_dim * (compute + 4)
    return local + latent + _round_transient(step, layout.gathered_kv_heads(shape.kv_heads))


@dataclass(frozen=True)
class SparseTerms:
    selections: int = 0
    backward: int = 0
    indexer: int = 0
    index_sent: int = 0
    """Bytes of every indexer layer's key all-gather, forward."""
    absorbed: int = 0
    """MLA's absorbed form: every sparse layer's latent-space queries and outputs kept for the backward (none
    under checkpointing, which recomputes them in one layer's backward)."""


def sparse_terms(step: Step) -> SparseTerms:
    """DeepSeek Sparse Attention's layers (the K/V all-gather's, not Ulysses): their kept selections, one
    layer's attention backward and selection, and the indexer keys sent.

    An MLA model's sparse layers attend in the absorbed form (:func:`lightning_cp.hf.latent.attend_selected`):
    one key of the latent's width shared by every head, its first ``kv_lora_rank`` columns the values, and each
    head's query and output in the latent's space (``[T, H, latent_dim]`` and ``[T, H, kv_lora_rank]``, kept
    for the backward beside the layer's own: with every sparse layer's activations, or in the one layer a
    checkpointed backward recomputes)."""
    shape, layout = step.shape, step.layout
    if shape.sparse is None:
        return SparseTerms()
    attended, per_round, absorbed = shape, layout.gathered_kv_heads(shape.kv_heads), 0
    latent = shape.latent_dim is not None and shape.kv_lora_rank is not None
    if latent:
        attended = replace(shape, kv_heads=1, head_dim=shape.latent_dim, value_head_dim=shape.kv_lora_rank)
        per_round = 1
        absorbed = step.tokens * shape.heads * (shape.latent_dim + shape.kv_lora_rank) * step.compute
    sparse = sparse_layer_bytes(attended, step.tokens, layout.cp, per_round, step.compute, latent=latent)
    index_sent = ring(layout.cp, step.padded * shape.sparse.head_dim * step.compute)
    return SparseTerms(
        selections=shape.sparse.indexer_layers * sparse.selection,
        backward=sparse.backward + absorbed,
        indexer=sparse.indexer,
        index_sent=shape.sparse.indexer_layers * index_sent,
        absorbed=0 if layout.checkpointing else shape.sparse.layers * absorbed,
    )


def mixer_transient(step: Step) -> int:
    """A hybrid mixer layer's backward: its kernels' gradients (as large as what they saved) beside the
    exchange's buffers (what is sent, received and put in sequence order). (On the CPU, the torch kernels'
    backward peaks at about a third of what they saved, measured.)"""
    mixer, tokens = step.shape.mixer, step.tokens
    assert mixer is not None
    exchanged = tokens * mixer.exchanged_per_token(step.layout.cp) * step.compute
    saved = tokens * mixer.saved_per_token(step.device) * (1 / 3 if step.device == "cpu" else 1)
    return math.ceil(saved) * 4 + 3 * exchanged


def mlp_transient(step: Step) -> int:
    """One layer's MLP backward: its intermediates' gradients, or one tile's forward and backward."""
    shape, tokens, compute = step.shape, step.tokens, step.compute
    if not step.layout.tiled:
        return (2 if shape.architecture == "hf" else 1) * tokens * shape.mlp_width * compute
    tile = auto_tile_tokens(tokens, shape.hidden)
    mlp = (7 if shape.architecture == "hf" else 4) * tile * shape.mlp_width * compute
    mlp += 2 * tokens * shape.hidden * compute  # the incoming gradient and the tiles' input gradient
    if shape.experts:  # the router's input gradient, and its sum with the experts' (measured on the CPU)
        mlp += 2 * tokens * shape.hidden * compute
    return mlp


def loss_transient(step: Step, loss_chunk: int | None) -> int:
    """The fused loss: its input (the final norm's output), its preallocated input and head-weight gradients
    (none of the head's under LoRA: it is frozen), and two fp32 ``[chunk, vocab]`` blocks."""
    shape, tokens = step.shape, step.tokens
    chunk = loss_chunk or loss_chunk_tokens(shape, tokens, step.device)
    head = shape.vocab * shape.hidden
    return (
        2 * min(chunk, tokens) * shape.vocab * 4
        + 2 * tokens * shape.hidden * step.compute
        + (head * step.master if step.lora is None else 0)
    )


def dequantized(step: Step) -> int:
    """QLoRA's dequantization inside a layer's forward or backward (0 without QLoRA): the largest quantized
    matrix made bf16, beside whatever that layer's step holds (:meth:`~lightning_cp.plan.lora.LoRA.
    dequantized_bytes`)."""
    return 0 if step.lora is None else step.lora.dequantized_bytes(step.shape)


def recompute(step: Step, layer: LayerSaved, attention_layer_transient: int, mlp: int) -> int:
    """A checkpointed layer's backward: its recomputed tensors besides its largest own transient (an attention
    layer's ``attention_layer_transient``; a mixer layer's MLP, since its kernels free what they saved as
    their backward runs, measured). The first norm saves the layer's input itself when tiled or in an fp32
    stream (already saved; under offload the copy brought back), else an fp32 copy of it (the bf16 input, or
    its copy brought back, is then dropped after the recomputed forward). Under offload the previous layer's
    input is prefetched when this layer's recomputation starts and held through its backward
    (:mod:`lightning_cp.memory.offload`): one layer input more (none in a model of one layer)."""
    layout, shape = step.layout, step.shape
    if not layout.checkpointing:
        return 0
    shared = (layout.tiled or step.dtypes["residual_bytes"] == 4) and not layout.offload
    prefetched = layer.layer_input if layout.offload and layout.offloaded_layers(shape.layers) > 1 else 0
    rebuilt = layer.weight_copies + prefetched - (layer.layer_input if shared else 0)
    return rebuilt + max(
        layer.attention_layer + attention_layer_transient if shape.attention_layers else 0,
        layer.mixer_layer + mlp if shape.mixer is not None else 0,
    )


def wrapper_communication(step: Step) -> int:
    """Bytes this rank sends for the wrapper per step: DDP's all-reduce of the trained parameters' gradients
    (two ring passes), or FSDP's gathers for the forward and the backward (the frozen base too) and its fp32
    reduce-scatter of the gradients."""
    layout, compute = step.layout, step.compute
    trained = step.trained  # under LoRA the adapters: only they have gradients to reduce
    if layout.fsdp:
        gathered = trained * compute + step.frozen
        return 2 * ring(layout.gpus, gathered) + ring(layout.gpus, trained * 4)
    return 2 * ring(layout.gpus, trained * step.master)


def cp_communication(step: Step, index_sent: int) -> int:
    """Bytes this rank sends for context parallelism per step: the K/V all-gathers (MLA's: the latent's) and
    their gradients' reduce-scatters (ring volumes) or Ulysses' all-to-alls, the indexer keys (``index_sent``,
    forward), the hybrid mixers' all-to-alls; recomputation repeats the forward's."""
    shape, layout, compute = step.shape, step.layout, step.compute
    recomputed = 1 if layout.checkpointing else 0
    communication = 0
    gathering = shape.attention_layers  # the layers whose K/V are all-gathered (sparse ones always)
    if step.ulysses and shape.latent_dim is None:  # two all-to-alls forward, two backward, two to recompute
        sent = step.ulysses_sent * (layout.cp - 1) // layout.cp
        gathering -= shape.dense_attention_layers
        communication += (2 + recomputed) * shape.dense_attention_layers * sent
    # MLA gathers its latent (latent_dim per token) under either mode, in dense and sparse layers alike.
    kv = step.padded * (shape.latent_dim or shape.kv_dim + shape.v_dim)
    # Gathered in the compute dtype (forward, backward, recomputation); the gradients reduced in fp32.
    gathered = (2 + recomputed) * ring(layout.cp, kv * compute) + ring(layout.cp, kv * max(compute, 4))
    communication += gathering * gathered
    communication += (1 + recomputed) * index_sent  # the indexer keys, forward (recomputed)
    if shape.mixer is not None:  # two all-to-alls forward, two backward, two more to recompute
        exchanged = step.tokens * shape.mixer.exchanged_per_token(layout.cp) * compute
        communication += (2 + recomputed) * shape.mixer.layers * (exchanged * (layout.cp - 1) // layout.cp)
    return communication


def ring(group: int, nbytes: int) -> int:
    """Bytes one rank sends in a ring all-gather or reduce-scatter of ``nbytes`` over ``group`` ranks
    (an all-reduce is two of them)."""
    return (group - 1) * nbytes // group
