import os
import sys
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


@pytest.fixture
def cli(capfd, monkeypatch):
    """``cli(*args)`` runs ``lightning-cp ARGS`` in this process: exit status, stdout, stderr (fd level).

    Lightning's seeding writes ``PL_GLOBAL_SEED`` / ``PL_SEED_WORKERS`` into ``os.environ``; they are put
    back afterwards so that processes started by later tests do not inherit them.
    """
    monkeypatch.setattr(sys, "argv", ["lightning-cp"])
    saved = {name: os.environ.get(name) for name in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")}

    from lightning_cp.cli import main as lightning_cp_main

    def run(*args: str) -> tuple[int, str, str]:
        capfd.readouterr()
        try:
            lightning_cp_main(list(args))
            status = 0
        except SystemExit as exit_:
            status = exit_.code or 0
        out, err = capfd.readouterr()
        return status, out, err

    yield run
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture
def cli_before_launch(cli, monkeypatch):
    """``cli`` for a command that must end before Lightning starts one process per device: starting them
    fails the test (in this process they would run pytest again)."""
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    def start_ranks(launcher):
        raise AssertionError("Lightning started the processes of the other ranks")

    monkeypatch.setattr(_SubprocessScriptLauncher, "_call_children_scripts", start_ranks)
    return cli
