"""``GroupExchange`` picks its collectives by the group's backend for the tensor's device."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_cp.parallel.exchange import GroupExchange


def _calls_of_a_reduce_scatter(monkeypatch, backend: str) -> list[str]:
    """The collectives ``reduce_scatter`` of a ``[4, 3]`` CPU tensor runs on a group of 2 whose backend is
    called ``backend`` (the collectives recorded, not run)."""
    calls = []
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(
        dist, "reduce_scatter_single", lambda out, full, group: calls.append("reduce_scatter")
    )
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, group: calls.append("all_reduce"))
    GroupExchange(group=object()).reduce_scatter(torch.zeros(4, 3))
    return calls


@pytest.mark.parametrize(
    ("backend", "expected"),
    [("gloo", "all_reduce"), ("cpu:nccl,cuda:gloo", "reduce_scatter"), ("cpu:gloo,cuda:nccl", "all_reduce")],
)
def test_the_gradient_exchange_reduce_scatters_where_the_tensors_backend_is_nccl(
    monkeypatch, backend, expected
):
    # cpu_offload's groups are "cpu:gloo,cuda:nccl": their CUDA tensors' backend is NCCL though the group's
    # name is not "nccl", which sent every K/V gradient through an all-reduce (twice the traffic). Here the
    # CPU tensors stand in for the device's, the group's name mapping them to one backend or the other.
    assert _calls_of_a_reduce_scatter(monkeypatch, backend) == [expected]
