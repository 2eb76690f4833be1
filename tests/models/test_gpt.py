import pytest
import torch

from lightning_cp.models import GPT, GPTConfig
from lightning_cp.parallel import shard_batch

CONFIG = GPTConfig(vocab_size=50, n_layer=2, n_head=2, n_embd=16)


def test_packed_row_equals_each_sequence_on_its_own():
    """Document masking and position ids that restart per sequence: packing changes nothing."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    first, second = torch.randint(0, 50, (6,)), torch.randint(0, 50, (10,))
    packed = shard_batch(
        {"input_ids": torch.cat([first, second])[None], "cu_seqlens": torch.tensor([0, 6, 16])}, 1, 0
    )
    hidden = model(packed["input_ids"], packed["position_ids"], cp_shard=packed["cp_shard"])
    for tokens, start in ((first, 0), (second, 6)):
        alone = model(tokens[None], torch.arange(len(tokens))[None])
        torch.testing.assert_close(hidden[0, start : start + len(tokens)], alone[0], rtol=1e-5, atol=1e-5)


def test_rope_uses_position_ids():
    """RoPE is relative: shifting every position changes nothing, spreading them changes the output."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    ids = torch.randint(0, 50, (1, 8))
    base = model(ids, torch.arange(8)[None])
    torch.testing.assert_close(model(ids, torch.arange(8)[None] + 5), base, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(model(ids, (2 * torch.arange(8))[None]), base, atol=1e-4)


@pytest.mark.parametrize("tie", [True, False])
def test_lm_head_weight(tie):
    model = GPT(GPTConfig(vocab_size=50, n_layer=1, n_head=2, n_embd=16, tie_embeddings=tie))
    assert model.lm_head_weight.shape == (50, 16)
    assert (model.lm_head_weight is model.embed.weight) == tie


def test_config_rejects_odd_head_size():
    with pytest.raises(ValueError, match="even head size"):
        GPTConfig(n_embd=18, n_head=2)


def _saved_bytes_and_gradients(module, batch):
    """The hidden states, the bytes autograd saves in the forward and every parameter's gradient."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.nbytes) or t, lambda t: t):
        hidden = module(batch)
    (hidden * torch.linspace(-1, 1, hidden.numel(), dtype=hidden.dtype).view_as(hidden)).sum().backward()
    return hidden.detach(), sum(saved), [p.grad for p in module.parameters()]


def test_gpt_module_tiled_is_the_plan_s_tiled_layout_with_the_same_outputs_and_gradients():
    """``GPTModule(tiled=True)`` (``lightning-cp plan``'s ``+tiled``): 40 tokens in tiles of at most
    ``n_embd`` = 16 tokens; the hidden states and every gradient are the untiled module's, and the forward
    saves less."""
    from lightning_cp.models import GPTModule

    modules = []
    for tiled in (False, True):
        torch.manual_seed(0)
        modules.append(GPTModule(CONFIG, tiled=tiled).double())
    batch = {"input_ids": torch.randint(0, 50, (1, 40)), "position_ids": torch.arange(40)[None]}
    (hidden, saved, grads), (tiled_hidden, tiled_saved, tiled_grads) = (
        _saved_bytes_and_gradients(module, batch) for module in modules
    )
    torch.testing.assert_close(tiled_hidden, hidden, rtol=1e-12, atol=1e-12)
    for got, want in zip(tiled_grads, grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    # Each block's [40, 4 * 16] GELU input and output are no longer saved (and the norms' copies).
    assert saved - tiled_saved >= CONFIG.n_layer * 2 * 40 * 4 * 16 * 8
