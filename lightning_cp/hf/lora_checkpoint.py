"""A LoRA run's checkpoints: the adapters and their optimizer state, with the frozen base named, not saved.

A checkpoint of :class:`~lightning_cp.models.HFCausalLM` with ``lora=`` and a pretrained directory holds the
adapters (``...q_proj.lora_A.default.weight``, ``lora_B``) and their AdamW state only, and under
:data:`~lightning_cp.checkpoint_format.FROZEN_BASE` the record of its base (:func:`base_record`): the
pretrained directory, the base's dtype, the LoRA settings (the quantization's included) and a fingerprint
of the directory's tensors (every stored tensor's shape and dtype, read from the safetensors headers, and the
SHA-256 of the first rows, up to 2^19 elements, of :data:`CHECKSUMMED` of them). The frozen base is rebuilt
from the directory, as the run built it (QLoRA's NF4 quantized again from it, bit for bit), so a 70B QLoRA
checkpoint is the adapters' megabytes, not the base's gigabytes.

On resume (``Trainer.fit(ckpt_path=...)``, ``predict``) the strategy asks the module to compare its own
base's record with the checkpoint's (:func:`check_base`) before loading anything, and loads the adapters and
their optimizer state alone. A base that differs (other tensors, another dtype or quantization, other LoRA
settings) is refused with what differs; a directory that moved is not (the fingerprint is the base, the path
only where to find it). ``export_hf`` reads the base from the recorded directory, or from the one it is given.

A LoRA run on a randomly initialized base (``config`` a dict) has no directory to name: its checkpoints hold
the base too, as full fine-tuning's do; a QLoRA one is refused (its NF4 base could be neither saved nor
rebuilt). No process group anywhere here.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from lightning_cp.checkpoint_format import FROZEN_BASE, STATE_DICT
from lightning_cp.hf.lora import LoRA, is_adapter

CHECKSUMMED = 4
"""Stored tensors whose first rows (up to 2^19 elements, at least one row) are hashed: evenly spaced over the
sorted names (the first and the last included), so that a fine-tune of the same architecture differs."""
_CHECKSUM_ELEMENTS = 2**19
_COMPARED = ("rank", "alpha", "target_modules", "quantize", "nf4_block_size", "nf4_scaler_block_size")
"""The LoRA settings a resume must share with the checkpoint (the dropout may change)."""


def base_record(directory: Path, dtype: torch.dtype, lora: LoRA) -> dict[str, Any]:
    """What names the frozen base of a LoRA run on the pretrained ``directory`` with its parameters in ``dtype``:
    ``{"pretrained", "dtype", "lora", "tensors": {stored name: [shape, dtype]}, "checksums": {stored name:
    sha256}}``. Reads the safetensors headers and the first rows of :data:`CHECKSUMMED` tensors."""
    from safetensors import safe_open

    tensors: dict[str, list[Any]] = {}
    files: dict[str, Path] = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                view = handle.get_slice(name)
                tensors[name] = [list(view.get_shape()), view.get_dtype()]
                files[name] = file
    names = sorted(tensors)
    picked = sorted({names[round(i * (len(names) - 1) / (CHECKSUMMED - 1))] for i in range(CHECKSUMMED)})
    checksums = {}
    for name in picked:
        with safe_open(str(files[name]), "pt") as handle:
            checksums[name] = _checksum(handle.get_slice(name), tensors[name][0])
    settings = asdict(lora)
    return {
        "pretrained": str(directory),
        "dtype": str(dtype).removeprefix("torch."),
        "lora": {key: settings[key] for key in _COMPARED},
        "tensors": tensors,
        "checksums": checksums,
    }


def _checksum(view: Any, shape: list[int]) -> str:
    """SHA-256 of the bytes of the first rows of a safetensors slice, up to 2^19 elements (at least one row)."""
    if not shape:
        head = view[...]
    else:
        row = max(1, math.prod(shape[1:]))
        head = view[: max(1, _CHECKSUM_ELEMENTS // row)]
    return hashlib.sha256(head.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def keep_adapters_only(checkpoint: dict[str, Any], record: Mapping[str, Any]) -> None:
    """Make the Lightning checkpoint dict ``checkpoint`` (before it is written) a LoRA run's: its module state
    the adapters only (their AdamW state is all the optimizer holds), and ``record`` (:func:`base_record`)
    under :data:`~lightning_cp.checkpoint_format.FROZEN_BASE` in place of the frozen base."""
    state = checkpoint[STATE_DICT]
    checkpoint[STATE_DICT] = {name: state[name] for name in state if is_adapter(name)}
    checkpoint[FROZEN_BASE] = dict(record)


def check_base(saved: Mapping[str, Any], current: Mapping[str, Any], checkpoint: Path, owner: str) -> None:
    """Refuse to load the adapters of ``checkpoint`` (whose base record is ``saved``) into ``owner``'s model,
    whose base record is ``current`` (both :func:`base_record`), when the two bases differ.

    Raises:
        ValueError: naming the checkpoint, what differs (dtype, LoRA settings, the tensors: how many, the
            first), the base it was trained on and what to do.
    """
    problems = []
    if saved["dtype"] != current["dtype"]:
        problems.append(f"the base's dtype: {saved['dtype']} there, {current['dtype']} here")
    settings = [
        f"{key}={saved['lora'][key]!r} there, {current['lora'][key]!r} here"
        for key in _COMPARED
        if saved["lora"][key] != current["lora"][key]
    ]
    problems += [f"LoRA({', '.join(settings)})"] if settings else []
    theirs, ours = saved["tensors"], current["tensors"]
    differ = sorted(n for n in theirs.keys() | ours.keys() if theirs.get(n) != ours.get(n))
    if differ:
        first = differ[0]
        problems.append(
            f"{len(differ)} stored tensor(s) differ in name, shape or dtype (first {first}: "
            f"{theirs.get(first, 'absent')} there, {ours.get(first, 'absent')} here)"
        )
    else:
        # The same stored names pick the same tensors to hash.
        changed = sorted(n for n, s in saved["checksums"].items() if current["checksums"].get(n) != s)
        if changed:
            problems.append(
                f"the values of {', '.join(changed)} differ (another fine-tune of the same shape)"
            )
    if problems:
        raise ValueError(
            f"{owner}: the checkpoint {str(checkpoint)!r} holds LoRA adapters trained on the base "
            f"{saved['pretrained']!r}; this model's base ({current['pretrained']!r}) differs from it: "
            f"{'; '.join(problems)}. Resume with the base and settings the run trained with (HFCausalLM(config="
            f"{saved['pretrained']!r}, dtype={saved['dtype']!r}, lora=...)), or start a new run without "
            "ckpt_path."
        )
