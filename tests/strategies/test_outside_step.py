"""The model called outside the step under ``MegatronCPFSDPStrategy``: one root gather per outermost call, and a
call that not every rank makes ends with an error naming the rule instead of a hang.

The model is the package GPT (its embedding and final norm in the root unit, called nested inside its
forward), on the shared pool of 2 gloo ranks; the reference for a call's output is the same GPT built with
the gathered weights (``full_state_dict``) in one process.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Callback, seed_everything

from lightning_cp import MegatronCPFSDPStrategy
from lightning_cp.models import GPTModule
from lightning_cp.models.gpt import GPT
from lightning_cp.strategies._outside_step import OutsideCallAgreement
from tests._trainer import cp_trainer
from tests.cli.test_rank_failures import run_fit
from tests.strategies.test_megatron_cp import CONFIG, _dataset, _loader

_IDS = torch.randint(0, CONFIG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(7))
_POSITIONS = torch.arange(9).expand(2, 9)


class _CallsBetweenSteps(Callback):
    """After each step, on every rank: the whole weights, then two calls of the GPT outside the step, counting
    the root unit's gathers (``unshard`` of the FSDP root) they cause."""

    def __init__(self):
        self.weights, self.outputs, self.gathers = [], [], []

    def on_train_start(self, trainer, pl_module):
        root = trainer.strategy.model
        unshard = root.unshard

        def counted(*args, **kwargs):
            self.count += 1
            return unshard(*args, **kwargs)

        self.count = 0
        root.unshard = counted

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.weights.append(trainer.strategy.full_state_dict())
        before = self.count
        with torch.no_grad():
            self.outputs.append(pl_module.model(_IDS, _POSITIONS))
            pl_module.model(_IDS, _POSITIONS)
        self.gathers.append(self.count - before)


def _fit_calling_between_steps(cpu_offload):
    seed_everything(0)
    calls = _CallsBetweenSteps()
    strategy = MegatronCPFSDPStrategy(cp=2, cpu_offload=cpu_offload)
    trainer = cp_trainer(2, strategy=strategy, max_steps=2, callbacks=[calls])
    trainer.fit(GPTModule(CONFIG, lr=1e-2), _loader(2, False, _dataset()))
    after_fit = trainer.strategy.full_state_dict()  # the teardown destroyed the groups of the shards' mesh
    return {
        "weights": calls.weights,
        "after_fit": after_fit,
        "outputs": calls.outputs,
        "gathers": calls.gathers,
    }


@pytest.mark.parametrize("cpu_offload", [False, True], ids=["on-device", "cpu-offload"])
def test_each_outermost_call_gathers_the_root_once_and_equals_the_gathered_model(world2, cpu_offload):
    """The GPT's forward calls its embedding and its final norm (root-unit modules) inside it: counted as
    nested calls, one gather per call; uncounted, one gather each (two per call), with the same output. The
    same with the model state on the host (``cpu_offload``), whose shards the gather copies to the device."""
    per_rank = world2.run(_fit_calling_between_steps, cpu_offload)
    for rank in per_rank:
        assert rank["gathers"] == [2, 2]  # two calls per step
    # full_state_dict: the whole weights on rank 0 only, in host memory, also after fit (the last step's).
    assert per_rank[1]["weights"] == [{}, {}] and per_rank[1]["after_fit"] == {}
    final = per_rank[0]["after_fit"]
    assert final.keys() == per_rank[0]["weights"][-1].keys() == GPTModule(CONFIG).state_dict().keys()
    for name, tensor in final.items():
        assert type(tensor) is torch.Tensor and tensor.device.type == "cpu", name
        torch.testing.assert_close(tensor, per_rank[0]["weights"][-1][name], rtol=0, atol=0)
    for step, weights in enumerate(per_rank[0]["weights"]):
        reference = GPT(CONFIG)
        reference.load_state_dict({name.removeprefix("model."): value for name, value in weights.items()})
        with torch.no_grad():
            expected = reference(_IDS, _POSITIONS)
        for rank in per_rank:
            torch.testing.assert_close(rank["outputs"][step], expected, rtol=1e-5, atol=1e-5)


class _CallOnRankZeroOnly(Callback):
    """At the end of training, rank 0 alone calls the model (the mistake), and receives SIGTERM half a second
    into it; rank 1 stays a few seconds in the same hook (its run, and the agreement's group, still there)."""

    def on_train_end(self, trainer, pl_module):
        if trainer.global_rank != 0:
            time.sleep(3.0)
            return
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
        with torch.no_grad():
            pl_module.model(_IDS, _POSITIONS)


def _fit_calling_on_rank_zero_only():
    seed_everything(0)
    trainer = cp_trainer(
        2, strategy=MegatronCPFSDPStrategy(cp=2), max_steps=1, callbacks=[_CallOnRankZeroOnly()]
    )
    started = time.monotonic()
    try:
        trainer.fit(GPTModule(CONFIG), _loader(2, False, _dataset()))
    except RuntimeError as error:
        return str(error), time.monotonic() - started
    return None, time.monotonic() - started


def test_a_call_on_rank_zero_alone_ends_with_the_rule_on_sigterm(world2):
    (error, seconds), (other, _) = world2.run(_fit_calling_on_rank_zero_only)
    assert other is None
    assert error.startswith("rank 0 of 2 called the model outside the training step")
    assert "SIGTERM arrived while this rank waited" in error
    assert "every rank must make the same calls outside the step" in error
    assert "not under `if trainer.is_global_zero`" in error
    assert seconds < 60  # not the 120 s timeout


def _agree(calls: bool, timeout_s: float) -> tuple[str | None, float]:
    """Every rank: an agreement over the world; rank 0 calls it, rank 1 only if ``calls`` (else it keeps the
    group open longer than rank 0 waits)."""
    agreement = OutsideCallAgreement.over_world(stopping=lambda: False)
    agreement.timeout_s = timeout_s
    started = time.monotonic()
    try:
        if calls or dist.get_rank() == 0:
            agreement()
        else:
            time.sleep(timeout_s + 2.0)
    except RuntimeError as error:
        return str(error), time.monotonic() - started
    finally:
        agreement.close()
    return None, time.monotonic() - started


def test_every_rank_calling_agrees_at_once(world2):
    for error, seconds in world2.run(_agree, True, 60.0):
        assert error is None and seconds < 10


def test_a_rank_left_alone_stops_waiting_after_the_timeout(world2):
    (error, seconds), (other, _) = world2.run(_agree, False, 1.0)
    assert other is None
    assert "none came within 1 s" in error and "every rank must make the same calls" in error
    assert 1.0 <= seconds < 2.5


def test_a_call_on_rank_zero_alone_during_training_ends_the_whole_run(tmp_path):
    """``lightning-cp fit`` on 2 ranks, cp=2: after step 2 rank 0 alone calls the model while rank 1 goes on to
    step 3's all-gathers. Rank 0 refuses after the (shortened) wait and the run ends with its error. Before the
    change rank 0 then hung in its teardown (destroying the agreement's group, whose all-reduce rank 1 never
    joined) and rank 1 in its all-gather, past any timeout and SIGTERM: here the subprocess timeout."""
    callback = {
        "class_path": "tests.cli._failing_rank.CallOnOneRank",
        "init_args": {"rank": 0, "step": 2, "timeout_s": 2.0},
    }
    fsdp = [
        "--trainer.strategy",
        "lightning_cp.MegatronCPFSDPStrategy",
        "--trainer.strategy.init_args.cp",
        "2",
    ]
    started = time.monotonic()
    result = run_fit(tmp_path, 2, [callback], *fsdp, timeout=90)
    seconds = time.monotonic() - started
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    assert re.search(
        r"^lightning-cp: rank 0 of 2 \(pid \d+\) failed: RuntimeError: rank 0 of 2 called the model outside "
        r"the training step .* none came within 2 s",
        result.stderr,
        re.MULTILINE,
    ), output[-3000:]
    assert seconds < 75


class _OtherRankCallsAndEnds:
    """A store in which the other rank makes its call and ends its run (closing the agreement) right after this
    rank's first look at the count, before its look at the closed mark."""

    def __init__(self) -> None:
        self.values = {"arrived": 0, "closed": 0}
        self.looks = 0

    def add(self, key: str, amount: int) -> int:
        self.values[key] += amount
        value = self.values[key]
        if key == "arrived" and amount == 0:
            self.looks += 1
            if self.looks == 1:
                self.values["arrived"] += 1
                self.values["closed"] += 1
        return value


def test_a_rank_that_called_and_then_ended_its_run_counts():
    # The count used to be taken before the mark only: the call of a rank that ended right after it was missed.
    OutsideCallAgreement(_OtherRankCallsAndEnds(), world_size=2, stopping=lambda: False, timeout_s=5.0)()
