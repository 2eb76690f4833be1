"""``load_balancing_loss`` over DP x CP against ``transformers``' own ``load_balancing_loss_func`` on the whole batch.

The reference is Mixtral's function (shared by every MoE family of transformers 5.23 but Doge) on the
unsharded router logits of all rows, with the attention mask that excludes the padding; values and the
gradient of every router logit are compared on each rank's own tokens.
"""

import pytest
import torch

from lightning_cp.hf import load_balancing_loss
from lightning_cp.parallel import groups, shard_batch
from lightning_cp.parallel.layout import set_current_layout

transformers = pytest.importorskip("transformers")
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

ROWS, SEQ, EXPERTS, TOP_K, LAYERS = 4, 11, 6, 2, 3


def _full():
    """Router logits ``[B, S, E]`` per layer, biased towards the last experts so that the top-k choices are
    uneven, and a padding mask with rows of very different lengths."""
    g = torch.Generator().manual_seed(0)
    bias = torch.linspace(0.0, 2.0, EXPERTS)
    logits = [3 * torch.randn(ROWS, SEQ, EXPERTS, generator=g) + bias for _ in range(LAYERS)]
    lengths = torch.tensor([11, 3, 8, 6])
    mask = torch.arange(SEQ)[None] < lengths[:, None]
    return logits, mask


def _reference():
    logits, mask = _full()
    leaves = [t.clone().requires_grad_() for t in logits]
    flat = tuple(t.reshape(-1, EXPERTS) for t in leaves)
    loss = load_balancing_loss_func(flat, EXPERTS, TOP_K, mask.long())
    loss.backward()
    return loss.detach(), [t.grad for t in leaves]


def _sharded(cp):
    """This rank's loss and the gradients of its own router logits (its rows' shard), plus the same
    entries of the reference gradient (sharded alike) to compare them with."""
    layout = groups.initialize(tp=1, cp=cp)
    set_current_layout(layout)
    logits, mask = _full()
    _, expected_grads = _reference()
    rows = slice(layout.dp_rank * ROWS // layout.dp, (layout.dp_rank + 1) * ROWS // layout.dp)
    batch = {"input_ids": torch.zeros(ROWS, SEQ, dtype=torch.long), "input_mask": mask}
    batch.update({f"logits{i}": t for i, t in enumerate(logits)})
    batch.update({f"grad{i}": t for i, t in enumerate(expected_grads)})
    shard = shard_batch({k: v[rows] for k, v in batch.items()}, cp, layout.cp_rank)
    leaves = [shard[f"logits{i}"].clone().requires_grad_() for i in range(LAYERS)]
    loss = load_balancing_loss(
        [t.reshape(-1, EXPERTS) for t in leaves], EXPERTS, TOP_K, shard["input_mask"], layout.loss_group
    )
    loss.backward()
    set_current_layout(None)
    return loss.detach(), [t.grad for t in leaves], [shard[f"grad{i}"] for i in range(LAYERS)]


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_the_load_balancing_loss_of_the_shards_is_the_whole_batch_s(world4, cp):
    expected, _ = _reference()
    assert expected.item() > 1.05 * TOP_K  # unbalanced: a loss that merely counted tokens would differ
    for loss, grads, expected_grads in world4.run(_sharded, cp):
        torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0.0)
        for got, want in zip(grads, expected_grads, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-9)


def test_router_logits_that_do_not_fit_the_tokens_are_refused():
    mask = torch.ones(2, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"expected \[10, 4\]"):
        load_balancing_loss([torch.zeros(10, 3)], 4, 2, mask, None)
    with pytest.raises(ValueError, match="output_router_logits=True"):
        load_balancing_loss([], 4, 2, mask, None)
