"""The one place that asks Megatron-core ``parallel_state`` for process groups and ranks.

Everything else in the package goes through these functions, so that the rest of the code works
the same whether Megatron's model-parallel state is initialized (under ``MegatronCPStrategy``) or not
(a single process, or plain DDP): without it, CP and TP are trivial (size 1) and the data-parallel
group is the default world group (``None``), or no group at all when ``torch.distributed`` is off.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from types import ModuleType

import torch.distributed as dist

ProcessGroup = dist.ProcessGroup


def _parallel_state() -> ModuleType:
    """Megatron-core's ``parallel_state``, imported on first use (DataLoader workers never need it)."""
    with warnings.catch_warnings():
        # megatron-core warns at import when TransformerEngine / Apex are absent; the package never needs them.
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state
    return parallel_state


def model_parallel_initialized() -> bool:
    """Whether Megatron's ``parallel_state`` has been initialized in this process."""
    if "megatron.core.parallel_state" not in sys.modules:
        return False  # nobody initialized it: no need to import Megatron to find out
    return dist.is_available() and dist.is_initialized() and _parallel_state().model_parallel_is_initialized()


# Groups Megatron created in `initialize`: `destroy_model_parallel` only forgets them, and each one keeps
# its communication threads (about 50 per initialization on gloo) until it is destroyed explicitly.
_created_groups: list[ProcessGroup] = []


def _live_groups() -> list[ProcessGroup]:
    return list(dist.distributed_c10d._world.pg_map)


def initialize(tp: int, cp: int) -> None:
    """Create Megatron's TP / CP / DP groups over the already-initialized default process group.

    Megatron orders ranks ``tp-cp-ep-dp-pp``: TP peers are adjacent ranks, then CP, then DP. Gloo
    shadow groups are only made for NCCL worlds (on a gloo world they would duplicate every group).
    """
    before = set(_live_groups())
    _parallel_state().initialize_model_parallel(
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
        create_gloo_process_groups=dist.get_backend() != "gloo",
    )
    _created_groups.extend(group for group in _live_groups() if group not in before)


def destroy() -> None:
    """Tear down Megatron's groups and release their resources (the default process group stays)."""
    if model_parallel_initialized():
        _parallel_state().destroy_model_parallel()
    while _created_groups:
        dist.destroy_process_group(_created_groups.pop())


def cp_group() -> ProcessGroup | None:
    """The context-parallel group of this rank, or ``None`` when CP is not set up."""
    return _parallel_state().get_context_parallel_group() if model_parallel_initialized() else None


def cp_size() -> int:
    return _parallel_state().get_context_parallel_world_size() if model_parallel_initialized() else 1


def cp_rank() -> int:
    return _parallel_state().get_context_parallel_rank() if model_parallel_initialized() else 0


def tp_group() -> ProcessGroup | None:
    """The tensor-parallel group of this rank, or ``None`` when TP is not set up."""
    return _parallel_state().get_tensor_model_parallel_group() if model_parallel_initialized() else None


def tp_size() -> int:
    return _parallel_state().get_tensor_model_parallel_world_size() if model_parallel_initialized() else 1


def tp_rank() -> int:
    return _parallel_state().get_tensor_model_parallel_rank() if model_parallel_initialized() else 0


def dp_group() -> ProcessGroup | None:
    """The data-parallel group without CP peers; the world group (``None``) without Megatron state."""
    return _parallel_state().get_data_parallel_group() if model_parallel_initialized() else None


def dp_size() -> int:
    if model_parallel_initialized():
        return _parallel_state().get_data_parallel_world_size()
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def dp_rank() -> int:
    if model_parallel_initialized():
        return _parallel_state().get_data_parallel_rank()
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def dp_cp_group() -> ProcessGroup | None:
    """The group over which gradients, loss sums and token counts are reduced (DP x CP).

    Without Megatron state this is the world group (``None``), which is what plain DDP reduces over.
    """
    if model_parallel_initialized():
        return _parallel_state().get_data_parallel_group(with_context_parallel=True)
    return None


def dp_cp_size() -> int:
    return dp_size() * cp_size()


@dataclass(frozen=True)
class ParallelLayout:
    """Where this rank sits in the parallel layout; used in file names and log messages."""

    rank: int
    dp: int
    cp: int
    tp: int

    def tag(self) -> str:
        """``dp1-cp0-tp0``: the coordinates of this rank in the DP x CP x TP grid."""
        return f"dp{self.dp}-cp{self.cp}-tp{self.tp}"


def layout() -> ParallelLayout | None:
    """This rank's DP / CP / TP coordinates, or ``None`` when Megatron's state is not initialized."""
    if not model_parallel_initialized():
        return None
    return ParallelLayout(rank=dist.get_rank(), dp=dp_rank(), cp=cp_rank(), tp=tp_rank())
