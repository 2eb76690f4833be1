from lightning_cp.parallel import groups


def _threads() -> int:
    with open("/proc/self/status") as status:
        return int(next(line for line in status if line.startswith("Threads")).split()[1])


def _initialize_and_destroy(cycles):
    counts = []
    for cp in [2, 1] * cycles:
        groups.initialize(tp=1, cp=cp)
        assert groups.cp_size() == cp and groups.dp_cp_size() == 2
        groups.destroy()
        assert not groups.model_parallel_initialized() and groups.cp_group() is None
        counts.append(_threads())
    return counts


def test_destroy_releases_megatrons_groups(world2):
    """Megatron's destroy only forgets its groups; each gloo group keeps ~50 threads unless destroyed."""
    for counts in world2.run(_initialize_and_destroy, 4):
        assert max(counts) - min(counts) <= 2, counts
