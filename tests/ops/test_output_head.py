"""``OutputHead``: the head of an ``nn.Linear``, its materialized logits and its checks."""

import pytest
import torch

from lightning_cp.ops import OutputHead


def test_from_linear_takes_the_bias_and_its_logits_apply_every_transform():
    torch.manual_seed(0)
    linear = torch.nn.Linear(8, 11)
    head = OutputHead.from_linear(linear, logit_scale=0.25, softcap=2.0)
    assert head.weight is linear.weight and head.bias is linear.bias and not head.is_plain
    hidden = torch.randn(3, 5, 8)
    expected = 2.0 * torch.tanh(0.25 * linear(hidden) / 2.0)
    torch.testing.assert_close(head.logits(hidden), expected)
    assert head.describe() == "bias, logit_scale=0.25, softcap=2"
    no_bias = OutputHead.from_linear(torch.nn.Linear(8, 11, bias=False))
    assert no_bias.bias is None and no_bias.is_plain and no_bias.describe() == "none"


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"weight": torch.zeros(4)}, TypeError, r"2-D float tensor \[V, H\]"),
        ({"weight": torch.zeros(4, 3), "bias": torch.zeros(3)}, ValueError, r"\[V\] = \[4\]"),
        ({"weight": torch.zeros(4, 3), "logit_scale": 0.0}, ValueError, "logit_scale must be a positive"),
        ({"weight": torch.zeros(4, 3), "softcap": float("inf")}, ValueError, "softcap must be a positive"),
    ],
)
def test_a_head_that_cannot_be_applied_is_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        OutputHead(**kwargs)


def test_from_linear_refuses_other_modules():
    with pytest.raises(TypeError, match="takes a torch.nn.Linear, got Embedding"):
        OutputHead.from_linear(torch.nn.Embedding(4, 3))
