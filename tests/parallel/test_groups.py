"""Megatron's groups are created into a ParallelLayout and fully released (including on NCCL-style worlds)."""

import torch.distributed as dist

from lightning_cp.parallel import groups


def _threads() -> int:
    with open("/proc/self/status") as status:
        return int(next(line for line in status if line.startswith("Threads")).split()[1])


def _initialize_and_destroy(cycles):
    counts = []
    for cp in [2, 1] * cycles:
        layout = groups.initialize(tp=1, cp=cp)
        assert (layout.cp, layout.dp) == (cp, 2 // cp)
        groups.destroy()
        counts.append(_threads())
    return counts


def test_destroy_releases_megatrons_groups(world2):
    """Megatron's destroy only forgets most groups; each gloo group keeps ~50 threads unless destroyed."""
    for counts in world2.run(_initialize_and_destroy, 4):
        assert max(counts) - min(counts) <= 2, counts


def _destroy_with_gloo_shadow_groups():
    """On NCCL worlds Megatron adds gloo copies of its DP groups and destroys them itself in teardown."""
    before = len(dist.distributed_c10d._world.pg_map)
    groups.initialize(tp=1, cp=2, gloo_shadow_groups=True)
    groups.destroy()
    return len(dist.distributed_c10d._world.pg_map) - before


def test_destroy_after_megatron_destroyed_its_gloo_shadow_groups(world2):
    # Before the fix: ValueError("Invalid process group specified") from dist.destroy_process_group.
    assert world2.run(_destroy_with_gloo_shadow_groups) == [0, 0]


def _layouts():
    out = {}
    for tp, cp in ((1, 1), (1, 2), (2, 1), (1, 4), (2, 2)):
        layout = groups.initialize(tp=tp, cp=cp)
        out[(tp, cp)] = layout
        assert (layout.cp_group is None) == (cp == 1) and (layout.tp_group is None) == (tp == 1)
        assert (layout.loss_group is None) == (layout.dp * cp == 1)
        if layout.cp_group is not None:
            assert (
                dist.get_world_size(layout.cp_group) == cp
                and dist.get_rank(layout.cp_group) == layout.cp_rank
            )
        if layout.loss_group is not None:
            assert dist.get_world_size(layout.loss_group) == layout.dp * cp
        groups.destroy()
    return {key: (value.dp, value.dp_rank, value.cp_rank, value.tp_rank) for key, value in out.items()}


def test_initialize_returns_the_megatron_layout(world4):
    results = world4.run(_layouts)
    # Megatron orders ranks TP fastest, then CP, then DP.
    for rank, layouts in enumerate(results):
        assert layouts[(1, 1)] == (4, rank, 0, 0)
        assert layouts[(1, 2)] == (2, rank // 2, rank % 2, 0)
        assert layouts[(2, 1)] == (2, rank // 2, 0, rank % 2)
        assert layouts[(1, 4)] == (1, 0, rank, 0)
        assert layouts[(2, 2)] == (1, 0, rank // 2, rank % 2)
