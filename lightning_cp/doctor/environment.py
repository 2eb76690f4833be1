"""What the doctor reports about the machine: versions, attention kernels, devices, and the package's choices.

Every choice is read from the function the package itself uses (``_varlen.use_flash`` for CP
attention, ``ops._plan._resolve_impl`` and ``auto_chunk_size`` for the loss), never re-derived here.
Sections are lists of ``(key, value)`` lines.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import os
import platform
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_cp.doctor._compare import dtype_name
from lightning_cp.doctor.attention import kernel_name
from lightning_cp.ops import _plan

Section = list[tuple[str, str]]

_DISTRIBUTIONS = ("lightning-cp", "torch", "triton", "transformers", "megatron-core", "lightning")
_PEERS = ("liger-kernel", "cut-cross-entropy")
"""Optional libraries the benchmarks compare against."""
_FLASH_MODULES = (
    ("flash_attn", "FlashAttention-2 package (flash_attn)"),
    ("flash_attn_interface", "FlashAttention-3 (flash_attn_interface)"),
    ("flash_attn.cute.interface", "FlashAttention-4 (flash_attn.cute)"),
)
_HYBRID_MODULES = (
    ("fla", "flash-linear-attention (Gated DeltaNet, KDA)"),
    ("causal_conv1d", "causal-conv1d (short convolutions)"),
    ("mamba_ssm", "mamba-ssm (Mamba2 scan)"),
)
"""The CUDA kernels of hybrid models' token mixers, which transformers uses where installed (extra ``hybrid``)."""
_LOSS_SHAPES = ((32768, 128256), (32768, 151936))
"""(tokens, vocabulary) for which the automatic loss chunk is shown."""
_HEAD_DIMS = (64, 128)
GIB = 2**30


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def versions() -> Section:
    """Python, torch with its CUDA / cuDNN / NCCL, and the libraries the package runs on."""
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    nccl = None
    if dist.is_available() and dist.is_nccl_available():
        with contextlib.suppress(Exception):  # a CUDA build without a usable NCCL library
            nccl = ".".join(str(part) for part in torch.cuda.nccl.version())
    lines = [
        ("python", platform.python_version()),
        ("torch", torch.__version__),
        ("CUDA", torch.version.cuda or "none (CPU build of torch)"),
        ("cuDNN", str(cudnn) if cudnn else "none"),
        ("NCCL", nccl or "none"),
    ]
    lines += [(name, _version(name)) for name in _DISTRIBUTIONS if name != "torch"]
    return lines + [(name, _version(name)) for name in _PEERS]


def _import_status(module: str) -> str:
    """``installed <version>``, ``not installed`` or ``import fails: <error>`` (an ABI mismatch, say)."""
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a missing parent package of a dotted name
        found = False
    if not found:
        return "not installed"
    try:
        imported = importlib.import_module(module)
    except Exception as error:  # noqa: BLE001  (whatever breaks the import is what the user needs to see)
        return f"import fails: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    return f"importable {getattr(imported, '__version__', '')}".rstrip()


def attention_kernels() -> Section:
    """The flash-attention kernels torch has and which is active in its aten ops, and the packages."""
    built = torch.backends.cuda.is_flash_attention_available()
    lines = [
        ("FlashAttention-2 in torch (aten)", "built" if built else "not built (CPU build or no support)")
    ]
    with contextlib.suppress(ImportError, AttributeError):  # the registry is newer than torch 2.5
        from torch.nn.attention import current_flash_attention_impl, list_flash_attention_impls

        active = current_flash_attention_impl() or "FA2 (default)"
        registered = ", ".join(list_flash_attention_impls()) or "none"
        lines.append(("aten flash implementation", f"{active}; registered: {registered}"))
    lines += [(label, _import_status(module)) for module, label in _FLASH_MODULES]
    return lines + [(label, _import_status(module)) for module, label in _HYBRID_MODULES]


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def devices(device: torch.device) -> Section:
    """The CPU, and every CUDA device (name, memory, compute capability); free memory of ``device``."""
    threads = f"{torch.get_num_threads()} torch threads"
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    lines = [("cpu", f"{_cpu_name()}, {usable} usable cores, {threads}")]
    if not torch.cuda.is_available():
        return lines + [("cuda", "no CUDA device visible to torch")]
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        text = f"{props.name}, {props.total_memory / GIB:.1f} GiB, sm_{props.major}{props.minor}"
        text += f", {props.multi_processor_count} SMs"
        if device.type == "cuda" and (device.index or 0) == index:
            free, _ = torch.cuda.mem_get_info(index)
            text += f", {free / GIB:.1f} GiB free (checked here)"
        lines.append((f"cuda:{index}", text))
    return lines


def selection(device: torch.device, dtypes: tuple[torch.dtype, ...], rank: int | None = None) -> Section:
    """Which kernels the package picks on ``device``: CP attention per dtype and head size, the loss (its
    automatic chunk as this process, ``rank`` of a launched group when given, sizes it now)."""
    lines = []
    for dtype in dtypes:
        name = dtype_name(dtype)
        kernels = {dim: kernel_name(torch.empty(1, 1, dim, dtype=dtype, device=device)) for dim in _HEAD_DIMS}
        text = ", ".join(f"head_dim {dim}: {kernel}" for dim, kernel in kernels.items())
        lines.append((f"CP attention {name}", text))
    sdpa = "F.scaled_dot_product_attention"
    if device.type == "cuda":
        enabled = [
            label
            for label, on in (
                ("flash", torch.backends.cuda.flash_sdp_enabled()),
                ("mem_efficient", torch.backends.cuda.mem_efficient_sdp_enabled()),
                ("cudnn", torch.backends.cuda.cudnn_sdp_enabled()),
                ("math", torch.backends.cuda.math_sdp_enabled()),
            )
            if on
        ]
        sdpa += f" (backends enabled: {', '.join(enabled) or 'none'})"
    lines.append(("attention without CP", sdpa))
    installed = [label.split(" ")[0] for module, label in _HYBRID_MODULES if importlib.util.find_spec(module)]
    kernels = ", ".join(installed) if installed and device.type == "cuda" else "transformers' torch kernels"
    mixers = f"head-parallel: one all-to-all each way, the model's own kernels ({kernels}); "
    lines.append(("hybrid token mixers", mixers + "fla's state-passing CP is not used"))
    impl = _plan._resolve_impl("auto", device)
    chunks = ", ".join(
        f"{_plan.auto_chunk_size(tokens, vocab, device)} tokens at {tokens} x {vocab}"
        for tokens, vocab in _LOSS_SHAPES
    )
    whose = "this process" if rank is None else f"this process (rank {rank})"
    if device.type == "cuda":
        free = _plan._cuda_available_bytes(device) / GIB
        whose += f", from the {free:.1f} GiB free to it now: other processes and moments may pick others"
    lines.append(("fused loss", f"impl='auto' -> {impl}; automatic chunk of {whose}: {chunks}"))
    return lines
