"""The checkpoint format: a sharded folder written over a file of the same name, and read back in its dtypes.

The folders are written by :func:`save_sharded` itself (on the shared gloo ranks, or in one process without
a process group, as ``torch.distributed.checkpoint`` allows) and read back with :func:`open_checkpoint`,
one tensor at a time, as ``export_hf`` reads them.
"""

from __future__ import annotations

import time
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from lightning_cp.checkpoint_format import FROZEN_BASE, check_partial_state, open_checkpoint, save_sharded

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


def test_a_checkpoint_without_its_frozen_base_is_checked_before_it_loads(tmp_path):
    """``check_partial_state``: a whole checkpoint is none of its business; one that names a frozen base needs a
    module that checks that base, and must hold every parameter that trains and nothing the module lacks."""

    class Adapted(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.base = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
            self.adapter = torch.nn.Parameter(torch.zeros(2))
            self.checked = []

        def check_frozen_base(self, record, path):
            self.checked.append((record, path))

    record = {"pretrained": "/models/base"}
    whole, part, wrong = (tmp_path / f"{name}.ckpt" for name in ("whole", "part", "wrong"))
    torch.save({"state_dict": {"base": torch.ones(2), "adapter": torch.ones(2)}}, whole)
    torch.save({"state_dict": {"adapter": torch.ones(2)}, FROZEN_BASE: record}, part)
    torch.save({"state_dict": {"other": torch.ones(2)}, FROZEN_BASE: record}, wrong)
    module = Adapted()
    assert check_partial_state(whole, module) is None and not module.checked
    assert check_partial_state(part, module) == {"adapter"} and module.checked == [(record, part)]
    with pytest.raises(ValueError, match=r"wrong\.ckpt' lacks adapter \(2 tensor\(s\) in all\)"):
        check_partial_state(wrong, module)
    with pytest.raises(ValueError, match=r"names \('/models/base'\); Linear has no check_frozen_base"):
        check_partial_state(part, torch.nn.Linear(2, 2))
