"""A pool of gloo worker processes that stays up across many test cases.

Starting a process group costs seconds on a small machine (each process imports torch, Lightning and
Megatron), so tests never spawn per case: the session-scoped fixtures in ``conftest.py`` start one
pool per world size, and each case sends a module-level function to every rank with ``pool.run``.

Every rank initializes the default gloo group once. After each case the worker destroys Megatron's
model-parallel groups, so cases can use different (tp, cp) layouts over the same world.
:func:`captured` runs a command on every rank with each rank's output captured (``pool.run(captured, ...)``).
"""

from __future__ import annotations

import os
import queue
import socket
import sys
import tempfile
import traceback
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch.multiprocessing as mp

_TASK_TIMEOUT_S = 240.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, tasks: Any, results: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        NODE_RANK="0",
    )
    launcher_environment = dict(os.environ)
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    from lightning_cp.parallel import groups

    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        # What a launcher set stays set: Lightning's ``LightningEnvironment.teardown`` deletes
        # ``WORLD_SIZE`` at the end of a fit, which would make the next case's rank a lone process.
        os.environ.clear()
        os.environ.update(launcher_environment)
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - the traceback is sent back to the test
            results.put((rank, False, traceback.format_exc()))
        finally:
            groups.destroy()
    dist.destroy_process_group()


class Captured(NamedTuple):
    """What :func:`captured` saw of one rank's call."""

    status: int
    """``SystemExit``'s status, 0 when the call returned."""
    out: str
    err: str


def captured(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Captured:
    """``fn(*args, **kwargs)`` on this rank, with file descriptors 1 and 2 written to files, as a process of
    its own would write them: ``pool.run(captured, main, [...])`` runs a command on every rank of a pool
    (the ranks Lightning's launcher would start) and returns each rank's :class:`Captured`.

    Warnings are shown once per place, as Python's defaults do (the pool ignores them otherwise). Any
    exception other than ``SystemExit`` propagates (the pool reports it with the rank's traceback).
    """
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        saved = [os.dup(1), os.dup(2)]
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        status = 0
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("default")
                fn(*args, **kwargs)
        except SystemExit as exit_:
            status = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, copy in zip((1, 2), saved):
                os.dup2(copy, fd)
                os.close(copy)
        out.seek(0)
        err.seek(0)
        return Captured(status, out.read(), err.read())


class WorkerPool:
    """``world_size`` processes in one gloo world, running test functions on every rank."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        ctx = mp.get_context("spawn")
        port = _free_port()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_worker, args=(r, world_size, port, self._tasks[r], self._results), daemon=True
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results in rank order.

        A failure on any rank raises here with that rank's traceback. A rank stuck in a collective
        (because a peer failed) would block forever, so the pool is shut down on the first failure.
        """
        for q in self._tasks:
            q.put((fn, args, kwargs))
        out: dict[int, Any] = {}
        while len(out) < self.world_size:
            try:
                rank, ok, value = self._results.get(timeout=_TASK_TIMEOUT_S)
            except queue.Empty:
                self.close(force=True)
                missing = sorted(set(range(self.world_size)) - set(out))
                raise TimeoutError(f"{fn.__name__} did not finish on ranks {missing}") from None
            if not ok:
                self.close(force=True)
                raise RuntimeError(f"{fn.__name__} failed on rank {rank}:\n{value}")
            out[rank] = value
        return [out[r] for r in range(self.world_size)]

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def close(self, force: bool = False) -> None:
        if not force:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=30)
        for p in self._procs:
            if p.is_alive():
                p.kill()
