import warnings

import pytest
import torch

from tests._dist import WorkerPool

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")

_pools: dict[int, WorkerPool] = {}


def _pool(world_size: int) -> WorkerPool:
    pool = _pools.get(world_size)
    if pool is None or not pool.alive:
        pool = _pools[world_size] = WorkerPool(world_size)
    return pool


@pytest.fixture
def world1() -> WorkerPool:
    """One gloo rank (a world of one: the single-GPU layout), started once and shared like the others."""
    return _pool(1)


@pytest.fixture
def world2() -> WorkerPool:
    """Two gloo ranks, started once and shared by every test of the session (restarted after a failure)."""
    return _pool(2)


@pytest.fixture
def world4() -> WorkerPool:
    """Four gloo ranks, started once and shared by every test of the session (restarted after a failure)."""
    return _pool(4)


def pytest_sessionfinish(session, exitstatus):
    for pool in _pools.values():
        pool.close()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
