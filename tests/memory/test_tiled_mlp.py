"""The tiled MLP against the same module run whole: outputs and gradients, GPT's and a Llama SwiGLU MLP.

The reference is the untouched module (plain autograd over all tokens), in float64 so that any tile that
is dropped, doubled or misplaced shows far above rounding.
"""

import copy

import pytest
import torch
import torch.utils.checkpoint
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from lightning_cp.memory import auto_tile_tokens, tile_mlps, tiled_mlp
from lightning_cp.models.gpt import GPT, GPTConfig


def _gelu_mlp(dim=8, ratio=4):
    return nn.Sequential(nn.Linear(dim, ratio * dim), nn.GELU(), nn.Linear(ratio * dim, dim)).double()


def _swiglu_mlp(dim=8, ffn=24):
    config = LlamaConfig(
        hidden_size=dim, intermediate_size=ffn, num_attention_heads=2, hidden_act="silu", mlp_bias=False
    )
    return LlamaMLP(config).double()


def _grads(module, x, run):
    x = x.clone().requires_grad_()
    out = run(module, x)
    out.backward(torch.arange(out.numel(), dtype=out.dtype).view_as(out).sin())
    return out.detach(), x.grad, [p.grad for p in module.parameters()]


@pytest.mark.parametrize("make", [_gelu_mlp, _swiglu_mlp], ids=["gelu", "swiglu"])
@pytest.mark.parametrize("tile_tokens", [1, 3, 5, 16, None], ids=lambda t: f"tile{t}")
def test_tiled_mlp_matches_the_whole_mlp(make, tile_tokens):
    torch.manual_seed(0)
    mlp = make()
    x = torch.randn(2, 13, 8, dtype=torch.float64)  # 13 tokens: the last tile is a short one
    want = _grads(copy.deepcopy(mlp), x, lambda m, t: m(t))
    got = _grads(mlp, x, lambda m, t: tiled_mlp(m, t, tile_tokens))
    for a, b in zip([got[0], got[1], *got[2]], [want[0], want[1], *want[2]], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_auto_tile_bounds_one_tiles_intermediate_by_the_input():
    assert auto_tile_tokens(16384, 2048, 8192) == 4096
    assert auto_tile_tokens(10, 8, 24) == 4  # 3 tiles of at most 4 tokens
    assert auto_tile_tokens(10, 8, 8) == 10 and auto_tile_tokens(1, 8, 10**6) == 1


def test_the_tiled_backward_saves_only_the_input():
    mlp = _gelu_mlp(dim=8, ratio=8)
    x = torch.randn(64, 8, dtype=torch.float64, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        tiled_mlp(mlp, x)
    assert sum(saved) == x.numel() * x.element_size()  # not the [64, 64] intermediates
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mlp(x)
    assert sum(saved) > 8 * x.numel() * x.element_size()


def test_tile_mlps_makes_a_gpt_tile_its_mlps_with_the_same_loss_and_gradients():
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=64, n_layer=2, n_head=2, n_embd=16)
    model = GPT(config).double()
    reference = copy.deepcopy(model)
    assert tile_mlps(model, tile_tokens=5) == ["blocks.0.mlp", "blocks.1.mlp"]
    assert model.state_dict().keys() == reference.state_dict().keys()
    tokens = torch.randint(0, 64, (2, 32))
    positions = torch.arange(32).expand(2, 32)
    weights = torch.randn(2, 32, 16, dtype=torch.float64)
    losses = []
    for m in (model, reference):
        loss = (m(tokens, positions) * weights).sum()
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-12, atol=1e-12)
    for (name, a), b in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_tile_mlps_refuses_a_model_without_mlps_and_an_mlp_that_returns_a_tuple():
    with pytest.raises(ValueError, match="no submodule named 'mlp'"):
        tile_mlps(nn.Linear(2, 2))

    class _Router(nn.Module):
        def forward(self, x):
            return x, x.sum(-1)

    holder = nn.Module()
    holder.mlp = _Router()
    tile_mlps(holder, tile_tokens=2)
    with pytest.raises(ValueError, match="mixture of experts"):
        holder.mlp(torch.randn(4, 3, requires_grad=True))


def test_a_tiled_mlp_inside_a_checkpointed_block_gives_the_same_gradients():
    torch.manual_seed(0)
    block = nn.Sequential()
    block.mlp = _swiglu_mlp()
    reference = copy.deepcopy(block)
    tile_mlps(block, tile_tokens=4)
    x = torch.randn(2, 13, 8, dtype=torch.float64)

    def checkpointed(m, t):
        return torch.utils.checkpoint.checkpoint(m, t, use_reentrant=False)

    got, want = _grads(block, x, checkpointed), _grads(reference, x, lambda m, t: m(t))
    for a, b in zip([got[0], got[1], *got[2]], [want[0], want[1], *want[2]], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
