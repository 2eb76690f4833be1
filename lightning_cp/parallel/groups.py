"""Creating and destroying Megatron-core's model-parallel state: the only module that touches it.

:func:`initialize` builds Megatron's TP / CP / DP groups over the default process group and returns the
:class:`~lightning_cp.parallel.ParallelLayout` read off them; everything else in the package uses that
layout, never Megatron's globals. Megatron is imported on first use, so DataLoader workers (which import
``lightning_cp.data``) never load it.
"""

from __future__ import annotations

import warnings
from types import ModuleType

import torch.distributed as dist

from lightning_cp.parallel.layout import ParallelLayout, ProcessGroup


def _parallel_state() -> ModuleType:
    with warnings.catch_warnings():
        # megatron-core warns at import when TransformerEngine / Apex are absent; the package never needs them.
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state
    return parallel_state


# Groups Megatron created in `initialize`: `destroy_model_parallel` forgets most of them without
# destroying them, and each one keeps its communication threads (about 50 per initialization on gloo).
_created_groups: list[ProcessGroup] = []


def _live_groups() -> list[ProcessGroup]:
    return list(dist.distributed_c10d._world.pg_map)


def initialize(tp: int, cp: int, *, gloo_shadow_groups: bool | None = None) -> ParallelLayout:
    """Create Megatron's TP / CP / DP groups over the initialized default process group.

    Megatron orders ranks ``tp-cp-ep-dp-pp``: TP peers are adjacent ranks, then CP, then DP.

    Args:
        tp: tensor-parallel size.
        cp: context-parallel size; ``world_size`` must be a multiple of ``tp * cp``.
        gloo_shadow_groups: also create Megatron's gloo copies of the data-parallel groups. Default: only
            on NCCL worlds (on a gloo world they would duplicate every group).

    Returns:
        This rank's layout, with ``None`` for every group of size 1.

    Communication: the collective creation of every Megatron group (all ranks must call it).
    """
    parallel_state = _parallel_state()
    before = set(_live_groups())
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
        create_gloo_process_groups=(
            dist.get_backend() != "gloo" if gloo_shadow_groups is None else gloo_shadow_groups
        ),
    )
    _created_groups.extend(group for group in _live_groups() if group not in before)
    dp = parallel_state.get_data_parallel_world_size()
    return ParallelLayout(
        dp=dp,
        cp=cp,
        tp=tp,
        rank=dist.get_rank(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        cp_rank=parallel_state.get_context_parallel_rank(),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        cp_group=parallel_state.get_context_parallel_group() if cp > 1 else None,
        tp_group=parallel_state.get_tensor_model_parallel_group() if tp > 1 else None,
        dp_group=parallel_state.get_data_parallel_group() if dp > 1 else None,
        loss_group=(
            parallel_state.get_data_parallel_group(with_context_parallel=True) if dp * cp > 1 else None
        ),
    )


def destroy() -> None:
    """Tear down Megatron's state and release its groups (the default process group stays).

    Megatron's ``destroy_model_parallel`` destroys some groups itself (the gloo shadow groups of NCCL
    worlds) and only forgets the others; the ones still alive are destroyed here.
    """
    if _created_groups:
        _parallel_state().destroy_model_parallel()
    live = set(_live_groups())
    while _created_groups:
        group = _created_groups.pop()
        if group in live:
            dist.destroy_process_group(group)


def mesh_groups() -> tuple[ProcessGroup, ProcessGroup, ProcessGroup]:
    """Megatron's DP, CP and TP groups of this rank, also of size 1: the dimensions of a ``DeviceMesh``.

    Only a ``DeviceMesh`` needs group objects for dimensions of size 1; everything that communicates uses
    the layout's groups, which are ``None`` there.
    """
    parallel_state = _parallel_state()
    return (
        parallel_state.get_data_parallel_group(),
        parallel_state.get_context_parallel_group(),
        parallel_state.get_tensor_model_parallel_group(),
    )


def seed_model_parallel_cuda_rng(seed: int) -> None:
    """Seed Megatron's CUDA RNG tracker (per-TP-rank streams for model-parallel dropout) from ``seed``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import tensor_parallel
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
