"""QLoRA's frozen 4-bit base: the decoder's linear weights as ``torchao`` NF4 tensors, quantized as they load.

``LoRA(quantize="nf4")`` (:mod:`lightning_cp.hf.lora`) quantizes every ``nn.Linear`` weight of the model's
decoder body (``get_decoder()``: the attention and MLP projections, the targets and the rest) with
``torchao``'s ``to_nf4``; the token embeddings, the norms and the output head keep the model's dtype (the
head and the embeddings are a small part of a large model, and the fused loss reads the head's weight as it
is). An NF4 weight is frozen; a layer's ``F.linear`` dequantizes it to the input's dtype for the call and
again in the backward (the input's gradient), one weight at a time: nothing of it is kept between calls.

Where the weights come from:

- a model built whole (a config dict, or ``from_pretrained`` under DDP, which loads the whole model as
  without LoRA) is quantized weight by weight in place, each full-precision weight freed as its NF4 replaces it;
- a model built on ``meta`` for :class:`~lightning_cp.MegatronCPFSDPStrategy` gets ``meta`` NF4 weights, which
  ``fully_shard`` splits by rows; after sharding, :func:`fill_quantized` reads each weight from the
  safetensors whole, one at a time, quantizes it and keeps this rank's rows. NF4's second-level scale
  (``scaler_mean``) is the mean over the whole weight, so a shard quantized alone would differ from the
  unsharded model's: each rank reads every quantized weight (peak: one weight in the load dtype beside the
  rank's shards), then holds ``1 / (dp * cp)`` of them. FSDP gathers the NF4 shards (``torchao``'s
  ``fsdp_pre_all_gather``: the 4-bit codes and the scales, not a dequantized weight).

``torchao`` is optional: ``pip install 'lightning-cp[lora]'``.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_cp.hf.lora import INSTALL, stored_name

_NF4_MODULE = "torchao.quantization.quantize_.workflows.nf4.nf4_tensor"
"""Where ``torchao`` defines ``NF4Tensor`` (public as ``torchao.quantization.NF4Tensor``)."""


def require_torchao() -> None:
    """Raise the ``ImportError`` that says how to install ``torchao``, if it is missing."""
    if importlib.util.find_spec("torchao") is None:
        raise ImportError(f"LoRA(quantize='nf4') needs torchao's NF4 tensor: {INSTALL}.")


def is_quantized(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is an NF4 tensor, or a ``DTensor`` whose local shard is one (``False`` when
    ``torchao`` was never imported)."""
    module = sys.modules.get(_NF4_MODULE)
    if module is None:
        return False
    local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    return isinstance(local, module.NF4Tensor)


def quantize_linear_weights(model: nn.Module, block_size: int, scaler_block_size: int) -> list[str]:
    """Replace the weight of every ``nn.Linear`` of ``model``'s decoder body (``model.get_decoder()``, else
    ``model``) by its frozen NF4 quantization, in place, one at a time; returns the weights' names in ``model``.
    Weights on ``meta`` become ``meta`` NF4 tensors (:func:`fill_quantized` fills them). No communication.

    Raises:
        ImportError: ``torchao`` is not installed.
        ValueError: a weight whose size is not a multiple of ``block_size * scaler_block_size``, naming it.
    """
    require_torchao()
    from torchao.quantization import to_nf4

    body = model.get_decoder() if hasattr(model, "get_decoder") else model
    prefix = next(name for name, module in model.named_modules() if module is body)
    done = []
    for name, linear in body.named_modules():
        if not isinstance(linear, nn.Linear) or is_quantized(linear.weight):
            continue
        qualified = ".".join(p for p in (prefix, name, "weight") if p)
        _check_blocks(qualified, linear.weight.numel(), block_size, scaler_block_size)
        with torch.no_grad():
            quantized = to_nf4(linear.weight.detach(), block_size, scaler_block_size)
        linear.weight = nn.Parameter(quantized, requires_grad=False)
        done.append(qualified)
    return done


def _check_blocks(name: str, numel: int, block_size: int, scaler_block_size: int) -> None:
    if numel % (block_size * scaler_block_size):
        raise ValueError(
            f"LoRA(quantize='nf4'): {name} has {numel} weights, not a multiple of nf4_block_size * "
            f"nf4_scaler_block_size = {block_size} * {scaler_block_size}: choose smaller NF4 block sizes "
            "(powers of two that divide every quantized weight's size, and its shard's under FSDP)."
        )


def fill_quantized(
    model: nn.Module, names: list[str], directory: Path, stored: Callable[[str], str], device: torch.device
) -> None:
    """Fill the NF4 weights ``names`` of ``model`` (a pretrained model built on ``meta``, maybe sharded by
    FSDP2 since; the weights allocated empty or still on ``meta``) from the safetensors of ``directory``: each
    weight read whole (``stored(name)``: its name there, after :func:`~lightning_cp.hf.lora.stored_name`), cast
    to the weight's dtype, quantized with the weight's block sizes, and this rank's rows kept (FSDP's
    ``Shard(0)`` split), on ``device``, as a new frozen parameter. One weight at a time. No communication.

    Raises:
        ValueError: the checkpoint lacks a weight or holds it in another shape; a shard of a weight that
            does not hold whole quantization blocks.
    """
    from safetensors import safe_open

    files = files_by_name(directory) if names else {}
    for name in names:
        param = model.get_parameter(name)
        key = stored(stored_name(name))
        if key not in files:
            raise ValueError(
                f"The checkpoint in {directory} lacks {key}, which LoRA(quantize='nf4') quantizes."
            )
        local = param._local_tensor if isinstance(param, DTensor) else param
        with safe_open(str(directory / files[key]), "pt") as handle:
            full = handle.get_tensor(key)
        if tuple(full.shape) != tuple(param.shape):
            raise ValueError(
                f"The checkpoint in {directory} holds {key} {tuple(full.shape)} (model: {tuple(param.shape)})."
            )
        quantized = _quantize_like(local, full.to(device=device, dtype=param.dtype))
        if isinstance(param, DTensor):
            quantized = _this_ranks_rows(name, quantized, param)
            value = DTensor.from_local(
                quantized,
                param.device_mesh,
                param.placements,
                run_check=False,
                shape=param.shape,
                stride=param.stride(),
            )
        else:
            value = quantized
        owner, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(owner), attribute, nn.Parameter(value, requires_grad=False))


def _quantize_like(like: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    from torchao.quantization import to_nf4

    return to_nf4(full, like.block_size, like.scaler_block_size)


def _this_ranks_rows(name: str, quantized: torch.Tensor, param: DTensor) -> torch.Tensor:
    """The rows of the whole NF4 weight ``quantized`` that ``param`` (a ``Shard(0)`` DTensor) holds here."""
    mesh = param.device_mesh
    world, rank = mesh.size(), mesh.get_local_rank()
    block = quantized.block_size * quantized.scaler_block_size
    if quantized.shape[0] % world or quantized.numel() // world % block:
        raise ValueError(
            f"LoRA(quantize='nf4'): {name} {tuple(quantized.shape)} does not split into {world} shards of whole "
            f"NF4 blocks ({quantized.block_size} * {quantized.scaler_block_size} weights): choose smaller NF4 "
            "block sizes, or fewer ranks."
        )
    return torch.chunk(quantized, world, dim=0)[rank]


def files_by_name(directory: Path) -> Mapping[str, str]:
    """``{stored tensor name: safetensors file name}`` of ``directory``."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return json.loads(index.read_text())["weight_map"]
    from safetensors import safe_open

    files = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            files.update(dict.fromkeys(handle.keys(), file.name))
    return files
