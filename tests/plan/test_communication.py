"""The plan's CP communication against the bytes the exchanges send: one training step of rank 0 of a
simulated CP group, every collective counted at the ``GroupExchange`` seam as the ring algorithms send it
(an all-gather ``(cp - 1)`` local tensors, a reduce-scatter and an all-to-all ``(cp - 1) / cp`` of their
input), with and without checkpointing (a recomputed forward exchanges again)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from lightning_cp.parallel import simulated
from lightning_cp.parallel.attention_mode import AttentionMode
from lightning_cp.plan import Layout, estimate
from tests.plan.test_measured import _llama, _qwen3_5, _Step


class _SentBytes:
    """Bytes this rank sends to its peers through every simulated exchange while installed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, cp: int) -> None:
        self.total = 0
        exchange = simulated._SimulatedExchange
        shares = {"all_gather": cp - 1, "all_to_all": (cp - 1) / cp, "reduce_scatter": (cp - 1) / cp}
        for name, share in shares.items():
            monkeypatch.setattr(exchange, name, self._counting(getattr(exchange, name), share))

    def _counting(self, collective: Callable, share: float) -> Callable:
        def counted(exchange: object, tensor: torch.Tensor) -> torch.Tensor:
            self.total += round(share * tensor.numel() * tensor.element_size())
            return collective(exchange, tensor)

        return counted


def _ddp_all_reduce(step: _Step, cp: int) -> int:
    """What DDP's ring all-reduce of the fp32 gradients sends per rank: two passes of (cp - 1) / cp."""
    params = sum(p.numel() for p in step.model.parameters())
    return 2 * (cp - 1) * params * 4 // cp


@pytest.mark.parametrize(
    ("build", "cp", "attention", "checkpointing"),
    [(_llama, 4, "ulysses", False), (_llama, 4, "ulysses", True), (_qwen3_5, 2, "allgather", True)],
    ids=["llama-ulysses-replicated-kv", "llama-ulysses-replicated-kv-ckpt", "qwen3_5-hybrid-ckpt"],
)
def test_cp_communication_is_what_the_exchanges_send(
    monkeypatch: pytest.MonkeyPatch, build: Callable, cp: int, attention: str, checkpointing: bool
) -> None:
    """The tiny Llama's 2 key/value heads under Ulysses at cp 4 are sent to all 4 ranks (replicated), and
    the hybrid's Gated DeltaNet layers exchange once more when recomputed."""
    step = _Step(build, checkpointing, tiled=False, cp=cp, attention=AttentionMode(attention), tokens=512)
    with step.peers.recording():
        step()  # every rank's first exchanges recorded
    sent = _SentBytes(monkeypatch, cp)
    with step.peers.recording():
        step()
    layout = Layout(gpus=cp, cp=cp, checkpointing=checkpointing, attention=attention)
    planned = estimate(step.shape, step.tokens, layout, precision="32-true", device="cpu", flash=False)
    assert planned.communication - _ddp_all_reduce(step, cp) == sent.total
