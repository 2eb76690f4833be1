"""The checkpoint format: a sharded folder written over a file of the same name, and read back in its dtypes.

The folders are written by :func:`save_sharded` itself (on the shared gloo ranks, or in one process without
a process group, as ``torch.distributed.checkpoint`` allows) and read back with :func:`open_checkpoint`,
one tensor at a time, as ``export_hf`` reads them.
"""

from __future__ import annotations

import time
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist

from lightning_cp.checkpoint_format import open_checkpoint, save_sharded

_WEIGHTS = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.tensor([0.5, -1.5])}


def _save_over_a_file(path: Path) -> str:
    """Every rank: save a folder at ``path``, where a checkpoint file is; rank 0 is slow to remove it."""
    rank = dist.get_rank()
    if rank == 0:
        path.write_bytes(b"an earlier .ckpt file")
    dist.barrier()
    unlink = Path.unlink

    def slow_unlink(self, *args, **kwargs):  # the other ranks reach the folder first
        time.sleep(1.0)
        return unlink(self, *args, **kwargs)

    with mock.patch.object(Path, "unlink", slow_unlink):
        checkpoint = {"state_dict": dict(_WEIGHTS), "global_step": 3, "hyper_parameters": {"lr": 0.1}}
        save_sharded(checkpoint, path, rank)
    return "saved"


def test_a_folder_replaces_a_file_of_its_name_and_no_rank_creates_it_first(world2, tmp_path):
    path = tmp_path / "last.ckpt"
    assert world2.run(_save_over_a_file, path) == ["saved", "saved"]
    checkpoint = open_checkpoint(path)
    assert checkpoint.sharded and checkpoint.global_step == 3 and checkpoint.hyper_parameters == {"lr": 0.1}
    for name, tensor in _WEIGHTS.items():
        assert torch.equal(checkpoint.read(name), tensor)


def test_a_folder_is_read_back_in_each_tensor_s_stored_dtype(tmp_path):
    weights = {
        "bf16": torch.randn(3, 5).to(torch.bfloat16),
        "fp16": torch.randn(4).to(torch.float16),
        "fp32": torch.randn(2, 2),
        "int": torch.arange(5),
    }
    save_sharded({"state_dict": dict(weights)}, tmp_path / "folder", 0)
    checkpoint = open_checkpoint(tmp_path / "folder")
    assert checkpoint.shapes == {name: (tensor.shape, tensor.dtype) for name, tensor in weights.items()}
    for name, tensor in weights.items():
        read = checkpoint.read(name)
        assert read.dtype == tensor.dtype and torch.equal(read, tensor), name
