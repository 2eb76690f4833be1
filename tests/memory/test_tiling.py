"""Tiled MLPs and norms against the same modules run whole: outputs and gradients, GPT's and a Llama SwiGLU
MLP, ``transformers``' and ``torch``'s norms, whole models.

The reference is the untouched module (plain autograd over all tokens), in float64 so that any tile that
is dropped, doubled or misplaced shows far above rounding; in bf16 (a bf16 residual stream) and under
autocast against the same module's own bf16 autograd.
"""

import collections
import copy

import pytest
import torch
import torch.utils.checkpoint
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from lightning_cp.adaptation import applied
from lightning_cp.memory import (
    auto_tile_tokens,
    tile_experts,
    tile_mlps,
    tile_model,
    tile_norms,
    tile_projections,
    tiled_mlp,
)
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


def test_bf16_parameter_gradients_summed_over_32_tiles_are_as_close_as_untiled():
    """FSDP's gathered parameters are bf16: the tiles' parameter gradients are summed in fp32 and rounded
    once, so 32 tiles are about as close to the fp64 gradients as the untiled bf16 MLP (summed in bf16 they
    were 1.6x as far)."""
    torch.manual_seed(0)
    reference = _swiglu_mlp(dim=64, ffn=192)
    x, dout = torch.randn(2, 2048, 64, dtype=torch.float64)

    def grads(mlp, run):
        run(mlp, x.to(mlp.down_proj.weight.dtype)).backward(dout.to(mlp.down_proj.weight.dtype))
        return [p.grad.double() for p in mlp.parameters()]

    want = grads(reference, lambda m, t: m(t))

    def error(run):
        got = grads(copy.deepcopy(reference).bfloat16(), run)
        return max(float((g - w).norm() / w.norm()) for g, w in zip(got, want, strict=True))

    untiled = error(lambda m, t: m(t))
    assert error(lambda m, t: tiled_mlp(m, t, 2048 // 32)) < 1.15 * untiled


def test_auto_tiles_have_at_most_model_dim_tokens_whatever_the_length():
    assert auto_tile_tokens(131072, 4096) == 4096  # 32 tiles: a [4096, ffn] intermediate at 1M / cp 8
    assert auto_tile_tokens(10, 8) == 5  # 2 equal tiles rather than 8 + 2
    assert auto_tile_tokens(4097, 4096) == 2049
    assert auto_tile_tokens(8, 8) == 8 and auto_tile_tokens(1, 8) == 1


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
    _assert_same_loss_and_gradients(model, reference, lambda m: (m(tokens, positions) * weights).sum())


def _assert_same_loss_and_gradients(model, reference, loss_of):
    """``loss_of(model)`` and its parameters' gradients equal ``loss_of(reference)``'s (float64)."""
    losses = []
    for m in (model, reference):
        loss = loss_of(m)
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


def _norms():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    llama = LlamaRMSNorm(8)
    gemma = GemmaRMSNorm(8)
    for norm in (llama, gemma):
        norm.weight.data.normal_()
    return {"llama": llama, "gemma": gemma, "torch-rms": nn.RMSNorm(8), "torch-layer": nn.LayerNorm(8)}


@pytest.mark.parametrize("kind", ["llama", "gemma", "torch-rms", "torch-layer"])
@pytest.mark.parametrize("tile_tokens", [1, 4, None], ids=lambda t: f"tile{t}")
def test_a_tiled_norm_matches_the_whole_norm(kind, tile_tokens):
    norm = _norms()[kind].double()
    x = torch.randn(2, 13, 8, dtype=torch.float64) * 3
    want = _grads(copy.deepcopy(norm), x, lambda m, t: m(t))
    holder = nn.Sequential()
    holder.norm = norm
    assert tile_norms(holder, tile_tokens) == ["norm"]
    got = _grads(norm, x, lambda m, t: m(t))
    tolerance = 1e-6 if kind == "gemma" else 1e-12  # Gemma's norm computes `1 + weight.float()` in fp32
    for a, b in zip([got[0], got[1], *got[2]], [want[0], want[1], *want[2]], strict=True):
        torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance)


def test_a_tiled_bf16_norm_saves_its_input_only_and_matches_its_bf16_autograd():
    """A bf16 residual stream (FSDP's bf16 weights): transformers' RMSNorm saves an fp32 copy of the input,
    the reciprocal RMS and the bf16 normalized input; tiled, the bf16 input alone. Outputs equal bit for
    bit (the same row-wise ops); gradients within bf16 rounding of the weight's sum over tiles."""
    norm = _norms()["llama"].to(torch.bfloat16)
    reference = copy.deepcopy(norm)
    tile_norms(norm, tile_tokens=16)
    x = torch.randn(64, 8, dtype=torch.bfloat16, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    for module in (reference, norm):
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            module(x)
        if module is reference:
            assert sum(saved) - 16 >= 64 * 8 * (4 + 2)  # fp32 input copy and bf16 normalized (+ weight)
    assert sum(saved) == x.numel() * x.element_size()
    want, got = _grads(reference, x.detach(), lambda m, t: m(t)), _grads(norm, x.detach(), lambda m, t: m(t))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])  # output and dx: row-wise
    torch.testing.assert_close(got[2][0], want[2][0], rtol=2e-2, atol=2e-2)


def _qwen3(layers):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    sizes = {"vocab_size": 32, "hidden_size": 16, "intermediate_size": 40, "head_dim": 8}
    heads = {"num_attention_heads": 2, "num_key_value_heads": 1}
    return Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=layers, **sizes, **heads))


def test_tile_norms_finds_a_llama_s_and_a_qwen3_s_norms_and_leaves_gated_ones():
    class GatedRMSNorm(nn.RMSNorm):  # a second input, as Mamba's and Gated DeltaNet's gated norms take
        def forward(self, x, gate):
            return super().forward(x) * gate

    model = _qwen3(layers=1)
    model.gated = GatedRMSNorm(8)
    names = tile_norms(model)
    assert names == [
        "model.layers.0.self_attn.q_norm",
        "model.layers.0.self_attn.k_norm",
        "model.layers.0.input_layernorm",
        "model.layers.0.post_attention_layernorm",
        "model.norm",
    ]
    assert tile_mlps(model) == ["model.layers.0.mlp"]
    assert tile_norms(model) == names  # once only, and only the norms
    with pytest.raises(ValueError, match="no RMSNorm or LayerNorm"):
        tile_norms(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)))


def test_a_tiled_qwen3_and_gpt_give_the_same_loss_and_gradients():
    """Everything ``tile_model`` tiles (norms in tiles of 3 tokens, the rest automatic): the projections and
    MLPs recompute the norms' outputs they read, the per-head ``q_norm`` / ``k_norm`` too."""
    torch.manual_seed(0)
    qwen3 = _qwen3(layers=2).double()
    reference = copy.deepcopy(qwen3)
    tile_model(qwen3, tile_tokens=3)
    ids = torch.randint(0, 32, (2, 20))
    _assert_same_loss_and_gradients(qwen3, reference, lambda m: m(input_ids=ids, labels=ids).loss)
    gpt = GPT(GPTConfig(vocab_size=64, n_layer=2, n_head=2, n_embd=16)).double()
    reference = copy.deepcopy(gpt)
    tile_model(gpt, tile_tokens=3)
    positions = torch.arange(20).expand(2, 20)
    weights = torch.randn(2, 20, 16, dtype=torch.float64)
    _assert_same_loss_and_gradients(gpt, reference, lambda m: (m(ids, positions) * weights).sum())


def _saved_norm_outputs(model, run):
    """How many of the norms' outputs autograd saves while ``run()`` runs (storages counted once). The
    outputs are held until the count is made, so that no other tensor reuses their memory."""
    outputs, saved = [], set()
    hooks = [
        module.register_forward_hook(lambda m, args, out: outputs.append(out))
        for name, module in model.named_modules()
        if name.endswith("layernorm")
    ]

    def pack(tensor):
        saved.add(tensor.untyped_storage().data_ptr())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = run()
    for hook in hooks:
        hook.remove()
    del out
    return len({output.untyped_storage().data_ptr() for output in outputs} & saved)


def test_no_layer_keeps_a_tiled_norm_s_output():
    """A Llama-style layer's two norms: their outputs are read by the attention's projections and by the
    MLP. Tiled norms and MLPs: the MLP recomputes the second norm's output, the projections save the first's;
    with the projections of ``tile_model`` too, no norm output is saved at all."""
    torch.manual_seed(0)
    ids = torch.randint(0, 32, (1, 20))
    untiled, partly, whole = _qwen3(layers=2), _qwen3(layers=2), _qwen3(layers=2)
    tile_norms(partly)
    tile_mlps(partly)
    tile_model(whole)
    counts = [
        _saved_norm_outputs(m, lambda m=m: m.model(input_ids=ids).last_hidden_state)
        for m in (untiled, partly, whole)
    ]
    assert counts == [4, 2, 0]


def test_a_norm_output_changed_in_place_or_read_transposed_is_saved_as_it_is():
    """The tiled norm's output is doubled in place before the projections read it, one of them through a
    transposed view: its recipe is void and neither reads it as the norm's (which would recompute the
    undoubled output, or the rows of another token), so both save what they read; exact."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.first, self.second = nn.RMSNorm(8), nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            y = self.norm(x)
            z = self.norm(x)
            y.mul_(2)
            return self.first(y) * self.second(z.transpose(-1, -2))  # [7, 8 features, 8 tokens]

    torch.manual_seed(0)
    model = Block().double()
    with torch.no_grad():
        model.norm.weight.normal_()
    reference = copy.deepcopy(model)
    assert tile_norms(model, tile_tokens=3) + tile_projections(model, 3) == ["norm", "first", "second"]
    x = torch.randn(7, 8, 8, dtype=torch.float64)
    _assert_same_loss_and_gradients(model, reference, lambda m: (m(x) ** 2).sum())


def test_the_tiles_are_recomputed_under_the_forward_s_autocast():
    """DDP's bf16-mixed: the MLP runs in bf16 under autocast, and its backward (outside autocast, as
    Lightning runs it) recomputes the tiles in bf16 too: the input's gradient equals the untiled module's
    bf16 autograd row for row."""
    torch.manual_seed(0)
    mlp = _swiglu_mlp(dim=16, ffn=48).float()
    reference = copy.deepcopy(mlp)
    x = torch.randn(32, 16)

    def autocast(m, t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return tiled_mlp(m, t, 8) if m is mlp else m(t)

    got, want = _grads(mlp, x, autocast), _grads(reference, x, autocast)
    assert got[0].dtype == torch.bfloat16
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-6)


def test_tile_mlps_leaves_a_mixture_of_experts_whole():
    """Routing by capacity, or a router recording its logits per call, is not token-wise: only the dense
    MLP of a Qwen3-MoE with one dense layer is tiled."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=24,
        moe_intermediate_size=8,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        mlp_only_layers=[1],
    )
    model = Qwen3MoeForCausalLM(config)
    assert tile_mlps(model) == ["model.layers.1.mlp"]
    assert "tiling" not in applied(model.model.layers[0].mlp)


class _ListOfExperts(nn.Module):
    """A mixture of experts of the older interface: a list of expert modules (2-D weights only, no grouped
    3-D one) and a router that records its logits at every call, as for a load-balancing loss."""

    def __init__(self, dim=8, experts=4):
        super().__init__()
        self.gate = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(experts))
        self.router_logits = []

    def forward(self, x):
        logits = self.gate(x)
        self.router_logits.append(logits)
        chosen = logits.argmax(-1, keepdim=True)
        return sum(expert(x) * (chosen == i) for i, expert in enumerate(self.experts))


def test_tile_mlps_knows_a_mixture_of_experts_by_its_experts_module_whatever_its_weights_dims():
    """Experts without a 3-D weight are still experts: the mixture stays whole, so its router records one
    ``[tokens, experts]`` set of logits per call (tiled, it would record one per tile); the dense MLP beside
    it is tiled."""
    model = nn.ModuleDict(
        {"dense": nn.ModuleDict({"mlp": _gelu_mlp()}), "moe": nn.ModuleDict({"mlp": _ListOfExperts()})}
    )
    assert tile_mlps(model, tile_tokens=2) == ["dense.mlp"]
    moe = model["moe"]["mlp"]
    moe(torch.randn(6, 8, requires_grad=True)).sum().backward()
    assert [tuple(logits.shape) for logits in moe.router_logits] == [(6, 4)]


_MOE_FAMILIES = [
    "qwen3_moe",
    "qwen3_5_moe_text",
    "qwen3_next",
    "mixtral",
    "gpt_oss",
    "deepseek_v3",
    "glm4_moe",
]
_EVERY_LAYER_MOE = {"first_k_dense_replace": 0}
"""DeepSeek-V3's and GLM-4-MoE's first layers are dense by default (the tiny configs have two)."""


def _moe_model(model_type: str) -> nn.Module:
    """A tiny random MoE causal LM whose routers' weights are not zero (some initialize theirs to zeros,
    which routes every token alike), recording its router logits for the load-balancing loss."""
    from transformers import AutoModelForCausalLM

    from tests.hf._families import tiny_config

    extra = _EVERY_LAYER_MOE if model_type in ("deepseek_v3", "glm4_moe") else {}
    config = tiny_config(model_type, output_router_logits=True, router_aux_loss_coef=0.5, **extra)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.3)
    return model


@pytest.mark.parametrize("model_type", _MOE_FAMILIES)
def test_tiled_experts_give_the_untiled_loss_router_loss_and_gradients(model_type):
    """Tiles of 5 tokens over 12 (the last one shorter, holding a target): the routed experts (and shared
    ones) recomputed per tile, the router whole.
    transformers' own loss and load-balancing loss (the router logits of every token) and every gradient
    equal the untiled model's, the router's included."""
    torch.manual_seed(0)
    reference = _moe_model(model_type)
    model = copy.deepcopy(reference)
    tiled = tile_model(model, 5)  # the experts, and the norms' outputs they read recomputed
    assert any(name.endswith(".experts") for name in tiled)
    ids = torch.randint(0, reference.config.vocab_size, (1, 12))
    outputs = []
    for m in (reference, model):
        out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        outputs.append(out)
    assert reference.model.layers[0].mlp.experts.forward != model.model.layers[0].mlp.experts.forward
    torch.testing.assert_close(outputs[1].loss, outputs[0].loss, rtol=1e-6, atol=0)
    # (DeepSeek-V3 and GLM-4-MoE route without a load-balancing loss: their aux_loss is None.)
    torch.testing.assert_close(outputs[1].aux_loss, outputs[0].aux_loss, rtol=1e-6, atol=1e-6)
    router_grads = 0
    for (name, want), got in zip(reference.named_parameters(), model.parameters(), strict=True):
        if want.grad is None:
            assert got.grad is None, name
            continue
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-5, msg=name)
        router_grads += ("gate" in name or "router" in name) and bool(want.grad.abs().max() > 0)
    assert router_grads > 0  # the routing weights' gradient reaches the routers through the tiles


@pytest.mark.parametrize("model_type", ["qwen2_moe", "qwen3_next", "deepseek_v3"])
def test_the_shared_experts_are_tiled_under_either_name(model_type):
    """Qwen2-MoE's and Qwen3-Next's ``shared_expert`` (singular) and DeepSeek-V3's ``shared_experts``: tiled
    as MLPs beside the routed experts, so their calls save their input only, none of their ``[tokens, ffn]``
    intermediates."""
    torch.manual_seed(0)
    model = _moe_model(model_type)
    tiled = tile_model(model, 5)
    shared = {
        name: module
        for name, module in model.named_modules()
        if name.rsplit(".", 1)[-1] in ("shared_expert", "shared_experts")
    }
    assert len(shared) == model.config.num_hidden_layers and set(shared) <= set(tiled)
    inside, widths = [], []
    for module in shared.values():
        module.register_forward_pre_hook(lambda *args: inside.append(True))
        module.register_forward_hook(lambda *args: inside.pop())

    def pack(tensor):
        if inside:
            widths.append(tensor.shape[-1])
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(input_ids=torch.randint(0, model.config.vocab_size, (1, 12)))
    ffn = next(iter(shared.values())).gate_proj.out_features
    assert widths == [model.config.hidden_size] * len(shared), (ffn, widths)


def test_tile_experts_refuses_experts_it_cannot_route_and_a_dense_model():
    from transformers import AutoModelForCausalLM

    from tests.hf._families import tiny_config

    llama4 = AutoModelForCausalLM.from_config(tiny_config("llama4_text"))
    with pytest.raises(ValueError, match="feed_forward.experts .*Llama4TextExperts.*tiled=False"):
        tile_experts(llama4)
    with pytest.raises(ValueError, match="no mixture of experts"):
        tile_experts(_qwen3(layers=1))


def test_a_projection_reading_an_fp32_output_of_a_bf16_norm_input_gets_an_fp32_gradient():
    """A norm that returns fp32 from a bf16 input (as some ``transformers`` norms upcast): the projection
    saves the bf16 input, and the gradient it returns for the norm's output is fp32, as the output is."""

    class UpcastRMSNorm(nn.RMSNorm):
        def forward(self, x):
            return super().forward(x.float())

    torch.manual_seed(0)
    model = nn.Sequential(UpcastRMSNorm(16), nn.Linear(16, 16))
    reference = copy.deepcopy(model)
    tile_norms(model, tile_tokens=3)
    tile_projections(model, tile_tokens=3)
    x = torch.randn(10, 16).bfloat16()
    want, got = _grads(reference, x, lambda m, t: m(t)), _grads(model, x, lambda m, t: m(t))
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    for a, b in zip(got[2], want[2], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


class _WeightSizedOps(TorchDispatchMode):
    """Counts, by operator, the calls (views aside) whose output has one of ``shapes`` (the MLP's weights')."""

    def __init__(self, shapes):
        super().__init__()
        self.shapes, self.counts = set(shapes), collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view and isinstance(out, torch.Tensor) and tuple(out.shape) in self.shapes:
            self.counts[func.overloadpacket.__name__] += 1
        return out


def _down_proj_in_fp32(mlp, where):
    """``mlp`` whose ``down_proj`` runs in fp32 with autocast off, as modules that force fp32 do: turned off
    by the MLP around the ``nn.Linear`` (``"around"``), or inside the linear's own forward (``"inside"``)."""
    linear = mlp.down_proj

    def fp32(x):
        with torch.autocast("cpu", enabled=False):
            return nn.functional.linear(x.float(), linear.weight)

    def mlp_forward(x):
        hidden = mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)
        with torch.autocast("cpu", enabled=False):
            return linear(hidden.float())

    if where == "inside":
        linear.forward = fp32
    else:
        mlp.forward = mlp_forward
    return mlp


@pytest.mark.parametrize(
    "style", ["ddp-autocast", "ddp-autocast-fp32-inside", "ddp-autocast-fp32-around", "fsdp-bf16"]
)
def test_the_tiled_backward_touches_each_weight_once_per_tile(style):
    """A tile's parameter gradient is added to the fp32 sum in place: no per-tile copy of any weight-sized
    tensor (a widened gradient, or under DDP's autocast the weight cast again and its gradient widened
    again), which read and wrote every parameter once more per tile. Twice the tiles add, per weight, one
    gradient matmul and one add per extra tile, and no copy; the gradients are, bit for bit, the sum in fp32
    of plain autograd's per tile, also for a weight used with autocast off."""
    torch.manual_seed(0)
    mlp = _swiglu_mlp(dim=16, ffn=48)
    mlp = mlp.bfloat16() if style == "fsdp-bf16" else mlp.float()
    if "fp32" in style:
        mlp = _down_proj_in_fp32(mlp, style.rsplit("-", 1)[1])
    x = torch.randn(64, 16, dtype=mlp.down_proj.weight.dtype)
    dout = torch.randn(64, 16, dtype=x.dtype)
    shapes = {tuple(p.shape) for p in mlp.parameters()}

    def run(module, tile_tokens):
        module.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=style != "fsdp-bf16"):
            out = module(x) if tile_tokens is None else tiled_mlp(module, x, tile_tokens)
        with _WeightSizedOps(shapes) as ops:
            out.backward(dout.to(out.dtype))
        return ops.counts, [p.grad.clone() for p in module.parameters()]

    sixteen, grads = run(mlp, 4)
    eight, _ = run(mlp, 8)  # tiles of 4 and 8 tokens: no intermediate is weight-sized
    extra = {op: sixteen[op] - eight[op] for op in sixteen.keys() | eight.keys() if sixteen[op] != eight[op]}
    assert extra == {"mm": 8 * 3, "add_": 8 * 3}, (sixteen, eight)  # 8 more tiles, 3 weights
    # Plain autograd per tile of 4 tokens, each gradient widened to fp32 and summed there: the same numbers.
    want = [torch.zeros_like(p, dtype=torch.float32) for p in mlp.parameters()]
    for rows in range(0, 64, 4):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=style != "fsdp-bf16"):
            out = mlp(x[rows : rows + 4])
        tile = torch.autograd.grad(out, list(mlp.parameters()), dout[rows : rows + 4].to(out.dtype))
        for total, grad in zip(want, tile, strict=True):
            total += grad.float()
    for got, total, p in zip(grads, want, mlp.parameters(), strict=True):
        torch.testing.assert_close(got, total.to(p.dtype), rtol=0, atol=0)


class _Matmuls(TorchDispatchMode):
    """Counts the matrix products dispatched (``mm``, ``addmm``, ``bmm`` and their in-place forms)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket.__name__.rstrip("_") in ("mm", "addmm", "bmm", "baddbmm")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("style", ["fp64", "ddp-autocast"])
def test_a_tiled_projection_s_backward_recomputes_the_norm_not_the_projection(style):
    """A projection reading a tiled norm's output has nothing of its own output to recompute: per tile, the
    norm's output rows, then its input's gradient ``dout W`` and its weight's ``dout^T x``, two products (a third,
    its forward again, was wasted: half the backward's FLOPs again). The input's gradient is plain autograd's;
    under DDP's autocast the weight's and the bias's are the bf16 products summed in fp32 (against an fp32 sum of
    the same bf16 values: the untiled module's bf16 GEMM rounds its sum to bf16)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.RMSNorm(16), nn.Linear(16, 24))
    model = model.double() if style == "fp64" else model
    with torch.no_grad():
        model[0].weight.normal_()
    reference = copy.deepcopy(model)
    tile_norms(model, tile_tokens=4)
    tile_projections(model, tile_tokens=4)
    x = torch.randn(2, 12, 16, dtype=model[1].weight.dtype)  # 3 tiles of 4 tokens

    def run(m, t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=style != "fp64"):
            return m(t)

    want = _grads(reference, x, run)
    with _Matmuls() as counted:
        got = _grads(model, x, run)
    assert counted.count == 1 + 3 * 2  # the forward's, then two a tile
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    if style == "fp64":
        for a, b in zip(got[2], want[2], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        return
    x_bf16 = model[0](x).bfloat16().flatten(0, 1).float()
    dout = torch.arange(2 * 12 * 24, dtype=torch.bfloat16).sin().view(-1, 24).float()  # as _grads makes it
    torch.testing.assert_close(got[2][1], dout.t() @ x_bf16, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[2][2], dout.sum(0), rtol=1e-6, atol=1e-6)
    assert got[2][1].dtype == got[2][2].dtype == torch.float32
