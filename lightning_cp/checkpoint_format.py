"""The package's checkpoint format, read and written in one place: a file, or a sharded folder.

A checkpoint is what Lightning saves: the module's ``state_dict``, the optimizer states, and the rest
(``hyper_parameters``, ``datamodule_hyper_parameters``, ``global_step``, loops, callbacks). It takes one of
two forms:

- a **file** (``MegatronCPStrategy``): ``torch.save`` of the whole dict, written atomically by
  :class:`~lightning_cp.strategies.AtomicCheckpointIO`;
- a **folder** (``MegatronCPFSDPStrategy``): the module state under ``"state_dict"`` and optimizer ``i``'s under
  ``"optimizer_<i>"`` in ``torch.distributed.checkpoint`` files, every rank writing its own shards
  (:func:`save_sharded`), and everything else in ``meta.pt`` (from rank 0). :func:`load_sharded` reads it
  back resharded for any (dp, cp) layout; :func:`consolidate_checkpoint` turns it into a file.

:func:`open_checkpoint` reads either form without loading its tensors (a file memory-mapped, a folder's
metadata), for the CLI's checks before a run and for ``export_hf``, which reads one tensor at a time.
"""

from __future__ import annotations

import pickle
import warnings
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.strategies.fsdp import _distributed_checkpoint_load, _distributed_checkpoint_save
from lightning.fabric.strategies.model_parallel import _load_checkpoint
from lightning.fabric.utilities.load import _METADATA_FILENAME, _load_distributed_checkpoint
from lightning.fabric.utilities.types import _PATH
from torch import Tensor, nn
from torch.optim import Optimizer

METADATA_FILE = _METADATA_FILENAME
"""The file of a sharded checkpoint folder that holds everything but the tensors (``meta.pt``)."""
STATE_DICT = "state_dict"
"""The module's state: a key of the checkpoint dict, and the prefix of its tensors in a folder."""
FROZEN_BASE = "frozen_base"
"""The key of a checkpoint whose module state holds only the parameters that train (a LoRA run's adapters):
the record of the frozen rest, which the module rebuilds itself (:mod:`lightning_cp.hf.lora_checkpoint`).
The strategies check one with :func:`check_partial_state` before loading it, then load what it holds."""
_OPTIMIZER_PREFIX = "optimizer_"


class UnreadableCheckpoint(ValueError):
    """A path that is not a checkpoint of this format (missing, truncated, another kind of file)."""


class Checkpoint:
    """One checkpoint, file or folder, read without its tensors: what it says about itself, the shapes of
    the module's tensors, and one tensor at a time (:meth:`read`). Open with :func:`open_checkpoint`."""

    def __init__(
        self, path: Path, metadata: Mapping[str, Any], shapes: dict[str, tuple[torch.Size, torch.dtype]]
    ):
        self.path = path
        self.metadata = metadata
        """The checkpoint dict without the module and optimizer tensors (a file's is memory-mapped)."""
        self.shapes = shapes
        """``{name: (shape, dtype)}`` of the module's ``state_dict``."""

    @property
    def sharded(self) -> bool:
        """A folder written by ``MegatronCPFSDPStrategy`` rather than one file."""
        return self.path.is_dir()

    @property
    def global_step(self) -> int:
        """Optimizer steps taken when it was saved."""
        return int(self.metadata.get("global_step", 0))

    @property
    def hyper_parameters(self) -> dict[str, Any]:
        """The module's saved hyperparameters (``{}`` when it saved none)."""
        return dict(self.metadata.get("hyper_parameters") or {})

    @property
    def datamodule_hyper_parameters(self) -> dict[str, Any]:
        """The data module's saved hyperparameters (``{}`` when it saved none)."""
        return dict(self.metadata.get("datamodule_hyper_parameters") or {})

    def read(self, name: str) -> Tensor:
        """The module tensor ``name`` (a key of :attr:`shapes`), whole, on the CPU."""
        if not self.sharded:
            return self.metadata[STATE_DICT][name]
        import torch.distributed.checkpoint as dcp

        size, dtype = self.shapes[name]
        tensor = torch.empty(size, dtype=dtype)
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load({f"{STATE_DICT}.{name}": tensor}, checkpoint_id=str(self.path), no_dist=True)
        return tensor


def open_checkpoint(path: _PATH, *, tensors: bool = True) -> Checkpoint:
    """Open the file or folder ``path`` without loading its tensors. In one process, no process group.

    Args:
        path: a ``.ckpt`` file or a sharded folder.
        tensors: also list the module's tensors (:attr:`Checkpoint.shapes`); ``False`` reads only what the
            checkpoint says about itself (a folder's ``meta.pt``), the cheapest check.

    Raises:
        UnreadableCheckpoint: ``path`` does not exist, is truncated, was not written by ``torch.save``, or
            is a file without a ``state_dict``; the message names the file and the reason.
    """
    path = Path(path)
    if not path.exists():
        raise UnreadableCheckpoint(f"{str(path)!r} does not exist: give an existing checkpoint")
    sharded = path.is_dir()
    file = path / METADATA_FILE if sharded else path
    try:
        # weights_only=False: a checkpoint's hyperparameters may hold dataclasses such as GPTConfig.
        metadata = torch.load(file, map_location="cpu", mmap=not sharded, weights_only=False)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile) as error:
        text = str(error).strip()
        reason = text.split(". ")[0].splitlines()[0] if text else type(error).__name__
        raise UnreadableCheckpoint(
            f"{str(file)!r} is not a readable checkpoint ({reason}): it may be truncated (a copy or a save that "
            "did not finish) or not written by torch.save: give another checkpoint"
        ) from error
    if not isinstance(metadata, Mapping) or (STATE_DICT not in metadata and not sharded):
        raise UnreadableCheckpoint(
            f"{str(file)!r} is not a Lightning checkpoint (no 'state_dict'): give a file written by the trainer "
            "(last.ckpt, or one of ModelCheckpoint's)"
        )
    shapes: dict[str, tuple[torch.Size, torch.dtype]] = {}
    if tensors and sharded:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        entries = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        prefix = f"{STATE_DICT}."
        shapes = {
            key.removeprefix(prefix): (entry.size, entry.properties.dtype)
            for key, entry in entries.items()
            if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)
        }
    elif tensors:
        shapes = {name: (t.shape, t.dtype) for name, t in metadata[STATE_DICT].items()}
    return Checkpoint(path, metadata, shapes)


def check_partial_state(path: _PATH, module: nn.Module) -> set[str] | None:
    """Before ``module`` loads the checkpoint ``path``: ``None`` for a checkpoint that holds the whole module
    state; for one that holds only the parameters that train (:data:`FROZEN_BASE`), the module's
    ``check_frozen_base(record, path)`` compares the base it built with the one the checkpoint names, and the
    names of the tensors to load are returned. Reads the checkpoint's metadata only; no communication.

    Raises:
        ValueError: the module cannot check a frozen base (it has no ``check_frozen_base``); the
            checkpoint lacks a parameter of ``module`` that trains, or holds a tensor ``module`` does not have;
            what ``check_frozen_base`` raises (another base).
    """
    source = open_checkpoint(path)
    record = source.metadata.get(FROZEN_BASE)
    if record is None:
        return None
    owner = type(module).__name__
    check = getattr(module, "check_frozen_base", None)
    if check is None:
        raise ValueError(
            f"{str(source.path)!r} holds only the trained parameters of a model whose frozen base it names "
            f"({record.get('pretrained')!r}); {owner} has no check_frozen_base to rebuild and check that base: "
            "load it into the module that saved it (lightning_cp.models.HFCausalLM)."
        )
    check(record, source.path)
    saved = set(source.shapes)
    trained = {name for name, p in module.named_parameters() if p.requires_grad}
    missing, unknown = sorted(trained - saved), sorted(saved - set(module.state_dict()))
    if missing or unknown:
        problem = f"lacks {missing[0]}" if missing else f"holds {unknown[0]}, which {owner} does not have"
        count = len(missing) + len(unknown)
        raise ValueError(
            f"{str(source.path)!r} {problem} ({count} tensor(s) in all): it was saved from a model with other "
            "trained parameters (other LoRA target_modules?); resume with the settings the run trained with."
        )
    return saved


def save_sharded(checkpoint: dict[str, Any], path: Path, global_rank: int) -> None:
    """Write ``checkpoint`` as the folder ``path`` with ``torch.distributed.checkpoint``.

    The model state (``checkpoint["state_dict"]``) and the optimizer states (``"optimizer_states"``) hold
    this rank's shards (``DTensor``); they go to the DCP files, each rank writing its own. The rest
    (loops, callbacks, hyperparameters) goes to ``meta.pt``, from rank 0. A file at ``path`` (a checkpoint
    file of the same name) is replaced: rank 0 removes it and creates the folder before any rank writes
    into it. ``checkpoint`` loses those two keys.

    Communication: a barrier over the default group (none without one), then the collectives of
    ``torch.distributed.checkpoint.save`` (every rank must call this).
    """
    if global_rank == 0:
        if path.is_file():
            path.unlink()
        path.mkdir(parents=True, exist_ok=True)
    _barrier()  # every rank creates the folder in DCP's planning: not before rank 0 removed a file there
    states = {STATE_DICT: checkpoint.pop(STATE_DICT)}
    for index, state in enumerate(checkpoint.pop("optimizer_states", [])):
        states[f"{_OPTIMIZER_PREFIX}{index}"] = state
    _distributed_checkpoint_save(states, path)
    if global_rank == 0:
        torch.save(checkpoint, path / METADATA_FILE)


def _barrier() -> None:
    """Every rank of the default process group waits for the others; nothing without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    device_ids = [torch.cuda.current_device()] if dist.get_backend() == "nccl" else None
    dist.barrier(device_ids=device_ids)


def load_sharded(
    path: Path,
    module: nn.Module,
    optimizers: list[Optimizer],
    strict: bool,
    weights_only: bool | None,
    only: set[str] | None = None,
) -> dict[str, Any]:
    """Load a folder written by :func:`save_sharded` (resharded if the layout differs), or a consolidated file.

    The model and optimizer states go straight into the sharded ``module`` and ``optimizers``; the rest of
    the checkpoint is returned. ``only``: the module tensors the checkpoint holds when it holds part of the
    module state (:func:`check_partial_state`); the others keep their values.

    Communication: the collectives of ``torch.distributed.checkpoint.load`` (every rank must call this).
    """
    if only is not None and path.is_dir():
        return _load_part(path, module, optimizers, only, weights_only)
    state: dict[str, Any] = {STATE_DICT: module}
    state.update({f"{_OPTIMIZER_PREFIX}{index}": optimizer for index, optimizer in enumerate(optimizers)})
    return _load_checkpoint(
        path=path,
        state=state,
        strict=strict and only is None,
        optimizer_states_from_list=True,
        weights_only=weights_only,
    )


def _load_part(
    path: Path, module: nn.Module, optimizers: list[Optimizer], names: set[str], weights_only: bool | None
) -> dict[str, Any]:
    """Lightning's load of a sharded folder (``_load_checkpoint``), for the module tensors ``names`` only."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    state = {name: t for name, t in get_model_state_dict(module).items() if name in names}
    _distributed_checkpoint_load({STATE_DICT: state}, path)
    module.load_state_dict(state, strict=False)
    for index, optimizer in enumerate(optimizers):
        key = f"{_OPTIMIZER_PREFIX}{index}"
        found = {key: get_optimizer_state_dict(module, optimizer)}
        _distributed_checkpoint_load(found, path)
        options = StateDictOptions(cpu_offload=True)
        set_optimizer_state_dict(module, optimizer, optim_state_dict=found[key], options=options)
    return torch.load(path / METADATA_FILE, weights_only=weights_only)


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
