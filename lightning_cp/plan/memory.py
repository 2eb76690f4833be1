"""Per-rank memory of one training step of a decoder under a layout: pure arithmetic over a ModelShape.

Every term counts the tensors the package's code holds (see docs/design.md, "Memory plan"); the saved
activations are the tensors autograd keeps per token and layer in the package GPT and in a
``transformers`` Llama-style layer, as ``tests/plan/test_measured.py`` measures them. One sequence of
``seq_len`` tokens per rank and micro-batch (packed documents count the same), ``tp = 1``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Literal

from lightning_cp.memory.tiling import auto_tile_tokens
from lightning_cp.ops._plan import chunk_budget, chunk_tokens
from lightning_cp.parallel.attention_mode import AttentionMode, gathered_bytes_per_head
from lightning_cp.plan.shape import ModelShape
from lightning_cp.plan.sparse import sparse_layer_bytes

Precision = Literal["bf16-mixed", "bf16-true", "32-true"]
PRECISIONS: tuple[Precision, ...] = ("bf16-mixed", "bf16-true", "32-true")

GiB = 2**30
RESERVE_BYTES = 2 * GiB
"""Reserve for what the allocator's count misses: the CUDA context, NCCL's buffers, the caching allocator's
own fragmentation floor."""
RESERVE_FRACTION = 0.05
"""... plus this fraction of everything counted (fragmentation grows with the allocations)."""
CPU_SCORE_BLOCK_BYTES = 64 * 2**20
"""The blocked attention kernel's ``[heads, block, keys]`` fp32 score block (CPU, and CUDA without flash);
its backward holds two at a time."""
TOKEN_BYTES = 8
"""Saved per token outside the layers: the embedding's int64 ids."""


@dataclass(frozen=True)
class Layout:
    """One way to train on ``gpus`` ranks: the CP size (``dp = gpus // cp``), the wrapper, and the
    activation-memory savings."""

    gpus: int
    """Ranks in all (``dp * cp``)."""
    cp: int
    """Context-parallel size; every sequence is split over ``cp`` ranks."""
    fsdp: bool = False
    """FSDP2 over the ``dp * cp`` ranks (``MegatronCPFSDPStrategy``) instead of DDP."""
    checkpointing: bool = False
    """Activation checkpointing of every decoder layer (``activation_checkpointing=[<layer class>]``)."""
    offload: bool = False
    """The checkpointed layers' inputs moved to host memory (needs ``checkpointing``)."""
    tiled: bool = False
    """``HFCausalLM(tiled=True)``: ``lightning_cp.memory.tile_mlps``, ``tile_norms`` and ``tile_experts``: the
    MLP's ``[tokens, ffn]`` intermediates, a mixture of experts' expert activations and the norms' fp32 copies
    recomputed per tile, only their inputs saved."""
    attention: Literal["allgather", "ulysses"] = "allgather"
    """The strategies' ``cp_attention``: the key/value heads all-gathered, or Ulysses' all-to-all."""
    kv_heads_per_gather: int | None = None
    """The strategies' ``kv_heads_per_gather``: with the all-gather, the key/value heads gathered per round
    (rounded down to a divisor of the model's ``Hkv``, as at run time); ``None``: every head at once."""
    cpu_offload: bool = False
    """FSDP only (``MegatronCPFSDPStrategy(cpu_offload=True)``): the parameters, gradients and AdamW state
    sharded in host memory, each unit gathered to the GPU for its forward and backward, the optimizer step
    on the host."""

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.cp < 1 or self.gpus % self.cp:
            raise ValueError(f"Layout: gpus={self.gpus} must be a positive multiple of cp={self.cp}.")
        if self.offload and not self.checkpointing:
            raise ValueError("Layout: offload moves the checkpointed layers' inputs; set checkpointing=True.")
        if self.cpu_offload and not self.fsdp:
            raise ValueError("Layout: cpu_offload keeps FSDP's shards on the host; set fsdp=True.")
        try:
            self.mode()
        except ValueError as error:
            raise ValueError(f"Layout: {error}") from None

    def mode(self) -> AttentionMode:
        """The run-time attention mode of this layout's strategy arguments."""
        return AttentionMode(self.attention, self.kv_heads_per_gather)

    def gathered_kv_heads(self, kv_heads: int) -> int:
        """The key/value heads of one all-gather round for a model of ``kv_heads`` (all of them with every
        head at once), rounded as the run time rounds :attr:`kv_heads_per_gather`."""
        return self.mode().heads_per_gather(kv_heads, 0, None)

    @property
    def dp(self) -> int:
        return self.gpus // self.cp

    def name(self) -> str:
        """e.g. ``dp2 x cp4 FSDP +ckpt +offload +tiled``."""
        extras = [
            flag
            for flag, on in (
                ("+ckpt", self.checkpointing),
                ("+offload", self.offload),
                ("+tiled", self.tiled),
                ("+cpu_offload", self.cpu_offload),
            )
            if on
        ]
        attention = []
        if self.attention == "ulysses":
            attention = ["ulysses"]
        elif self.kv_heads_per_gather is not None:
            attention = [f"kv{self.kv_heads_per_gather}/gather"]
        return " ".join([f"dp{self.dp} x cp{self.cp}", "FSDP" if self.fsdp else "DDP", *attention, *extras])


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank, by what holds them; :attr:`peak` is what the device must hold."""

    parameters: int
    """Master weights (sharded over ``dp * cp`` under FSDP)."""
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
    (:data:`TOKEN_BYTES`); under ``bf16-mixed`` with DDP and without checkpointing, autocast's bf16 copies
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
    a gated MLP), or one tile's forward and backward."""
    loss: int
    """Transient of the fused loss: two fp32 ``[chunk, vocab]`` blocks, and its preallocated gradients of
    the hidden states and of the head weight."""
    recompute: int
    """Checkpointing only: one layer's saved tensors, rebuilt in its backward, and the larger of its
    attention (beyond :attr:`mlp_side`) and MLP transients."""
    mlp_side: int
    """One layer's MLP side among its saved tensors (:func:`mlp_side_per_token`: the second norm's and the
    MLP's), which its backward frees before its attention's (or mixer's) backward begins: the peak counts
    the :attr:`attention` and :attr:`sparse_attention` transients beyond it."""
    reserve: int
    """:data:`RESERVE_BYTES` plus :data:`RESERVE_FRACTION` of the rest."""
    host: int
    """Host memory per rank (not on the device): the offloaded layer inputs, and under ``cpu_offload`` the
    rank's shards of the parameters, gradients and AdamW state."""
    host_transfer: int
    """Bytes copied between host and device per step besides the batch: the offloaded layer inputs out and
    back, and under ``cpu_offload`` the parameter shards in for every unit's forward and backward gather and
    the gradient shards out."""
    communication: int
    """Bytes each rank sends per step: the gradient all-reduce (DDP) or FSDP's gathers and reduce-scatter,
    and CP attention's K/V all-gathers and dK/dV reduce-scatters (ring volumes)."""

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


def local_tokens(seq_len: int, cp: int) -> int:
    """Tokens on one CP rank: the sequence padded to a multiple of ``2 * cp``, over ``cp``."""
    return math.ceil(seq_len / (2 * cp)) * 2


def saved_per_token(
    shape: ModelShape,
    *,
    cp: int = 1,
    tiled: bool = False,
    ulysses: bool = False,
    residual_bytes: int = 4,
    compute_bytes: int = 4,
) -> int:
    """Bytes one decoder layer saves for backward per local token: its :func:`attention_side_per_token` and
    its :func:`mlp_side_per_token`.

    ``residual_bytes``: the residual stream's dtype (fp32 under DDP's ``bf16-mixed``, where the embedding
    is fp32; bf16 under FSDP's, whose gathered bf16 weights make every hidden state bf16; see
    :func:`residual_bytes`); ``compute_bytes``: the projections' inputs and the attention's and the MLP's
    tensors. Per layer, ``d`` the hidden size:

    - two norms: each keeps an fp32 copy of its input (the input itself when the stream is fp32), the
      reciprocal RMS and the normalized input in the stream's dtype (:func:`norm_bytes`), and its output,
      which the next projections read, in the compute dtype; tiled (``tiled``:
      :func:`~lightning_cp.memory.tile_model`), only its input, and neither output: the projections and the
      tiled MLP that read them recompute them, but a mixture of experts' router keeps the second's;
    - attention of a ``transformers`` layer: the rotated ``q`` and ``k`` (token-major copies under CP),
      ``v`` (the projection's output), the attention output (which the output projection reads in place)
      and the log-sum-exp per head;
    - attention of the package GPT: the same, but ``v`` is a view of the fused QKV output, which it keeps
      whole; at ``cp = 1`` (the fused SDPA kernel) also the output's ``[S, heads * D]`` copy for the
      output projection;
    - Ulysses' attention (``ulysses``): the same tensors on the heads' side (every token of ``Hq / cp`` query
      heads and the key/value heads they read, replicated when ``Hkv < cp``: ``max(Hkv, cp)`` heads' worth per
      local token), and the output brought back, which the output projection reads (``q_dim`` more);
    - the queries' and keys' norms (:attr:`~lightning_cp.plan.ModelShape.qk_norm`): like the layer's norms,
      an fp32 copy of their input (the projections' output), the normalized input in the compute dtype and
      the reciprocal RMS per head; tiled, only their input;
    - MLP: GELU's input and output (``2 ffn``), or a gated MLP's gate, up, activation and product
      (``4 ffn``), and a mixture of experts' routed experts (:func:`routed_per_token`); none tiled
      (:func:`~lightning_cp.memory.tile_mlps`), and of a tiled mixture of experts
      (:func:`~lightning_cp.memory.tile_experts`) only the router's own tensors (:func:`router_bytes`).
    """
    dtypes = {"residual_bytes": residual_bytes, "compute_bytes": compute_bytes}
    attention = attention_side_per_token(shape, cp=cp, tiled=tiled, ulysses=ulysses, **dtypes)
    return attention + mlp_side_per_token(shape, tiled=tiled, **dtypes)


def attention_side_per_token(
    shape: ModelShape,
    *,
    cp: int = 1,
    tiled: bool = False,
    ulysses: bool = False,
    residual_bytes: int = 4,
    compute_bytes: int = 4,
) -> int:
    """What :func:`saved_per_token` counts up to the attention's output: the first norm's, the queries' and
    keys' norms' and the attention's tensors."""
    d = shape.hidden
    norm = residual_bytes * d if tiled else norm_bytes(d, residual_bytes) + compute_bytes * d
    attention = shape.q_dim + shape.out_dim + shape.kv_dim + shape.v_dim + shape.heads
    if ulysses:
        attention += shape.q_dim + 2 * (max(shape.kv_heads, cp) - shape.kv_heads) * shape.head_dim
    if shape.architecture == "gpt":
        attention += shape.q_dim + shape.kv_dim + (shape.q_dim if cp == 1 else 0)
    return norm + qk_norm_bytes(shape, tiled, compute_bytes) + attention * compute_bytes


def mlp_side_per_token(
    shape: ModelShape,
    *,
    tiled: bool = False,
    residual_bytes: int = 4,
    compute_bytes: int = 4,
) -> int:
    """What :func:`saved_per_token` counts from the second norm on: the second norm's and the MLP's (or the
    mixture of experts') tensors. A layer's backward frees them before its attention's backward begins."""
    d = shape.hidden
    if tiled:
        router = compute_bytes * d + router_bytes(shape, compute_bytes) if shape.experts else 0
        return residual_bytes * d + router
    mlp = (2 if shape.architecture == "gpt" else 4) * shape.ffn + routed_per_token(shape)
    return norm_bytes(d, residual_bytes) + (d + mlp) * compute_bytes


def qk_norm_bytes(shape: ModelShape, tiled: bool, compute_bytes: int) -> int:
    """Bytes the queries' and keys' norms of one attention layer save per token (0 without them): the input
    (the projections' output) when tiled; else, as the layer's norms, an fp32 copy of it, the normalized
    input in the compute dtype and the fp32 reciprocal RMS of every head."""
    if not shape.qk_norm:
        return 0
    normalized = shape.q_dim + shape.kv_dim
    if tiled:
        return normalized * compute_bytes
    return normalized * (4 + compute_bytes) + 4 * (shape.heads + shape.kv_heads)


def norm_bytes(hidden: int, residual_bytes: int) -> int:
    """Bytes an untiled RMSNorm saves per token besides its output: an fp32 copy of its input (the input
    itself in an fp32 stream), the fp32 reciprocal RMS, the normalized input in the stream's dtype."""
    return 4 * hidden + 4 + residual_bytes * hidden


def residual_bytes(precision: Precision, fsdp: bool) -> int:
    """Bytes of one element of the residual stream: the master weights' dtype, but the compute dtype under
    FSDP, which gathers the weights in it (``MixedPrecisionPolicy(param_dtype=bf16)``), so the embedding and
    everything after it are bf16 under ``bf16-mixed``; DDP's autocast leaves the embedding fp32."""
    if precision == "32-true":
        return 4
    return 2 if fsdp or precision == "bf16-true" else 4


def routed_per_token(shape: ModelShape) -> int:
    """Elements a mixture of experts' routed experts save per token (0 for a dense MLP): each of the
    ``top_k`` experts' gated MLP (``4 * expert_ffn``) and the token's copy in and out (``2 * hidden``), the
    router's probabilities, and the routing's own buffers (about ``9 top_k``: index and permutation
    tensors), as ``transformers``' grouped experts save them, measured on the CPU."""
    if not shape.experts:
        return 0
    k = shape.top_k
    return k * (4 * shape.expert_ffn + 2 * shape.hidden + 9) + shape.experts


def router_bytes(shape: ModelShape, compute_bytes: int) -> int:
    """Bytes a tiled mixture of experts saves per token besides the layer's input (0 for a dense MLP): the
    router's fp32 probabilities, its top-k indices (int64) and routing weights (the compute dtype), which the
    tiled experts take as inputs (:func:`~lightning_cp.memory.tile_experts`)."""
    if not shape.experts:
        return 0
    return 4 * shape.experts + (8 + compute_bytes) * shape.top_k


def loss_chunk_tokens(shape: ModelShape, tokens: int, device: str = "cuda") -> int:
    """The fused loss's automatic chunk (tokens) for ``tokens`` local tokens: the rule of
    :func:`lightning_cp.ops._plan.auto_chunk_size` without its cap by the device's free memory, which only
    the running process knows."""
    return chunk_tokens(tokens, shape.vocab, chunk_budget(device, shape.vocab))


def estimate(
    shape: ModelShape,
    seq_len: int,
    layout: Layout,
    *,
    precision: Precision = "bf16-mixed",
    loss_chunk: int | None = None,
    device: str = "cuda",
    flash: bool = True,
) -> MemoryEstimate:
    """Per-rank bytes of one training step (forward, backward, AdamW step) of ``shape`` on ``layout``.

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
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: choose one of {', '.join(PRECISIONS)}.")
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be positive.")
    master = 2 if precision == "bf16-true" else 4
    compute = 4 if precision == "32-true" else 2
    shards = layout.gpus if layout.fsdp else 1
    params = shape.params
    tokens = local_tokens(seq_len, layout.cp)
    padded = tokens * layout.cp

    shard = math.ceil(params / shards) * master
    buckets = params * master if (not layout.fsdp and layout.gpus > 1) else 0
    parameters, gradients, optimizer = shard, shard + buckets, 2 * shard
    gathered = 0
    if layout.fsdp:
        root = params - shape.layers * shape.layer_params
        if not shape.tied:  # an untied token embedding is a unit of its own, gathered only to use it
            root -= shape.vocab * shape.hidden
        gathered = root * compute + shape.layer_params * (3 * compute + 4)
    host = host_transfer = 0
    if layout.cpu_offload:  # the state on the host; a unit's shard copied in before each gather
        host, parameters, gradients, optimizer = parameters + gradients + optimizer, 0, 0, 0
        gathered += math.ceil(shape.layer_params / shards) * master
        host_transfer = 3 * shard  # the shards in for the forward and the backward, the gradients out

    ulysses = layout.attention == "ulysses" and layout.cp > 1
    stream = residual_bytes(precision, layout.fsdp)
    dtypes = {"residual_bytes": stream, "compute_bytes": compute}
    per_token = saved_per_token(shape, cp=layout.cp, tiled=layout.tiled, ulysses=ulysses, **dtypes)
    attention_layer = tokens * per_token
    mixer = shape.mixer
    mixer_layer = 0
    if mixer is not None:  # a hybrid's other layers: the attention's tensors replaced by the mixer's (fp32)
        attention_part = (shape.q_dim + shape.out_dim + shape.kv_dim + shape.v_dim + shape.heads) * compute
        attention_part += qk_norm_bytes(shape, layout.tiled, compute)
        mixer_layer = attention_layer - tokens * attention_part
        mixer_layer += math.ceil(tokens * mixer.saved_per_token(device)) * 4
    weight_copies = shape.layer_params * compute if precision == "bf16-mixed" and not layout.fsdp else 0
    # The final norm's saved tensors (its output goes to the fused loss, which saves none of it).
    final_norm = stream * shape.hidden if layout.tiled else norm_bytes(shape.hidden, stream)
    final = tokens * (TOKEN_BYTES + final_norm)
    layer_input = tokens * shape.hidden * stream
    mixer_layers = mixer.layers if mixer is not None else 0
    if layout.offload:
        saved = final
        host += shape.layers * layer_input
        host_transfer += 2 * shape.layers * layer_input
    elif layout.checkpointing:
        saved = final + shape.layers * layer_input
    else:
        saved = final + shape.attention_layers * attention_layer + mixer_layers * mixer_layer
        saved += shape.layers * weight_copies

    kv = padded * (shape.kv_dim + shape.v_dim) * compute
    local_grads = tokens * (shape.q_dim + shape.out_dim + shape.kv_dim + shape.v_dim) * compute
    replicated = max(shape.kv_heads, layout.cp) * shape.head_dim  # Ulysses' key/value heads per local token
    ulysses_sent = tokens * (2 * shape.q_dim + 2 * replicated) * compute  # to the heads (q, k, v) and back
    if shape.dense_attention_layers == 0:
        attention = 0
    elif layout.cp == 1:
        attention = local_grads  # the fused SDPA kernel: its gradients, no K/V copy
    elif ulysses:  # the heads' side gradients and the exchange's buffers (the heads' K/V among the saved)
        # (A whole sequence on one rank runs the fused SDPA kernel where FlashAttention does not: no blocks.)
        attention = 2 * tokens * (shape.q_dim + replicated) * compute + ulysses_sent
    else:
        # A round's K/V copies at the backward's peak, as the rounds' budget counts them.
        per_round = layout.gathered_kv_heads(shape.kv_heads)
        per_head = gathered_bytes_per_head(padded, shape.head_dim, shape.v_head_dim, compute)
        attention = per_round * per_head + local_grads
        if not flash:  # a score block and its softmax gradient, for a piece of tokens / 2 queries
            heads = shape.heads * per_round // shape.kv_heads  # a round's query heads
            attention += 2 * min(CPU_SCORE_BLOCK_BYTES, 4 * heads * (tokens // 2) * padded)
    selections = sparse_attention = indexer = index_sent = 0
    if shape.sparse is not None:  # DeepSeek Sparse Attention's layers: the K/V all-gather's, not Ulysses
        sparse = sparse_layer_bytes(
            shape, tokens, layout.cp, layout.gathered_kv_heads(shape.kv_heads), compute
        )
        selections = shape.sparse.indexer_layers * sparse.selection
        sparse_attention, indexer = sparse.backward, sparse.indexer
        index_sent = shape.sparse.indexer_layers * _ring(layout.cp, padded * shape.sparse.head_dim * compute)
    # A layer's attention (or mixer) backward runs after its MLP's, which has freed the layer's MLP side.
    mlp_side = tokens * mlp_side_per_token(shape, tiled=layout.tiled, **dtypes)
    layer_transient = max(attention, sparse_attention) - mlp_side  # an attention layer's, beyond it
    if mixer is not None:
        # The mixer's backward: its kernels' gradients (as large as what they saved) beside the exchange's
        # buffers (what is sent, received and put in sequence order).
        # (On the CPU, the torch kernels' backward peaks at about a third of what they saved, measured.)
        exchanged = tokens * mixer.exchanged_per_token(layout.cp) * compute
        kernels = math.ceil(tokens * mixer.saved_per_token(device) * (1 / 3 if device == "cpu" else 1)) * 4
        attention = max(attention, kernels + 3 * exchanged)
    if layout.tiled:
        tile = auto_tile_tokens(tokens, shape.hidden)
        mlp = (7 if shape.architecture == "hf" else 4) * tile * shape.mlp_width * compute
        mlp += 2 * tokens * shape.hidden * compute  # the incoming gradient and the tiles' input gradient
        if shape.experts:  # the router's input gradient, and its sum with the experts' (measured on the CPU)
            mlp += 2 * tokens * shape.hidden * compute
    else:
        mlp = (2 if shape.architecture == "hf" else 1) * tokens * shape.mlp_width * compute
    chunk = loss_chunk or loss_chunk_tokens(shape, tokens, device)
    head = shape.vocab * shape.hidden
    # Its input (the final norm's output), its preallocated input and head-weight gradients, two blocks.
    loss = 2 * min(chunk, tokens) * shape.vocab * 4 + 2 * tokens * shape.hidden * compute + head * master
    # A checkpointed layer's backward holds its recomputed tensors besides the attention's or the MLP's own
    # transient; the first norm saves the layer's input itself (already saved, or back from the host) when
    # tiled or in an fp32 stream, else an fp32 copy of it.
    recompute = 0
    if layout.checkpointing:  # (a mixer's kernels free what they saved as their backward runs, measured)
        shared = (layout.tiled or stream == 4) and not layout.offload
        rebuilt = weight_copies - (layer_input if shared else 0)
        recompute = rebuilt + max(
            attention_layer + max(layer_transient, mlp, indexer) if shape.attention_layers else 0,
            mixer_layer + mlp if mixer is not None else 0,
        )

    if layout.fsdp:
        wrapper = 2 * _ring(layout.gpus, params * compute) + _ring(layout.gpus, params * 4)
    else:
        wrapper = 2 * _ring(layout.gpus, params * master)
    kv_exchanges = 4 if layout.checkpointing else 3  # gathered forward, backward (recomputed), reduced
    gathering = shape.attention_layers  # the layers whose K/V are all-gathered (sparse ones always)
    if ulysses:  # two all-to-alls forward, two backward, two more to recompute
        sent = ulysses_sent * (layout.cp - 1) // layout.cp
        gathering -= shape.dense_attention_layers
        communication = wrapper + (3 if layout.checkpointing else 2) * shape.dense_attention_layers * sent
    else:
        communication = wrapper
    communication += kv_exchanges * gathering * _ring(layout.cp, kv)
    communication += (2 if layout.checkpointing else 1) * index_sent  # the indexer keys, forward (recomputed)
    if mixer is not None:  # two all-to-alls forward, two backward, two more to recompute
        sent = tokens * mixer.exchanged_per_token(layout.cp) * compute * (layout.cp - 1) // layout.cp
        communication += (3 if layout.checkpointing else 2) * mixer.layers * sent

    unreserved = MemoryEstimate(
        parameters=parameters,
        gradients=gradients,
        optimizer=optimizer,
        fsdp_gathered=gathered,
        activations=saved,
        selections=selections,
        attention=attention,
        sparse_attention=sparse_attention,
        indexer=indexer,
        mlp=mlp,
        loss=loss,
        recompute=recompute,
        mlp_side=mlp_side,
        reserve=0,
        host=host,
        host_transfer=host_transfer,
        communication=communication,
    )
    return replace(unreserved, reserve=RESERVE_BYTES + int(RESERVE_FRACTION * unreserved.counted))


def _ring(group: int, nbytes: int) -> int:
    """Bytes one rank sends in a ring all-gather or reduce-scatter of ``nbytes`` over ``group`` ranks
    (an all-reduce is two of them)."""
    return (group - 1) * nbytes // group
