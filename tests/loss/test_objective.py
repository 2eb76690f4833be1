"""``GlobalTokenObjective``'s rescale where the gradients and the token counts live on different devices."""

from __future__ import annotations

import torch

from lightning_cp.loss.objective import GlobalTokenObjective
from lightning_cp.parallel import current_layout


class _DeviceScalar(torch.Tensor):
    """A stand-in for a count on the GPU: an operation that mixes it with a tensor of one or more dims that is
    not one of its own kind raises, as a CUDA tensor does with a host tensor (FSDP's ``cpu_offload`` keeps the
    gradients on the host)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        operands = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        if any(type(a) is torch.Tensor and a.dim() > 0 for a in operands):
            raise RuntimeError(
                "Expected all tensors to be on the same device, but found at least two devices"
            )
        return super().__torch_function__(func, types, args, kwargs)


def test_accumulated_gradients_on_the_host_are_rescaled_by_device_counts():
    objective = GlobalTokenObjective()
    layout = current_layout()  # one process: W = 1
    for count in (3.0, 9.0):  # two micro-batches of 3 and 9 targets: each was divided by N_1 = 3
        objective.training_loss(torch.tensor(1.0), torch.tensor(count).as_subclass(_DeviceScalar), layout)
    parameter = torch.nn.Parameter(torch.zeros(4))
    parameter.grad = torch.full((4,), 6.0)
    objective.rescale_gradients([parameter], accumulate=2)
    torch.testing.assert_close(parameter.grad, torch.full((4,), 6.0 * 2 * 3 / 12))
