"""The byte ranges of the known tensors, and the blocks they name."""

from __future__ import annotations

import torch

from lightning_cp.callbacks.memory import timeline
from lightning_cp.callbacks.memory.tensors import (
    BUFFERS,
    GRADIENTS,
    OPTIMIZER_STATE,
    PARAMETERS,
    known_tensors,
)
from tests.callbacks._fake_cuda import storage_span


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(3, 2)
        self.b = torch.nn.Linear(2, 1, bias=False)
        self.register_buffer("scale", torch.ones(5))
        self.far = torch.nn.Parameter(torch.empty(4, device="meta"))  # on another device


def test_known_tensors_are_the_parameters_gradients_buffers_and_optimizer_state():
    net = _Net()
    outside = torch.nn.Parameter(torch.zeros(3))
    flat = torch.zeros(8)  # one buffer for two gradients, as a gradient bucket does
    net.a.weight.grad = flat[:6].view(2, 3)
    net.a.bias.grad = flat[6:]
    strided = torch.zeros(2, 3)
    net.b.weight.grad = strided[:, 0].unsqueeze(0)  # elements 0 and 3 of ``strided``
    outside.grad = torch.ones(3)
    optimizer = torch.optim.AdamW([net.a.weight, net.a.bias, net.b.weight, outside])
    optimizer.step()

    known = known_tensors(net, [optimizer])

    cpu = torch.device("cpu")
    expected = {
        storage_span(net.a.weight): (PARAMETERS, "a.weight"),
        storage_span(net.a.bias): (PARAMETERS, "a.bias"),
        storage_span(net.b.weight): (PARAMETERS, "b.weight"),
        storage_span(flat[:6]): (GRADIENTS, "a.weight"),
        storage_span(flat[6:]): (GRADIENTS, "a.bias"),
        (strided.data_ptr(), strided.data_ptr() + 4 * 4): (GRADIENTS, "b.weight"),
        storage_span(net.scale): (BUFFERS, "scale"),
    }
    for param, name in [(net.a.weight, "a.weight"), (net.a.bias, "a.bias"), (net.b.weight, "b.weight")] + [
        (outside, "a (3,) parameter outside the module")
    ]:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            expected[storage_span(optimizer.state[param][key])] = (OPTIMIZER_STATE, f"{key} of {name}")
    assert known[cpu] == expected
    assert set(known) == {cpu, torch.device("meta")}
    assert list(known[torch.device("meta")].values()) == [(PARAMETERS, "far")]


def test_gradients_sharing_one_block_are_named_together():
    net = _Net()
    flat = torch.zeros(8)
    net.a.weight.grad = flat[:6].view(2, 3)
    net.a.bias.grad = flat[6:]
    block = {"address": flat.data_ptr(), "size": 32, "state": "active_allocated", "frames": []}
    snapshot = {
        "segments": [{"device": 0, "address": flat.data_ptr(), "total_size": 32, "blocks": [block]}],
        "device_traces": [[{"action": "alloc", "addr": 1, "size": 4, "frames": []}]],
    }
    known = known_tensors(net, [])[torch.device("cpu")]

    [held] = [a for a in timeline.analyze(snapshot, 0, known).allocations if a.addr == flat.data_ptr()]
    assert (held.category, held.tensors) == (GRADIENTS, ("a.weight", "a.bias"))


def _dtensor_ranges() -> bool:
    """On each rank of 2: a DTensor parameter (and gradient) counts as this rank's shard of it."""
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    net = torch.nn.Linear(4, 6, bias=False)
    net.weight = torch.nn.Parameter(distribute_tensor(torch.ones(6, 4), mesh, [Shard(0)]))
    net.weight.grad = distribute_tensor(torch.ones(6, 4), mesh, [Shard(0)])
    known = known_tensors(net, [])[torch.device("cpu")]
    return (
        known
        == {
            storage_span(net.weight.to_local()): (PARAMETERS, "weight"),
            storage_span(net.weight.grad.to_local()): (GRADIENTS, "weight"),
        }
        and storage_span(net.weight.to_local())[1] - storage_span(net.weight.to_local())[0] == 3 * 4 * 4
    )


def test_a_dtensor_counts_as_its_local_shard(world2):
    assert world2.run(_dtensor_ranges) == [True, True]
