"""Checkpoint files: written atomically (DDP), or as sharded folders (FSDP) and consolidated offline.

Lightning's ``TorchCheckpointIO`` serializes to memory, writes the bytes to a temporary file in the
system's temporary directory and moves it over the target. When that directory is on another filesystem
(``/tmp`` next to a checkpoint volume, the common case on clusters) the move is a copy: a full disk or a
kill during the copy leaves a truncated file under the final name, which then looks like the newest
checkpoint, and overwriting ``last.ckpt`` destroys the previous good one. Measured with a 200 KiB tmpfs:
a 400 KiB checkpoint is left as a 192 KiB ``.ckpt`` that does not load.

:class:`AtomicCheckpointIO` writes next to the target (same filesystem), flushes and fsyncs the file,
renames it over the target (atomic on POSIX), and fsyncs the directory so the rename survives a crash.

:class:`~lightning_cp.MegatronCPFSDPStrategy` writes a checkpoint as a ``torch.distributed.checkpoint``
folder instead (:func:`save_sharded`): every rank writes its own shards of the model and optimizer states,
no rank gathers them, and :func:`load_sharded` reshards them for any (dp, cp) layout.
:func:`consolidate_checkpoint` turns such a folder into one ordinary file, offline.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.strategies.fsdp import _distributed_checkpoint_save
from lightning.fabric.strategies.model_parallel import _load_checkpoint
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.fabric.utilities.load import _METADATA_FILENAME, _load_distributed_checkpoint
from lightning.fabric.utilities.types import _PATH
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

# In a sharded folder the model's state is "state_dict" and optimizer i's state "optimizer_<i>".
_STATE_DICT = "state_dict"
_OPTIMIZER_PREFIX = "optimizer_"


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local checkpoint files are replaced atomically.

    A save that fails (``ENOSPC``, a kill) leaves the previous file at ``path`` untouched and no partial file
    under any ``*.ckpt`` name; the hidden temporary file (``.<name>.tmp-<pid>``) is removed when the error is
    a Python exception. Remote paths (``s3://``, ...) go through Lightning's own transaction.
    """

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None or not _is_local_file_protocol(path):
            super().save_checkpoint(checkpoint, path, storage_options)  # its own checks and remote path
            return
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        temporary = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        try:
            with open(temporary, "wb") as file:
                torch.save(checkpoint, file)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, target)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
        _fsync_directory(target.parent)


def _fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable (POSIX; a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_sharded(checkpoint: dict[str, Any], path: Path, global_rank: int) -> None:
    """Write ``checkpoint`` as the folder ``path`` with ``torch.distributed.checkpoint``.

    The model state (``checkpoint["state_dict"]``) and the optimizer states (``"optimizer_states"``) hold
    this rank's shards (``DTensor``); they go to the DCP files, each rank writing its own. The rest
    (loops, callbacks, hyperparameters) goes to ``meta.pt``, from rank 0. A file at ``path`` is replaced.
    ``checkpoint`` loses those two keys.

    Communication: the collectives of ``torch.distributed.checkpoint.save`` (every rank must call this).
    """
    if global_rank == 0 and path.is_file():
        path.unlink()
    path.mkdir(parents=True, exist_ok=True)
    states = {_STATE_DICT: checkpoint.pop(_STATE_DICT)}
    for index, state in enumerate(checkpoint.pop("optimizer_states", [])):
        states[f"{_OPTIMIZER_PREFIX}{index}"] = state
    _distributed_checkpoint_save(states, path)
    if global_rank == 0:
        torch.save(checkpoint, path / _METADATA_FILENAME)


def load_sharded(
    path: Path, module: nn.Module, optimizers: list[Optimizer], strict: bool, weights_only: bool | None
) -> dict[str, Any]:
    """Load a folder written by :func:`save_sharded` (resharded if the layout differs), or a consolidated file.

    The model and optimizer states go straight into the sharded ``module`` and ``optimizers``; the rest of
    the checkpoint is returned.

    Communication: the collectives of ``torch.distributed.checkpoint.load`` (every rank must call this).
    """
    state: dict[str, Any] = {_STATE_DICT: module}
    state.update({f"{_OPTIMIZER_PREFIX}{index}": optimizer for index, optimizer in enumerate(optimizers)})
    return _load_checkpoint(
        path=path, state=state, strict=strict, optimizer_states_from_list=True, weights_only=weights_only
    )


def consolidate_checkpoint(folder: _PATH, output_file: _PATH) -> None:
    """Turn a sharded ``MegatronCPFSDPStrategy`` checkpoint folder into one ordinary checkpoint file.

    Runs in one process, without a process group, and needs the whole model and optimizer state in CPU
    memory. The weights load like any Lightning checkpoint's (``GPTModule.load_from_checkpoint(output_file)``,
    ``torch.load``); ``Trainer.fit(..., ckpt_path=output_file)`` with ``MegatronCPFSDPStrategy`` resumes from
    it (the optimizer state is keyed by parameter name, as ``torch.distributed.checkpoint`` keeps it).

    Example::

        python -c "from lightning_cp.strategies import consolidate_checkpoint as c; c('last.ckpt', 'last.pt')"
    """
    checkpoint = _load_distributed_checkpoint(Path(folder))
    optimizers = sorted(
        (key for key in checkpoint if key.startswith(_OPTIMIZER_PREFIX)),
        key=lambda key: int(key.removeprefix(_OPTIMIZER_PREFIX)),
    )
    checkpoint["optimizer_states"] = [checkpoint.pop(key) for key in optimizers]
    torch.save(checkpoint, output_file)
