"""How the engine walks the logits: backend, tokens per chunk, logits transform, vocabulary sharding.

:meth:`Plan.build` validates the options of one call of the public functions and resolves the
automatic ones (``impl="auto"``, ``chunk_size=None``).
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_cp.ops._torch_kernels import TorchChunk

_IMPLS = ("auto", "torch", "triton")

# Bytes of one fp32 [chunk, V_local] logits block under the automatic chunk size. On CPU the chunk is
# most of the extra peak, and 256 MiB chunks already keep the matmuls as fast as unchunked ones.
_CPU_CHUNK_BYTES = 256 * 2**20
# Other devices, and the least a CUDA device gets: the grad_hidden matmul [chunk, V] @ [V, H] needs enough
# rows to fill every multiprocessor.
_ACCELERATOR_CHUNK_BYTES = 512 * 2**20
# On CUDA the chunk grows towards _CUDA_CHUNK_TOKENS while the block stays within a share of the free
# memory and a ceiling. An H100 ran the loss at 32K x 152K x 4K in 193 ms with 8192-token chunks and in
# 289 ms with the 512 MiB ones (883 tokens); larger chunks only cost memory.
_CUDA_CHUNK_TOKENS = 8192
_CUDA_FREE_SHARE = 8
"""The block takes at most 1 / this of the memory free on the device (for this process)."""
_CUDA_MAX_CHUNK_BYTES = 4 * 2**30
# Fewer tokens per chunk would starve the matmuls for very large vocabularies.
_MIN_CHUNK = 128


def auto_chunk_size(
    n_tokens: int, local_vocab: int, device: torch.device | str = "cpu", *, sharded: bool = False
) -> int:
    """Tokens per chunk of the loss when the caller gives none, within ``[128, n_tokens]``.

    The chunk is sized by the bytes of one fp32 ``[chunk, local_vocab]`` block (:func:`chunk_budget`):

    - CPU: 256 MiB;
    - CUDA: enough for 8192 tokens, but at most 1/8 of the memory free for this process (the device's
      free memory from ``torch.cuda.mem_get_info`` plus what torch's caching allocator holds unused) and
      4 GiB, and at least 512 MiB. Larger vocabularies get fewer tokens, and a device that is short of
      memory smaller chunks. The chunk therefore varies with the free memory: pass ``chunk_size`` for
      bitwise-reproducible runs;
    - other devices, and CUDA with ``sharded``: 512 MiB. A vocabulary sharded over tensor-parallel ranks
      exchanges statistics per chunk, so its ranks must agree on the chunk: it depends on the shapes only.
    """
    device = torch.device(device)
    available = _cuda_available_bytes(device) if device.type == "cuda" and not sharded else None
    budget = chunk_budget(device.type, local_vocab, sharded=sharded, available=available)
    return chunk_tokens(n_tokens, local_vocab, budget)


def chunk_budget(
    device_type: str, local_vocab: int, *, sharded: bool = False, available: int | None = None
) -> int:
    """Bytes of the fp32 ``[chunk, local_vocab]`` block of :func:`auto_chunk_size` on a ``device_type``
    device; ``available``: the bytes free for this process on a CUDA device, ``None`` for no such cap (a
    plan made away from the device)."""
    if device_type == "cpu":
        return _CPU_CHUNK_BYTES
    if device_type != "cuda" or sharded:
        return _ACCELERATOR_CHUNK_BYTES
    wanted = min(_CUDA_CHUNK_TOKENS * 4 * local_vocab, _CUDA_MAX_CHUNK_BYTES)
    if available is not None:
        wanted = min(wanted, available // _CUDA_FREE_SHARE)
    return max(_ACCELERATOR_CHUNK_BYTES, wanted)


def chunk_tokens(n_tokens: int, local_vocab: int, budget: int) -> int:
    """Tokens per chunk whose fp32 ``[chunk, local_vocab]`` block fits ``budget`` bytes, within
    ``[128, n_tokens]`` (at least 1)."""
    return max(1, min(n_tokens, max(_MIN_CHUNK, budget // (4 * local_vocab))))


def _cuda_available_bytes(device: torch.device) -> int:
    """The memory free for this process on ``device``: the device's free memory and what torch's caching
    allocator holds unused."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


@dataclass(frozen=True)
class Plan:
    """How to walk the logits: backend, chunking, logits transform and vocabulary sharding."""

    impl: str
    """``"torch"`` or ``"triton"``."""
    chunk_size: int
    """Tokens per chunk."""
    logit_scale: float
    """``z`` is multiplied by this before the cap (Cohere's ``logit_scale``, ``1 / logits_scaling`` in Granite)."""
    softcap: float | None
    """``s = softcap * tanh(logit_scale * z / softcap)`` before the softmax, or no cap."""
    inv_temp: float
    """``s`` is multiplied by this (``1 / temperature``) after the cap."""
    group: dist.ProcessGroup | None
    """Tensor-parallel group over which the vocabulary is sharded, ``None`` when not sharded."""
    local_vocab: int
    """Vocabulary entries on this rank."""
    vocab: int
    """Global vocabulary size."""
    matmul_dtype: torch.dtype | None = None
    """The dtype the head's matmuls run in where it is narrower than the inputs': autocast's when the call was
    made under autocast (``bf16-mixed`` under DDP: fp32 hidden states and weight, bf16 matmuls, as autocast runs
    ``F.linear``), kept for the backward, which runs outside autocast; ``None``: the inputs' own dtype."""

    @classmethod
    def build(
        cls,
        *,
        n_tokens: int,
        local_vocab: int,
        device: torch.device,
        impl: str,
        chunk_size: int | None,
        logit_scale: float,
        softcap: float | None,
        tp_group: dist.ProcessGroup | None,
        temperature: float = 1.0,
        input_dtype: torch.dtype | None = None,
    ) -> Plan:
        """Validate the user's options (errors name the argument) and resolve the automatic ones;
        ``input_dtype``: the head's inputs' dtype (``None``: logits given, no matmul), which autocast, if on for
        ``device``, narrows (:attr:`matmul_dtype`)."""
        if chunk_size is not None and (
            isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
        ):
            raise ValueError(
                f"`chunk_size` must be a positive int (tokens per chunk) or None (automatic), got {chunk_size!r}."
            )
        if (
            isinstance(logit_scale, bool)
            or not isinstance(logit_scale, (int, float))
            or not (math.isfinite(logit_scale) and logit_scale > 0)
        ):
            raise ValueError(
                f"`logit_scale` must be a positive finite number (logits are multiplied by it; a divisor d is "
                f"logit_scale=1 / d), got {logit_scale!r}."
            )
        if softcap is not None and not softcap > 0:
            raise ValueError(f"`softcap` must be > 0 or None (no cap), got {softcap}.")
        if not temperature > 0:
            raise ValueError(f"`temperature` must be > 0, got {temperature}.")
        tp = 1 if tp_group is None else dist.get_world_size(tp_group)
        return cls(
            impl=_resolve_impl(impl, device),
            chunk_size=chunk_size or auto_chunk_size(n_tokens, local_vocab, device, sharded=tp > 1),
            logit_scale=float(logit_scale),
            softcap=None if softcap is None else float(softcap),
            inv_temp=1.0 / float(temperature),
            group=tp_group if tp > 1 else None,
            local_vocab=local_vocab,
            vocab=local_vocab * tp,
            matmul_dtype=None if input_dtype is None else _autocast_dtype(device, input_dtype),
        )

    @property
    def shard_start(self) -> int:
        """Global vocabulary id of this rank's first entry."""
        return 0 if self.group is None else self.local_vocab * dist.get_rank(self.group)

    def chunk(self, z: torch.Tensor, local_labels: torch.Tensor, *, writable: bool):
        """The backend's chunk (``TorchChunk`` or ``TritonChunk``) of logits ``z`` with this plan's transform."""
        return self._backend()(
            z,
            local_labels,
            logit_scale=self.logit_scale,
            softcap=self.softcap,
            inv_temp=self.inv_temp,
            writable=writable,
        )

    def _backend(self) -> type:
        """The chunk class of :attr:`impl`: ``TorchChunk`` or ``TritonChunk``."""
        if self.impl == "triton":
            # Imported here, not at module import: TRITON_INTERPRET must be settable until the first Triton use.
            from lightning_cp.ops._triton_kernels import TritonChunk

            return TritonChunk
        return TorchChunk


def _autocast_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype | None:
    """Autocast's dtype for ``device`` when it is on and narrower than ``dtype``, else ``None``."""
    if not torch.is_autocast_enabled(device.type):
        return None
    narrow = torch.get_autocast_dtype(device.type)
    return narrow if narrow.itemsize < dtype.itemsize else None


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _resolve_impl(impl: str, device: torch.device) -> str:
    if impl not in _IMPLS:
        raise ValueError(f"`impl` must be one of {_IMPLS}, got {impl!r}.")
    if impl == "auto":
        return "triton" if device.type == "cuda" and _triton_installed() else "torch"
    if impl == "triton":
        if not _triton_installed():
            raise ImportError(
                "impl='triton' needs the `triton` package: `pip install lightning-cp[triton]`, "
                "or use impl='torch'."
            )
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"impl='triton' runs on CUDA tensors, got tensors on {device}; use impl='torch', or set "
                "TRITON_INTERPRET=1 before the first Triton call to run the kernels in Triton's interpreter."
            )
    return impl
