"""Checkpoint files written atomically: the ``CheckpointIO`` of both strategies.

Lightning's ``TorchCheckpointIO`` serializes to memory, writes the bytes to a temporary file in the
system's temporary directory and moves it over the target. When that directory is on another filesystem
(``/tmp`` next to a checkpoint volume, the common case on clusters) the move is a copy: a full disk or a
kill during the copy leaves a truncated file under the final name, which then looks like the newest
checkpoint, and overwriting ``last.ckpt`` destroys the previous good one. Measured with a 200 KiB tmpfs:
a 400 KiB checkpoint is left as a 192 KiB ``.ckpt`` that does not load.

:class:`AtomicCheckpointIO` writes next to the target (same filesystem), flushes and fsyncs the file,
renames it over the target (atomic on POSIX), and fsyncs the directory so the rename survives a crash.

:class:`~lightning_cp.MegatronCPFSDPStrategy` writes a checkpoint as a ``torch.distributed.checkpoint``
folder instead (:mod:`lightning_cp.checkpoint_format`, which reads and writes both forms).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.fabric.utilities.types import _PATH
from typing_extensions import override


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
