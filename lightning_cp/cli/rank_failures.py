"""One summary when a rank of a ``lightning-cp`` run dies: which rank, and how, instead of every traceback.

When one rank dies (``kill -9``, the out-of-memory killer, an exception), every other rank's next collective
fails with a gloo or NCCL "peer is gone" error, and each prints a long traceback that names neither the rank
that died nor why. Here:

- Lightning's launcher (rank 0 on each node, which starts ranks ``1..n-1`` with the same command line) is
  replaced by :class:`ReportingLauncher`. It gives its ranks a run-scoped folder, watches their exit
  statuses, and when the run fails prints one line per rank that caused it, on stderr:
  ``lightning-cp: rank 2 of 4 (pid 1234) was killed by SIGKILL`` or
  ``lightning-cp: rank 1 of 4 (pid 1233) failed: ValueError: ...``.
- A rank that fails (:func:`handle_failure`, called by the CLI) writes how into that folder: the first line
  of a real exception, whose traceback it still prints, or "a peer is gone", after which it exits quietly.
- A SIGTERM to the launcher before the run's own SIGTERM handling is installed (during setup) ends its
  ranks with it, silently, instead of leaving them to fail on their next collective.
- Without Lightning's launcher (torchrun, SLURM: ranks started by the scheduler) a rank whose peer is gone
  prints one line saying so instead of the traceback; the rank that failed prints its own error, and the
  scheduler reports a killed one.

A real exception is never hidden: its traceback is printed by the rank that raised it, and its first line
is in the summary.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch import Trainer
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from typing_extensions import override

_REPORTS_ENV = "LIGHTNING_CP_RANK_REPORTS"
"""The folder the launcher's ranks report their failure in (set by the launcher, inherited by its ranks)."""
_LAUNCHER_ENV = "LIGHTNING_CP_LAUNCHER_PID"

_PEER_GONE = (
    "Connection closed by peer",  # gloo, the peer's end of the socket closed
    "Connection reset by peer",  # gloo
    "Broken pipe",
    "ncclRemoteError",
    "remote process exited",  # NCCL's remote error
    "NCCL communicator was aborted",  # the NCCL watchdog after a peer failed
)
"""Parts of gloo's and NCCL's messages for a collective whose peer process is gone."""

_PEERS_EXIT_S = 3.0
"""How long the launcher waits for its ranks to end by themselves before it kills them (SIGKILL)."""
_GRACE_S = 10.0
"""How long after a rank died the launcher's main thread may take to report it before the observer does
(a survivor's NCCL collective may never return)."""
_POLL_S = 0.5


def is_peer_gone(error: BaseException) -> bool:
    """Whether ``error`` (or an error it was raised from) says that another rank of a collective is gone."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if any(part in str(current) for part in _PEER_GONE):
            return True
        current = current.__cause__ or current.__context__
    return False


def first_line(error: BaseException) -> str:
    """``"ValueError: the first line of the message"``."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


class ReportingLauncher(_SubprocessScriptLauncher):
    """Lightning's launcher for ranks started as subprocesses, that summarises a failed run in one line per cause.

    Built from the strategy's own launcher (:meth:`replace`). Starts the ranks as Lightning's does, with
    :data:`_REPORTS_ENV` naming a folder of its own in their environment, and replaces Lightning's observer
    (which SIGKILLs the whole job, launcher included, 5 s after a rank dies) with one that leaves the
    summary to :meth:`summarise`, or writes it itself if the main thread has not done so ``_GRACE_S`` after
    a rank died.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reports: Path | None = None
        self._summary_lock = threading.Lock()
        self._killed: set[int] = set()  # pids this launcher killed itself: not causes of the failure

    @classmethod
    def replace(cls, trainer: Trainer) -> None:
        """Give ``trainer``'s strategy a reporting launcher if it starts its ranks with Lightning's (popen)."""
        launcher = getattr(trainer.strategy, "_launcher", None)
        if type(launcher) is _SubprocessScriptLauncher and launcher.num_processes * launcher.num_nodes > 1:
            trainer.strategy._launcher = cls(
                launcher.cluster_environment, launcher.num_processes, launcher.num_nodes
            )

    @override
    def launch(self, function: Callable, *args: Any, trainer: Trainer | None = None, **kwargs: Any) -> Any:
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            self.reports = Path(tempfile.mkdtemp(prefix="lightning-cp-ranks-"))
            atexit.register(shutil.rmtree, self.reports, ignore_errors=True)
            os.environ[_REPORTS_ENV] = str(self.reports)
            os.environ[_LAUNCHER_ENV] = str(os.getpid())
            self._end_ranks_on_sigterm()
            self._call_children_scripts()
            threading.Thread(target=self._observe, daemon=True, name="lightning-cp-rank-observer").start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)

    def _end_ranks_on_sigterm(self) -> None:
        """Until the run installs its own SIGTERM handling, a SIGTERM to the launcher ends its ranks with it.

        Lightning installs its handler (which forwards the signal to the ranks) only once setup is done,
        and the package's strategies theirs when a stage starts: before that a SIGTERM ended the launcher
        alone (the default action), and its ranks went on with their setup until a collective with it
        failed, printing C++ frames after the shell's prompt. This handler sends the signal to the ranks
        started so far (whose own default action ends them at once, silently), then takes the default
        action itself (or calls the handler that was there before, if any). Called later by a handler
        installed after it (Lightning's, the package's, which call the one they replaced), it does nothing:
        that handler decides (a preemption stops every rank after the same step).
        """
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        previous = signal.getsignal(signal.SIGTERM)
        if previous is signal.SIG_IGN:
            return

        def end_ranks(signum: int, frame: Any) -> None:
            if signal.getsignal(signal.SIGTERM) is not end_ranks:
                return  # called by the handler that replaced this one
            self.kill(signum)
            if callable(previous):
                previous(signum, frame)
                return
            if self.reports is not None:
                shutil.rmtree(self.reports, ignore_errors=True)  # no atexit after the default action
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

        signal.signal(signal.SIGTERM, end_ranks)

    def summarise(self, error: BaseException) -> int:
        """After ``error`` on this rank: let the ranks end (killing those still running after ``_PEERS_EXIT_S``),
        print one line per rank that caused the failure on stderr, and return the exit status for the run.

        The status is ``128 + signal`` when the first cause is a signal, else 1.
        """
        with self._summary_lock:
            return self._summarise(error)

    def _summarise(self, error: BaseException | None) -> int:
        deadline = time.monotonic() + _PEERS_EXIT_S
        while any(proc.poll() is None for proc in self.procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        for proc in self.procs:
            if proc.poll() is None:
                self._killed.add(proc.pid)
                proc.kill()
                proc.wait()
        world = self.num_processes * self.num_nodes
        first_rank = self.cluster_environment.node_rank() * self.num_processes
        causes: list[tuple[str, int]] = []
        if error is not None and not is_peer_gone(error):
            causes.append(
                (f"rank {first_rank} of {world} (pid {os.getpid()}) failed: {first_line(error)}", 1)
            )
        for local_rank, proc in enumerate(self.procs, start=1):
            cause = self._cause(first_rank + local_rank, proc)
            if cause is not None:
                causes.append(
                    (f"rank {first_rank + local_rank} of {world} (pid {proc.pid}) {cause[0]}", cause[1])
                )
        if not causes:
            here = first_line(error) if error is not None else "no error here"
            elsewhere = f"rank {first_rank} of {world} stopped: a rank on another node is gone ({here})."
            causes.append((f"{elsewhere} See that node's output.", 1))
        print("\n".join(f"lightning-cp: {line}" for line, _ in causes), file=sys.stderr, flush=True)
        return causes[0][1]

    def _cause(self, rank: int, proc: subprocess.Popen) -> tuple[str, int] | None:
        """How rank ``rank`` (ended) caused the failure, with the status it implies; ``None`` if it did not."""
        if proc.returncode == 0:
            return None
        assert self.reports is not None
        report = self.reports / f"rank-{rank}.txt"
        if report.exists():
            kind, _, message = report.read_text().partition("\n")
            return None if kind == "peer" else (f"failed: {message}", 1)
        if proc.pid in self._killed:
            return None
        if proc.returncode < 0:
            name = signal.Signals(-proc.returncode).name
            hint = " (also what the out-of-memory killer sends)" if name == "SIGKILL" else ""
            return f"was killed by {name}{hint}", 128 - proc.returncode
        return f"exited with status {proc.returncode} without a Python error", proc.returncode

    def _observe(self) -> None:
        """Report for the main thread if a rank died and the main thread has not reported within ``_GRACE_S``."""
        died_at: float | None = None
        while True:
            time.sleep(_POLL_S)
            codes = [proc.poll() for proc in self.procs]
            if all(code == 0 for code in codes):
                return
            if died_at is None and any(code not in (None, 0) for code in codes):
                died_at = time.monotonic()
            if died_at is not None and time.monotonic() - died_at > _GRACE_S:
                if not self._summary_lock.acquire(blocking=False):
                    return  # the main thread is reporting
                status = self._summarise(None)
                assert self.reports is not None
                shutil.rmtree(self.reports, ignore_errors=True)
                os._exit(status)


def handle_failure(error: Exception, trainer: Trainer) -> None:
    """Report ``error``, raised by this rank's ``fit`` / ``validate`` / ``test`` / ``predict``.

    Returns, for the caller to re-raise ``error`` (its traceback is printed), when the error is this rank's
    own and the launcher is another process, or when the run is a single process; otherwise exits: the
    launcher after its summary, a rank whose peer is gone after one line or none (the launcher reports).

    Raises:
        SystemExit: on the launcher (after its summary), on a rank whose peer is gone.
    """
    launcher = trainer.strategy.launcher
    peer_gone = is_peer_gone(error)
    if isinstance(launcher, ReportingLauncher) and launcher.reports is not None:
        if not peer_gone:
            traceback.print_exception(error)
        raise SystemExit(launcher.summarise(error))
    reports = os.environ.get(_REPORTS_ENV)
    if reports is not None and trainer.world_size > 1:
        launcher_rank = trainer.global_rank - trainer.local_rank
        _report_to_launcher(Path(reports), trainer.global_rank, launcher_rank, error, peer_gone)
    elif peer_gone and trainer.world_size > 1:
        _exit_peer_gone(
            f"rank {trainer.global_rank} of {trainer.world_size} stopped: another rank is gone "
            f"({first_line(error)}). That rank printed its error, or was killed: see its exit status."
        )


def _report_to_launcher(
    reports: Path, rank: int, launcher_rank: int, error: Exception, peer_gone: bool
) -> None:
    try:
        (reports / f"rank-{rank}.txt").write_text(f"{'peer' if peer_gone else 'error'}\n{first_line(error)}")
    except OSError:
        pass  # the launcher's folder is gone with it: reported below
    if not peer_gone:
        return
    launcher = os.environ.get(_LAUNCHER_ENV)
    if launcher is not None and os.getppid() == int(launcher):
        raise SystemExit(1)  # the launcher reports
    # The launcher died first: one rank (the first to create the marker) says so.
    try:
        os.close(os.open(reports / "launcher-gone", os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        raise SystemExit(1) from None
    except OSError:
        pass
    _exit_peer_gone(
        f"rank {launcher_rank} (the launcher, pid {launcher}) ended without a summary: it was killed (a signal, or the "
        "out-of-memory killer) or crashed; its exit status says how. The other ranks stopped."
    )


def _exit_peer_gone(message: str) -> NoReturn:
    print(f"lightning-cp: {message}", file=sys.stderr, flush=True)
    raise SystemExit(1)
