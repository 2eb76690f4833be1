"""SIGTERM agreed at step boundaries: recorded without a collective, agreed by every rank at the same check
point (one after the signal) without waiting for the peers at the check point itself.

``tests/test_preemption.py`` runs the whole story through the ``lightning-cp`` command (exit status 143,
``last.ckpt``, resuming); here the agreement alone, then one Trainer on the 2-rank pool.
"""

import os
import signal
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from lightning.pytorch import Callback, seed_everything
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_cp.models import GPTModule
from lightning_cp.strategies.preemption import SigtermAgreement
from tests.strategies.test_megatron_cp import CONFIG, _loader, _trainer

_PEER_WAIT_S = 20


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
        # Without a group too: the check point after the signal sends it, the next one stops.
        assert [agreement.agree() for _ in range(3)] == [False, True, True]
    finally:
        signal.signal(signal.SIGTERM, previous)


def _agree_at_check_points(signalled_rank, signal_before, check_points):
    """Every rank calls ``agree`` at each check point; one rank gets SIGTERM just before ``signal_before``."""
    previous = signal.getsignal(signal.SIGTERM)
    agreement = SigtermAgreement.over_world()
    group = agreement.group
    try:
        agreement.install(None)
        answers = []
        for point in range(check_points):
            if point == signal_before and dist.get_rank() == signalled_rank:
                os.kill(os.getpid(), signal.SIGTERM)
            answers.append(agreement.agree())
        backend, members = dist.get_backend(group), dist.get_world_size(group)
    finally:
        signal.signal(signal.SIGTERM, previous)
        agreement.close()
    return answers, backend, members, group in dist.distributed_c10d._world.pg_map


def test_every_rank_stops_at_the_same_check_point_the_one_after_the_signal(world4):
    for answers, backend, members, alive_after_close in world4.run(_agree_at_check_points, 2, 3, 6):
        assert answers == [False] * 4 + [True] * 2
        # Its own gloo group over the world (also on an NCCL world: CPU tensors only), destroyed by close().
        assert (backend, members, alive_after_close) == ("gloo", 4, False)


def _agree_before_the_peer_arrives(marker):
    """Rank 1 reaches its first check point only after rank 0 has returned from its own."""
    agreement = SigtermAgreement.over_world()
    try:
        if dist.get_rank() == 0:
            first = agreement.agree()
            Path(marker).touch()
        else:
            deadline = time.monotonic() + _PEER_WAIT_S
            while not os.path.exists(marker):
                if time.monotonic() > deadline:
                    raise TimeoutError("rank 0 waited for rank 1 in its check point (a blocking agreement)")
                time.sleep(0.01)
            first = agreement.agree()
        second = agreement.agree()  # waits for the first check point's all-reduce, which both have started
    finally:
        agreement.close()
    return first, second


def test_a_check_point_does_not_wait_for_the_peers(world2, tmp_path):
    # A blocking all-reduce at the check point (then .item() of a device tensor: a host sync per step)
    # would leave rank 0 waiting for rank 1, which waits for rank 0's marker: a TimeoutError on rank 1.
    assert (
        world2.run(_agree_before_the_peer_arrives, str(tmp_path / "rank0_returned")) == [(False, False)] * 2
    )


class _SigtermAfter(Callback):
    """Rank 1 sends itself SIGTERM after optimizer step ``step`` (after that step's check point)."""

    def __init__(self, step):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step and trainer.global_rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)


def _fit_until_sigterm(step):
    seed_everything(0)
    live_groups = len(dist.distributed_c10d._world.pg_map)
    trainer = _trainer(2, dist.get_world_size(), max_steps=20, callbacks=[_SigtermAfter(step)])
    try:
        trainer.fit(GPTModule(CONFIG), _loader(2, False))
    except SIGTERMException:
        return trainer.global_step, len(dist.distributed_c10d._world.pg_map) - live_groups
    return None


def test_sigterm_on_one_rank_stops_every_rank_after_the_same_step(world2):
    # Signal after step 2: check point 3 sends it, check point 4 agrees, every rank stops after step 4;
    # teardown leaves no group behind (the agreement's own included).
    assert world2.run(_fit_until_sigterm, 2) == [(4, 0), (4, 0)]


def _broadcasts_while_training(steps):
    """``torch.distributed.broadcast`` calls during a fit of ``steps`` steps (dp=1 x cp=2, no validation)."""
    seed_everything(0)
    calls = []
    broadcast = dist.broadcast

    def counted(*args, **kwargs):
        calls.append(kwargs.get("src"))
        return broadcast(*args, **kwargs)

    dist.broadcast = counted
    try:
        _trainer(2, dist.get_world_size(), max_steps=steps).fit(GPTModule(CONFIG), _loader(2, False))
    finally:
        dist.broadcast = broadcast
    return len(calls)


def test_no_sigterm_broadcast_before_every_batch(world2):
    # Lightning 2.6 broadcasts rank 0's SIGTERM flag on the device before every training batch and reads
    # it with .item() (a host sync per step); the agreement makes it redundant, and the strategy skips it.
    assert world2.run(_broadcasts_while_training, 3) == [0, 0]
