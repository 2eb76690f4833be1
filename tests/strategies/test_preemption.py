"""SIGTERM recorded without a collective; ``tests/test_preemption.py`` runs the whole story through the
``lightning-cp`` command (exit status 143, ``last.ckpt``, resuming)."""

import os
import signal

import pytest
import torch
import torch.distributed as dist

from lightning_cp.strategies.preemption import SigtermAgreement


def test_sigterm_is_recorded_and_the_handler_before_lightning_s_still_runs(monkeypatch):
    # No collective in the handler (that is the hang); the user's own handler is chained.
    calls = []
    previous = signal.getsignal(signal.SIGTERM)
    agreement = SigtermAgreement()
    try:
        agreement.install(None, previous=lambda signum, frame: calls.append(signum))
        monkeypatch.setattr(
            dist, "all_reduce", lambda *args, **kwargs: pytest.fail("a collective in the handler")
        )
        os.kill(os.getpid(), signal.SIGTERM)
        assert calls == [signal.SIGTERM]
        monkeypatch.undo()
        assert agreement.agree(torch.device("cpu"))  # single process: no group, the local flag
    finally:
        signal.signal(signal.SIGTERM, previous)
