"""Activation offload against checkpointing alone and against the plain model, on one process (CPU).

The references are the same model without offload (checkpointed: the losses and gradients must be equal bit
for bit, since offload only copies) and without checkpointing (plain autograd, float64). The bytes offloaded
are counted independently, from the inputs the checkpointed modules receive.
"""

import copy
import gc
import weakref

import pytest
import torch
from torch import nn
from torch.distributed._composable import checkpoint
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_cp import MegatronCPFSDPStrategy, MegatronCPStrategy
from lightning_cp.memory import ActivationOffload, offload_checkpointed
from lightning_cp.memory import offload as offload_module
from lightning_cp.models.gpt import GPT, GPTConfig

N_LAYER = 3


def _gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, n_layer=N_LAYER, n_head=2, n_embd=16)).double()


def _checkpointed(model, offload, min_bytes=0):
    model = copy.deepcopy(model)
    for block in model.blocks:
        checkpoint(block)
    return model, (offload_checkpointed(model, min_bytes=min_bytes) if offload else None)


def _step(model, tokens=None):
    if tokens is None:
        tokens = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    weights = torch.randn(*tokens.shape, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    loss = (model(tokens, positions) * weights).sum()
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


def _input_bytes(model):
    """Bytes of the distinct positional tensor inputs of the model's blocks in one forward, per block."""
    seen, per_block = (
        [],
        {},
    )  # the tensors themselves: a freed tensor's id() can be reused by the next block's

    def record(name):
        def hook(module, args):
            tensors = [a for a in args if isinstance(a, torch.Tensor) and all(a is not s for s in seen)]
            seen.extend(tensors)
            per_block[name] = per_block.get(name, 0) + sum(a.numel() * a.element_size() for a in tensors)

        return hook

    handles = [b.register_forward_pre_hook(record(f"blocks.{i}")) for i, b in enumerate(model.blocks)]
    with torch.no_grad():
        model(torch.zeros(2, 24, dtype=torch.long), torch.arange(24).expand(2, 24))
    for h in handles:
        h.remove()
    return per_block


def test_offload_gives_checkpointings_losses_and_gradients_bit_for_bit_and_the_plain_models():
    model = _gpt()
    plain = _step(copy.deepcopy(model))
    alone = _step(_checkpointed(model, offload=False)[0])
    offloaded_model, offload = _checkpointed(model, offload=True)
    offloaded = _step(offloaded_model)
    assert torch.equal(offloaded[0], alone[0])
    for a, b in zip(offloaded[1], alone[1], strict=True):
        assert torch.equal(a, b)
    torch.testing.assert_close(offloaded[0], plain[0], rtol=1e-12, atol=1e-12)
    for a, b in zip(offloaded[1], plain[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert offload.stats.offloaded_bytes > 0


def test_the_offloaded_bytes_are_the_checkpointed_inputs_and_nothing_else():
    model = _gpt()
    expected = _input_bytes(model)  # blocks.0: x, cos, sin; the others x (cos and sin are the same tensors)
    assert expected["blocks.0"] > expected["blocks.1"] == expected["blocks.2"] > 0
    offloaded_model, offload = _checkpointed(model, offload=True)
    _step(offloaded_model)
    assert dict(offload.stats.bytes_by_module) == expected
    assert offload.stats.offloaded_bytes == sum(expected.values())
    assert offload.stats.offloaded_tensors == 2 + N_LAYER and offload.stats.kept_bytes == 0
    assert offload.modules == [f"blocks.{i}" for i in range(N_LAYER)]


def test_offloading_the_first_layers_only_moves_their_inputs_with_the_same_gradients():
    """``layers=N`` (the plan's ``+offload:N`` where host memory binds): the first N blocks' inputs go to the
    host, the later ones' stay; the gradients are checkpointing's, bit for bit."""
    model = _gpt()
    expected = _input_bytes(model)
    alone = _step(_checkpointed(model, offload=False)[0])
    partial = copy.deepcopy(model)
    for block in partial.blocks:
        checkpoint(block)
    offload = offload_checkpointed(partial, min_bytes=0, layers=2)
    got = _step(partial)
    assert offload.modules == ["blocks.0", "blocks.1"]
    assert dict(offload.stats.bytes_by_module) == {name: expected[name] for name in offload.modules}
    assert torch.equal(got[0], alone[0])
    for a, b in zip(got[1], alone[1], strict=True):
        assert torch.equal(a, b)
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match=f"layers={bad!r}"):
            offload_checkpointed(partial, layers=bad)


def test_the_inputs_leave_the_device_between_forward_and_backward():
    """Without offload the checkpoint keeps every block's input alive; with it, only the host copies live."""
    for offload, alive in ((False, N_LAYER), (True, 0)):
        model, _ = _checkpointed(_gpt(), offload=offload)
        inputs = []
        for block in model.blocks:
            block.register_forward_pre_hook(
                lambda m, args, inputs=inputs: inputs.append(weakref.ref(args[0]))
            )
        tokens = torch.randint(0, 64, (2, 24))
        loss = model(tokens, torch.arange(24).expand_as(tokens)).sum()
        assert sum(ref() is not None for ref in inputs) == alive
        loss.backward()


def test_each_layers_inputs_are_brought_back_when_the_next_layers_backward_starts():
    offloaded_model, offload = _checkpointed(_gpt(), offload=True)
    order = []
    for i, block in enumerate(offloaded_model.blocks):
        block.register_full_backward_pre_hook(lambda m, g, i=i: order.append(("backward", i)))
    original = offload._fetch
    offload._fetch = lambda host_copy: (
        order.append(("fetch", host_copy.shape[-1])),
        original(host_copy),
    )
    _step(offloaded_model)
    # The last block's inputs (x, and cos / sin shared by all) on demand, every other x one block ahead.
    assert offload.stats.fetched_on_unpack_tensors == 3 and offload.stats.prefetched_tensors == N_LAYER - 1
    fetches = [i for i, event in enumerate(order) if event[0] == "fetch"]
    backward = {event[1]: i for i, event in enumerate(order) if event[0] == "backward"}
    # Every prefetch of layer i-1's input (width 16) happens before layer i's gradient reaches its inputs.
    x_fetches = [i for i in fetches if order[i][1] == 16]
    assert len(x_fetches) == N_LAYER
    for layer in range(1, N_LAYER):
        assert x_fetches[N_LAYER - layer] < backward[layer - 1]


def test_below_min_bytes_nothing_moves_and_training_is_the_same():
    model = _gpt()
    alone = _step(_checkpointed(model, offload=False)[0])
    offloaded_model, offload = _checkpointed(model, offload=True, min_bytes=10**9)
    kept = _step(offloaded_model)
    # Counted per save: every block keeps its x, cos and sin (blocks.0's distinct inputs).
    assert offload.stats.offloaded_bytes == 0
    assert offload.stats.kept_bytes == N_LAYER * _input_bytes(model)["blocks.0"]
    assert torch.equal(kept[0], alone[0])


def test_a_layer_called_twice_gives_the_plain_gradients():
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(8, 8), nn.Tanh()).double()
    reference = copy.deepcopy(layer)
    checkpoint(layer)
    offload = offload_checkpointed(layer, min_bytes=0)
    x = torch.randn(5, 8, dtype=torch.float64)
    for module in (layer, reference):
        module(module(x) * 2).sum().backward()
    for a, b in zip(layer.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)
    assert offload.stats.offloaded_tensors == 2


class _Gated(nn.Module):
    """``tanh(linear(h) * mask)``: the mask a second positional input, saved by each checkpointed call."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8).double()

    def forward(self, h, mask):
        return torch.tanh(self.linear(h) * mask)


def test_a_tensor_changed_in_place_after_a_save_is_offloaded_again_for_the_next_call():
    """A mask saved by one call, doubled in place, then saved by the next: the second call's backward reads
    the doubled mask (its own copy, not the first call's), as the plain layer does on copies of each."""
    torch.manual_seed(0)
    layer = _Gated()
    reference = copy.deepcopy(layer)
    checkpoint(layer)
    offload = offload_checkpointed(layer, min_bytes=0)
    h = torch.randn(5, 8, dtype=torch.float64)
    mask = torch.rand(5, 8, dtype=torch.float64)
    first = layer(h, mask)
    mask.mul_(2)
    layer(first, mask).sum().backward()
    reference(reference(h, mask / 2), mask.clone()).sum().backward()
    for a, b in zip(layer.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)
    assert offload.stats.offloaded_tensors == 4  # h, the mask twice, the first output


def test_a_brought_back_copy_is_freed_after_its_backward_use():
    """Every copy brought back to the device lives until its last call's backward has read it: none is
    alive once the backward is done, and no more than two layers' (this one's and the prefetched one's,
    with the RoPE tables every layer shares) at the start of any layer's backward."""
    model, offload = _checkpointed(_gpt(), offload=True)
    fetched, live = [], []
    original = offload._fetch

    def fetch(host_copy):
        original(host_copy)
        fetched.append(weakref.ref(host_copy.device_copy))

    offload._fetch = fetch
    for block in model.blocks:
        block.register_full_backward_pre_hook(
            lambda *args: live.append(sum(ref() is not None for ref in fetched))
        )
    _step(model)
    gc.collect()
    assert len(fetched) == 2 + N_LAYER  # x of every layer, cos and sin once
    assert sum(ref() is not None for ref in fetched) == 0
    assert max(live) <= 2 + 2


def test_parameters_stay_and_evaluation_moves_nothing():
    torch.manual_seed(0)
    layer = nn.Linear(4, 4)
    checkpoint(layer)
    offload = offload_checkpointed(layer, min_bytes=0)
    (layer(layer.weight) ** 2).sum().backward()  # the weight is the input: kept, not copied
    assert offload.stats.offloaded_bytes == 0 and offload.stats.kept_bytes == 64
    with torch.no_grad():
        layer(torch.randn(3, 4))
    assert offload.stats.offloaded_bytes == 0


def test_only_outermost_checkpointed_modules_are_attached_and_none_is_an_error():
    model = _gpt()
    for block in model.blocks:
        checkpoint(block)
        checkpoint(block.mlp)
    assert offload_checkpointed(model).modules == [f"blocks.{i}" for i in range(N_LAYER)]
    with pytest.raises(ValueError, match="no submodule of GPT is checkpointed"):
        offload_checkpointed(_gpt())
    with pytest.raises(ValueError, match="is not checkpointed"):
        ActivationOffload().attach("blocks.0", _gpt().blocks[0])
    with pytest.raises(ValueError, match="min_bytes=-1"):
        ActivationOffload(min_bytes=-1)


def test_an_hf_llama_offloads_its_hidden_states_with_the_same_loss_and_gradients():
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).double()
    ids = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(1))
    results = []
    for offload in (False, True):
        copied = copy.deepcopy(model)
        for layer in copied.model.layers:
            checkpoint(layer)
        handle = offload_checkpointed(copied, min_bytes=0) if offload else None
        copied(input_ids=ids, labels=ids).loss.backward()
        results.append([p.grad for p in copied.parameters()])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
    # One [2, 20, 16] float64 hidden state per layer: the RoPE tables are keywords, kept by the checkpoint.
    assert dict(handle.stats.bytes_by_module) == {f"model.layers.{i}": 2 * 20 * 16 * 8 for i in range(2)}


@pytest.mark.parametrize("strategy", [MegatronCPStrategy, MegatronCPFSDPStrategy])
def test_offload_without_checkpointing_fails_at_construction(strategy):
    with pytest.raises(ValueError, match=r"offload_activations=True\).*activation_checkpointing is not set"):
        strategy(cp=2, offload_activations=True)
    assert strategy(cp=2, activation_checkpointing=["_Block"], offload_activations=True).offload_activations
    for bad in (0, -1, 1.5, "2"):
        with pytest.raises(ValueError, match=f"offload_activations={bad!r}.*positive number"):
            strategy(cp=2, activation_checkpointing=["_Block"], offload_activations=bad)


def test_host_copies_in_pages_give_the_same_gradients(monkeypatch):
    """Every offloaded tensor is held in pages of ``HOST_PAGE_BYTES`` (the last one shorter; pinned pages of
    a power of two are not rounded up by PyTorch's host allocator): pages that cut through elements give
    checkpointing's gradients bit for bit."""
    monkeypatch.setattr(offload_module, "HOST_PAGE_BYTES", 100)  # 12.5 float64 elements
    model = _gpt()
    alone = _step(_checkpointed(model, offload=False)[0])
    offloaded_model, offload = _checkpointed(model, offload=True)
    made = []
    to_host = offload._to_host
    monkeypatch.setattr(offload, "_to_host", lambda tensor: made.append(to_host(tensor)) or made[-1])
    got = _step(offloaded_model)
    for a, b in zip([got[0], *got[1]], [alone[0], *alone[1]], strict=True):
        assert torch.equal(a, b)
    sizes = [[len(page) for page in copy.pages] for copy in made]
    # A block's input [2, 24, 16] float64: 6,144 bytes, in 61 pages of 100 and one of 44.
    assert [100] * 61 + [44] in sizes and all(max(s) <= 100 for s in sizes)
    assert sum(map(sum, sizes)) == offload.stats.offloaded_bytes


@pytest.mark.gpu
def test_cuda_offload_gives_the_same_gradients_and_pinned_host_copies():
    device = torch.device("cuda")
    model = _gpt().to(device)
    alone_model, _ = _checkpointed(model, offload=False)
    offloaded_model, offload = _checkpointed(model, offload=True)
    pages = []
    to_host = offload._to_host

    def recorded(tensor):
        copy = to_host(tensor)
        pages.extend(copy.pages)
        return copy

    offload._to_host = recorded
    tokens = torch.randint(0, 64, (2, 24), device=device)
    alone, offloaded = _step(alone_model, tokens), _step(offloaded_model, tokens)
    for a, b in zip([offloaded[0], *offloaded[1]], [alone[0], *alone[1]], strict=True):
        assert torch.equal(a, b)
    assert offload.stats.prefetched_tensors == N_LAYER - 1
    assert all(streams[0] != torch.cuda.current_stream() for streams in offload._streams.values())
    assert pages and all(page.is_pinned() for page in pages)
