"""A rank that dies during ``lightning-cp fit``: one summary naming it and how, not every survivor's traceback.

The runs are real: the console script on 2 gloo ranks started by Lightning's launcher, where a test callback
(:mod:`tests.cli._failing_rank`) makes one rank kill itself with SIGKILL or raise after step 2. Before the
change, the same run printed every surviving rank's ``Connection closed by peer`` traceback and never named
the rank that died. Without a launcher (torchrun, SLURM), :func:`handle_failure` is called directly.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest

from lightning_cp.cli import rank_failures
from lightning_cp.cli.rank_failures import first_line, handle_failure, is_peer_gone
from tests.test_cli import CONSOLE_SCRIPT, MAIN_JOB, REPO

_GLOO_CLOSED = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:29095. This is typically caused by a remote worker crashing."
)
_MAX_LINES = 40


_ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
}


def _fit_with_a_failing_rank(tmp_path, rank: int, how: str, devices: int = 2) -> subprocess.CompletedProcess:
    """``lightning-cp fit`` of the main job on ``devices`` ranks, rank ``rank`` failing after step 2."""
    callback = {
        "class_path": "tests.cli._failing_rank.FailRank",
        "init_args": {"rank": rank, "step": 2, "how": how},
    }
    return run_fit(tmp_path, devices, [callback])


def run_fit(
    tmp_path, devices: int, callbacks: list[dict], *extra: str, timeout: float = 120
) -> subprocess.CompletedProcess:
    """The console script's ``fit`` of :func:`fit_arguments` and ``extra`` arguments, in a process of its own
    (its ranks started by Lightning's launcher), its output captured; fails the test after ``timeout``."""
    return subprocess.run(
        [str(CONSOLE_SCRIPT), *fit_arguments(tmp_path, devices, callbacks), *extra],
        cwd=REPO,
        env=_ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def fit_arguments(tmp_path, devices: int, callbacks: list[dict]) -> list[str]:
    """The arguments of ``lightning-cp fit`` of the main job on ``devices`` ranks with ``callbacks`` (only),
    quiet, writing under ``tmp_path``; later arguments override these.

    Two ranks run the config's cp=2 (one sequence over both, collectives in every layer); any other number
    runs cp=1 (DDP's gradient all-reduce every step).
    """
    return [
        "fit",
        "--config",
        str(MAIN_JOB),
        "--ckpt_path",
        "null",
        "--trainer.devices",
        str(devices),
        "--trainer.strategy.init_args.cp",
        "2" if devices == 2 else "1",
        "--trainer.max_steps",
        "20",
        "--trainer.logger",
        "false",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.enable_model_summary",
        "false",
        "--trainer.default_root_dir",
        str(tmp_path),
        "--trainer.callbacks",
        json.dumps(callbacks),
        "--data.init_args.num_train_samples",
        "64",
    ]


def _output(result: subprocess.CompletedProcess) -> str:
    return result.stdout + result.stderr


def test_a_killed_rank_is_named_once_with_its_signal(tmp_path):
    result = _fit_with_a_failing_rank(tmp_path, rank=1, how="kill")
    output = _output(result)
    assert result.returncode == 128 + signal.SIGKILL, output[-3000:]
    assert re.search(
        r"^lightning-cp: rank 1 of 2 \(pid \d+\) was killed by SIGKILL", result.stderr, re.MULTILINE
    ), output
    assert output.count("SIGKILL") == 1
    assert "Traceback" not in output and "Connection closed by peer" not in output
    assert len(output.splitlines()) < _MAX_LINES, output


@pytest.mark.parametrize("rank", [1, 0], ids=["a-rank", "the-launcher"])
def test_a_rank_that_raises_is_named_with_the_first_line_and_its_traceback_is_kept(rank, tmp_path):
    result = _fit_with_a_failing_rank(tmp_path, rank=rank, how="raise")
    output = _output(result)
    assert result.returncode == 1, output[-3000:]
    summary = re.findall(r"^lightning-cp: rank (\d) of 2 \(pid \d+\) (.*)$", result.stderr, re.MULTILINE)
    assert summary == [(str(rank), f"failed: ValueError: rank {rank} cannot go on")], output
    # The failing rank's own traceback, once; the other rank's "peer is gone" one is not printed.
    assert output.count("Traceback") == 1
    assert re.search(rf"^(\[rank{rank}\]: )?ValueError: rank {rank} cannot go on$", output, re.MULTILINE)
    assert "Connection closed by peer" not in output and "Connection reset by peer" not in output


def test_a_killed_launcher_is_reported_once_by_the_ranks_it_started(tmp_path):
    result = _fit_with_a_failing_rank(tmp_path, rank=0, how="kill", devices=3)  # 2 ranks left to agree
    output = _output(result)
    assert result.returncode == -signal.SIGKILL, output[-3000:]
    assert output.count("ended without a summary") == 1, output
    assert re.search(
        r"^lightning-cp: rank 0 \(the launcher, pid \d+\) ended without a summary", output, re.MULTILINE
    )
    assert "Traceback" not in output
    assert len(output.splitlines()) < _MAX_LINES, output


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except OSError:
        return False


def test_sigterm_during_setup_ends_every_rank_with_the_launcher_and_nothing_is_printed_after(tmp_path):
    """Before the change the launcher died alone and its rank went on with its setup (here 60 s held in a
    callback's ``setup``) until a collective with the launcher failed, printing C++ frames after the prompt."""
    callback = {
        "class_path": "tests.cli._failing_rank.HoldInSetup",
        "init_args": {"folder": str(tmp_path), "seconds": 60},
    }
    run = subprocess.Popen(
        [str(CONSOLE_SCRIPT), *fit_arguments(tmp_path, 2, [callback])],
        cwd=REPO,
        env=_ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    markers = [tmp_path / "setup-0", tmp_path / "setup-1"]
    deadline = time.monotonic() + 120
    while not all(marker.exists() and marker.read_text() for marker in markers):
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()
        time.sleep(0.1)
    pids = [int(marker.read_text()) for marker in markers]
    run.send_signal(signal.SIGTERM)
    out, err = run.communicate(timeout=20)  # the end of the output: every process that held it has ended
    assert run.returncode == -signal.SIGTERM
    assert not any(_alive(pid) for pid in pids)
    output = out + err
    assert "Traceback" not in output and "frame #" not in output and "lightning-cp:" not in output, output


def test_the_launcher_reports_a_dead_rank_when_its_own_collective_never_returns(tmp_path):
    """As under NCCL without an error: the observer thread writes the summary and ends the launcher."""
    script = textwrap.dedent(
        """
        import os, subprocess, sys, threading, time
        from lightning.fabric.plugins.environments import LightningEnvironment
        from lightning_cp.cli import rank_failures
        rank_failures._GRACE_S = 1.0
        launcher = rank_failures.ReportingLauncher(LightningEnvironment(), num_processes=3, num_nodes=1)
        launcher._call_children_scripts = lambda: launcher.procs.extend(
            subprocess.Popen([sys.executable, "-c", code]) for code in
            ("import time; time.sleep(60)", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
        )
        launcher.launch(time.sleep, 60)
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 128 + signal.SIGSEGV, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and re.match(
        r"lightning-cp: rank 2 of 3 \(pid \d+\) was killed by SIGSEGV$", lines[0]
    )


# --- without Lightning's launcher: torchrun, SLURM --------------------------------------------------------------


def _scheduled_rank(rank: int, world_size: int) -> SimpleNamespace:
    """The trainer attributes :func:`handle_failure` reads, for a rank a scheduler started."""
    return SimpleNamespace(
        strategy=SimpleNamespace(launcher=None), global_rank=rank, local_rank=rank, world_size=world_size
    )


def test_a_scheduled_rank_whose_peer_is_gone_prints_one_line(capsys, monkeypatch):
    monkeypatch.delenv(rank_failures._REPORTS_ENV, raising=False)
    with pytest.raises(SystemExit) as exit_:
        handle_failure(RuntimeError(_GLOO_CLOSED), _scheduled_rank(3, 4))
    assert exit_.value.code == 1
    expected = (
        f"lightning-cp: rank 3 of 4 stopped: another rank is gone (RuntimeError: {_GLOO_CLOSED}). That rank "
        "printed its error, or was killed: see its exit status."
    )
    assert capsys.readouterr().err.splitlines() == [expected]


def test_a_real_error_is_left_to_raise_with_its_traceback(capsys, monkeypatch):
    monkeypatch.delenv(rank_failures._REPORTS_ENV, raising=False)
    assert handle_failure(ValueError("bad batch"), _scheduled_rank(3, 4)) is None
    assert handle_failure(RuntimeError(_GLOO_CLOSED), _scheduled_rank(0, 1)) is None  # one process: no peer
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "message",
    [
        _GLOO_CLOSED,
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:6575: Connection reset by peer.",
        "NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there was a network error",
        "Process group watchdog thread terminated with exception: NCCL communicator was aborted on rank 1.",
    ],
    ids=["gloo-closed", "gloo-reset", "nccl-remote", "nccl-watchdog"],
)
def test_peer_gone_errors_are_recognised_also_when_wrapped(message):
    assert is_peer_gone(RuntimeError(message))
    try:
        try:
            raise RuntimeError(message)
        except RuntimeError as cause:
            raise ValueError("a metric could not be synced") from cause
    except ValueError as wrapped:
        assert is_peer_gone(wrapped)


def test_other_errors_are_not_peer_gone_errors():
    assert not is_peer_gone(ValueError("data.vocab_size=600 is larger than the model's vocab_size=512"))
    assert not is_peer_gone(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))


def test_first_line_names_the_type_and_the_first_line():
    assert first_line(ValueError("rank 1 cannot go on\nthe second line")) == "ValueError: rank 1 cannot go on"
    assert first_line(KeyError()) == "KeyError"


class _EndedRank:
    """What the launcher reads of a rank process it started that has ended."""

    def __init__(self, pid: int, returncode: int) -> None:
        self.pid, self.returncode = pid, returncode

    def poll(self) -> int:
        return self.returncode


def test_the_ranks_of_the_second_node_are_named_by_their_global_rank(tmp_path, monkeypatch, capsys):
    """Node 1 of 2, three ranks a node (global ranks 3, 4, 5): its launcher failed, rank 4 was killed, rank 5
    raised (and reported it, under its global rank, through handle_failure)."""
    from lightning.fabric.plugins.environments import LightningEnvironment

    monkeypatch.setenv("NODE_RANK", "1")
    launcher = rank_failures.ReportingLauncher(LightningEnvironment(), num_processes=3, num_nodes=2)
    launcher.reports = tmp_path
    launcher.procs = [_EndedRank(1001, -signal.SIGKILL), _EndedRank(1002, 1)]
    monkeypatch.setenv(rank_failures._REPORTS_ENV, str(tmp_path))
    monkeypatch.setenv(rank_failures._LAUNCHER_ENV, str(os.getppid()))
    rank_5 = SimpleNamespace(
        strategy=SimpleNamespace(launcher=None), global_rank=5, local_rank=2, world_size=6
    )
    assert handle_failure(ValueError("bad batch"), rank_5) is None  # its traceback is its own to print

    status = launcher.summarise(ValueError("no memory"))
    assert status == 1
    assert capsys.readouterr().err.splitlines() == [
        f"lightning-cp: rank 3 of 6 (pid {os.getpid()}) failed: ValueError: no memory",
        "lightning-cp: rank 4 of 6 (pid 1001) was killed by SIGKILL (also what the out-of-memory killer sends)",
        "lightning-cp: rank 5 of 6 (pid 1002) failed: ValueError: bad batch",
    ]
