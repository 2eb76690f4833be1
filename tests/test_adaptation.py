"""``lightning_cp.adaptation``: each kind of adaptation once per module, in the order of its stages."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_cp.adaptation import STAGES, add_hooks, applied, replace_forward


def test_a_forward_is_replaced_once_per_stage_and_recorded_in_order():
    linear = nn.Linear(2, 2)
    x = torch.ones(1, 2)
    assert replace_forward(linear, "tiling", lambda self, x: self.weight.sum() + x)
    assert not replace_forward(linear, "tiling", lambda self, x: -x)  # again: nothing changes
    calls = []
    assert add_hooks(linear, "offload", pre=lambda module, args: calls.append("pre"))
    assert not add_hooks(linear, "offload", pre=lambda module, args: calls.append("twice"))
    torch.testing.assert_close(linear(x), linear.weight.sum() + x)
    assert calls == ["pre"] and applied(linear) == ("tiling", "offload")
    assert applied(nn.Linear(2, 2)) == ()  # an instance attribute: other modules keep theirs


def test_a_stage_after_a_later_one_is_refused_and_an_unknown_one_named():
    linear = nn.Linear(2, 2)
    add_hooks(linear, "sharded_calls")
    with pytest.raises(ValueError, match="'tiling' adaptation would wrap the 'sharded_calls' one"):
        replace_forward(linear, "tiling", lambda self, x: x)
    with pytest.raises(ValueError, match="choose one of " + ", ".join(STAGES)):
        add_hooks(linear, "tilling")
    assert applied(linear) == ("sharded_calls",)


def test_a_post_hook_runs_when_the_forward_raises():
    module = nn.Identity()
    left = []
    replace_forward(module, "token_mixer", lambda self, x: 1 / 0)
    add_hooks(module, "offload", post=lambda module, args, output: left.append(True))
    with pytest.raises(ZeroDivisionError):
        module(torch.ones(1))
    assert left == [True]
