"""The memory plan against measurement: tiny GPT and Llama training steps on the CPU, fp32 (and the
Llama's saved activations in bf16, FSDP's residual stream).

Parameters, gradients and AdamW state are counted exactly from the tensors after a real optimizer step;
saved activations through ``saved_tensors_hooks``; the step's peak through a dispatch mode that tracks
live storages (``_measure.PeakTracker``); with and without checkpointing, tiles and activation offload, at
cp = 1 and as rank 0 of a simulated CP group of 2 (``SimulatedCPGroup``: the other rank's K/V are zeros,
which changes no byte).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import pytest
import torch
from torch import nn

from lightning_cp.hf.mixers import adapt_token_mixers
from lightning_cp.memory import offload_checkpointed, tile_model
from lightning_cp.models.gpt import GPT, GPTConfig
from lightning_cp.ops import linear_cross_entropy
from lightning_cp.parallel import _varlen, context_parallel_attention
from lightning_cp.parallel.attention_mode import AttentionMode
from lightning_cp.parallel.sharding import shard_batch
from lightning_cp.parallel.simulated import SimulatedCPGroup
from lightning_cp.plan import Layout, ModelShape, estimate
from lightning_cp.strategies._modules import apply_checkpointing
from tests.plan._measure import PeakTracker, hf_model, llama, saved_bytes

TOKENS = 4096
VOCAB = 512
TOLERANCE = 0.10


def _gpt() -> tuple[nn.Module, ModelShape, type[nn.Module]]:
    config = GPTConfig(vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=128, mlp_ratio=4, tie_embeddings=False)
    model = GPT(config)
    return model, ModelShape.from_gpt_config(config), type(model.blocks[0])


def _llama() -> tuple[nn.Module, ModelShape, type[nn.Module]]:
    model, shape = llama(vocab=VOCAB, hidden=128, ffn=352, layers=2, heads=4, kv_heads=2)
    return model, shape, type(model.model.layers[0])


_QWEN3_SIZES = {
    "vocab_size": VOCAB,
    "hidden_size": 128,
    "intermediate_size": 352,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
}
"""The tiny Qwen3.5's and Qwen3-MoE's common sizes (the tiny Llama's)."""


def _qwen3_5() -> tuple[nn.Module, ModelShape, type[nn.Module]]:
    """A hybrid: Gated DeltaNet layers (transformers' torch kernels) beside an attention layer."""
    model, shape = hf_model(
        model_type="qwen3_5_text",
        **_QWEN3_SIZES,
        num_hidden_layers=4,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
    )
    return model, shape, type(model.model.layers[0])


def _qwen3_moe() -> tuple[nn.Module, ModelShape, type[nn.Module]]:
    """A mixture of experts: top 2 of 4 experts per token."""
    model, shape = hf_model(
        model_type="qwen3_moe",
        **_QWEN3_SIZES,
        moe_intermediate_size=176,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
    )
    return model, shape, type(model.model.layers[0])


class _Step:
    """One model's forward on CP rank 0's shard of one sequence, the fused loss, backward and AdamW."""

    def __init__(
        self,
        build: Callable,
        checkpointing: bool,
        tiled: bool,
        cp: int = 1,
        attention: AttentionMode | None = None,
        tokens: int = TOKENS,
    ) -> None:
        torch.manual_seed(0)
        self.model, self.shape, layer = build()
        adapt_token_mixers(self.model, cp)  # a hybrid's mixers, as the strategy's setup (none in the others)
        if tiled:  # as HFCausalLM(tiled=True)
            tile_model(self.model)
        if checkpointing:
            apply_checkpointing(self.model, [layer])
        self.tokens = tokens // cp  # the blocked kernel of CP ranks is slow on the CPU
        # Rank 0 of cp simulated ranks (no process group): every exchange records, peers' tokens are zeros.
        self.peers = SimulatedCPGroup(cp)
        ids = {"input_ids": torch.randint(0, VOCAB, (1, self.tokens))}
        self.batch = shard_batch(ids, cp, 0, cp_group=self.peers.exchange(0), attention=attention)
        self.optimizer = torch.optim.AdamW(self.model.parameters())

    def hidden(self) -> torch.Tensor:
        ids, pos, shard = self.batch["input_ids"], self.batch["position_ids"], self.batch["cp_shard"]
        if isinstance(self.model, GPT):
            return self.model(ids, pos, cp_shard=shard)
        return self.model.model(
            input_ids=ids, position_ids=pos, cp_shard=shard, use_cache=False
        ).last_hidden_state

    def head(self) -> torch.Tensor:
        return self.model.lm_head_weight if isinstance(self.model, GPT) else self.model.lm_head.weight

    def __call__(self) -> None:
        loss = linear_cross_entropy(self.hidden().flatten(0, 1), self.head(), self.batch["labels"].flatten())
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()


def _bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize(
    "build", [_gpt, _llama, _qwen3_5, _qwen3_moe], ids=["gpt", "llama", "qwen3_5-hybrid", "qwen3_moe"]
)
def test_static_bytes_exact(build: Callable) -> None:
    step = _Step(build, checkpointing=False, tiled=False)
    loss = linear_cross_entropy(step.hidden().flatten(0, 1), step.head(), step.batch["labels"].flatten())
    loss.backward()
    step.optimizer.step()
    planned = estimate(
        step.shape, TOKENS, Layout(gpus=1, cp=1), precision="32-true", device="cpu", flash=False
    )
    params = list(step.model.parameters())
    states = [t for state in step.optimizer.state.values() for t in state.values() if t.dim() > 0]
    assert planned.parameters == _bytes(params)
    assert planned.gradients == _bytes(p.grad for p in params)
    assert planned.optimizer == _bytes(states)


@pytest.mark.parametrize(
    "build", [_gpt, _llama, _qwen3_5, _qwen3_moe], ids=["gpt", "llama", "qwen3_5-hybrid", "qwen3_moe"]
)
@pytest.mark.parametrize("cp", [1, 2], ids=["cp1", "cp2"])
@pytest.mark.parametrize(
    ("checkpointing", "tiled"),
    [(False, False), (True, False), (False, True), (True, True)],
    ids=["plain", "ckpt", "tiled", "ckpt+tiled"],
)
def test_activations_and_peak_within_10_percent(
    build: Callable, cp: int, checkpointing: bool, tiled: bool
) -> None:
    step = _Step(build, checkpointing, tiled, cp)
    with step.peers.recording():
        step()  # AdamW's state exists from here on, as in every later step
    layout = Layout(gpus=cp, cp=cp, checkpointing=checkpointing, tiled=tiled)
    planned = estimate(step.shape, step.tokens, layout, precision="32-true", device="cpu", flash=False)

    with step.peers.recording():
        saved = saved_bytes(step.model, step.hidden)
        tracker = PeakTracker()
        with tracker:
            step()
    # The tracker sees what the step allocates: gradients, activations and transients (parameters and
    # AdamW's state were allocated before). The simulated rank has no DDP wrapper, so no bucket copy.
    buckets = planned.gradients - planned.parameters
    planned_step = planned.counted - planned.parameters - planned.optimizer - buckets
    assert abs(planned.activations - saved) <= TOLERANCE * saved, (planned.activations, saved)
    assert abs(planned_step - tracker.peak) <= TOLERANCE * tracker.peak, (planned_step, tracker.peak)


@pytest.mark.parametrize("cp", [1, 2], ids=["cp1", "cp2"])
@pytest.mark.parametrize(
    ("checkpointing", "tiled"),
    [(False, False), (True, False), (False, True), (True, True)],
    ids=["plain", "ckpt", "tiled", "ckpt+tiled"],
)
def test_a_bf16_residual_stream_s_activations_within_10_percent(
    cp: int, checkpointing: bool, tiled: bool
) -> None:
    """The tiny Llama in bf16, as FSDP's ``bf16-mixed`` computes it (its weights gathered in bf16, so the
    embedding and every hidden state are bf16): ``transformers``' RMSNorms keep fp32 copies of their bf16
    inputs, tiled norms only the bf16 inputs, checkpointing the bf16 layer inputs."""
    step = _Step(_llama, checkpointing, tiled, cp)
    step.model.to(torch.bfloat16)
    with step.peers.recording():
        saved = saved_bytes(step.model, step.hidden)
    layout = Layout(gpus=cp, cp=cp, fsdp=True, checkpointing=checkpointing, tiled=tiled)
    planned = estimate(step.shape, step.tokens, layout, precision="bf16-mixed", device="cpu", flash=False)
    assert abs(planned.activations - saved) <= TOLERANCE * saved, (planned.activations, saved)


@pytest.mark.parametrize(
    ("attention", "per_gather"), [("ulysses", None), ("allgather", 1)], ids=["ulysses", "kv-by-head"]
)
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "ckpt"])
def test_each_cp_attention_s_step_within_10_percent(
    attention: str, per_gather: int | None, checkpointing: bool
) -> None:
    """The tiny Llama (4 query heads, 2 key/value heads) as rank 0 of 2, with Ulysses' attention or the
    all-gather one key/value head per round."""
    mode = AttentionMode(attention, per_gather)
    step = _Step(_llama, checkpointing, tiled=False, cp=2, attention=mode)
    with step.peers.recording():
        step()
    layout = Layout(
        gpus=2, cp=2, checkpointing=checkpointing, attention=attention, kv_heads_per_gather=per_gather
    )
    planned = estimate(step.shape, step.tokens, layout, precision="32-true", device="cpu", flash=False)
    with step.peers.recording():
        saved = saved_bytes(step.model, step.hidden)
        tracker = PeakTracker()
        with tracker:
            step()
    buckets = planned.gradients - planned.parameters
    planned_step = planned.counted - planned.parameters - planned.optimizer - buckets
    assert abs(planned.activations - saved) <= TOLERANCE * saved, (planned.activations, saved)
    assert abs(planned_step - tracker.peak) <= TOLERANCE * tracker.peak, (planned_step, tracker.peak)


def test_ulysses_replicated_key_value_heads_are_saved_as_planned() -> None:
    """The tiny Llama's 2 key/value heads as rank 0 of cp = 4: Ulysses' rank holds one query head and one
    key/value head (replicated on two ranks) of every token. What its forward saves beyond the all-gather's
    (those K and V, the output brought back) is the plan's difference, within 2%."""
    saved, planned = {}, {}
    for attention in ("allgather", "ulysses"):
        step = _Step(_llama, checkpointing=False, tiled=False, cp=4, attention=AttentionMode(attention))
        with step.peers.recording():
            saved[attention] = saved_bytes(step.model, step.hidden)
        layout = Layout(gpus=4, cp=4, attention=attention)
        estimated = estimate(step.shape, step.tokens, layout, precision="32-true", device="cpu", flash=False)
        planned[attention] = estimated.activations
    assert step.shape.kv_heads < 4
    measured = saved["ulysses"] - saved["allgather"]
    expected = planned["ulysses"] - planned["allgather"]
    assert abs(expected - measured) <= 0.02 * measured, (expected, measured)


def test_the_attention_s_peak_falls_with_the_key_value_heads_per_gather_as_planned(monkeypatch) -> None:
    """One attention layer (8 query and 8 key/value heads) as rank 0 of 2: gathering one key/value head per
    round instead of all 8 at once lowers the peak by the plan's ``3 kv (1 - 1/8)``, within 10%. The blocked
    kernel's score blocks are kept small (1 MiB) so that the sequence-sized K/V copies dominate."""
    monkeypatch.setattr(_varlen, "SCORE_BLOCK_BYTES", 2**20)
    heads, dim, tokens, cp = 8, 32, 4096, 2
    shape = ModelShape(
        hidden=heads * dim,
        layers=1,
        heads=heads,
        kv_heads=heads,
        head_dim=dim,
        ffn=1,
        vocab=1,
        tied=False,
        params=1,
        architecture="hf",
    )
    peaks, planned = {}, {}
    for per_gather in (heads, 1):
        peers = SimulatedCPGroup(cp)
        mode = AttentionMode("allgather", per_gather)
        batch = {"input_ids": torch.zeros(1, tokens, dtype=torch.long)}
        shard = shard_batch(batch, cp, 0, cp_group=peers.exchange(0), attention=mode)["cp_shard"]
        local = shard.local_tokens
        q, k, v = (torch.randn(1, heads, local, dim, requires_grad=True) for _ in range(3))
        dout = torch.randn(1, heads, local, dim)
        with peers.recording():
            context_parallel_attention(q, k, v, cp_shard=shard).backward(dout)  # the recordings
            q.grad = k.grad = v.grad = None
            tracker = PeakTracker()
            with tracker:
                context_parallel_attention(q, k, v, cp_shard=shard).backward(dout)
        peaks[per_gather] = tracker.peak
        layout = Layout(gpus=cp, cp=cp, kv_heads_per_gather=per_gather)
        planned[per_gather] = estimate(
            shape, tokens, layout, precision="32-true", device="cpu", flash=False
        ).attention
    measured_drop, planned_drop = peaks[heads] - peaks[1], planned[heads] - planned[1]
    assert abs(measured_drop - planned_drop) <= TOLERANCE * planned_drop, (measured_drop, planned_drop)


def test_offload_raises_the_peak_by_the_two_layer_inputs_a_recomputed_layer_brings_back() -> None:
    """The tiny Llama, checkpointed, with and without offload (fp32, cp 1, 2,048 tokens: a layer's
    recomputation is the step's largest transient). On the CPU the offload's host copies are real copies in
    the same memory, so the layer inputs moved from ``activations`` to ``host`` cancel, and the peak rises by
    what a recomputed layer holds besides: its own input brought back (without offload its first norm saves
    the checkpoint's saved input itself, in an fp32 stream) and the previous layer's, which
    ``memory/offload.py`` prefetches when this layer's recomputation starts. Measured: two layer inputs; the
    plan's rise within 2% of it, and the offloaded step's peak within 10% of the plan."""
    tokens, peaks, planned = 2048, {}, {}
    for offload in (False, True):
        step = _Step(_llama, checkpointing=True, tiled=False, tokens=tokens)
        if offload:
            offload_checkpointed(step.model)
        with step.peers.recording():
            step()  # AdamW's state exists from here on
            tracker = PeakTracker()
            with tracker:
                step()
        peaks[offload] = tracker.peak
        layout = Layout(gpus=1, cp=1, checkpointing=True, offload=offload)
        e = estimate(step.shape, tokens, layout, precision="32-true", device="cpu", flash=False)
        # As in the other steps: the tracker sees no parameters, AdamW state nor DDP buckets; here the host too.
        planned[offload] = e.counted - e.parameters - e.optimizer - (e.gradients - e.parameters) + e.host
    layer_input = tokens * step.shape.hidden * 4
    measured = peaks[True] - peaks[False]
    assert abs(measured - 2 * layer_input) <= 0.02 * layer_input, (measured, layer_input)
    rise = planned[True] - planned[False]
    assert abs(rise - measured) <= 0.02 * measured, (rise, measured)
    assert abs(planned[True] - peaks[True]) <= TOLERANCE * peaks[True], (planned[True], peaks[True])


def _llama_lora() -> tuple[nn.Module, ModelShape, type[nn.Module]]:
    """The tiny Llama with ``peft``'s LoRA of rank 8 on every linear layer (built by ``peft`` directly): the
    base frozen, the head too."""
    peft = pytest.importorskip("peft")
    model, shape, layer = _llama()
    config = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear")
    peft.get_peft_model(model, config)  # in place: the linears wrapped, the base frozen
    return model, shape, layer


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "ckpt"])
@pytest.mark.parametrize("cp", [1, 2], ids=["cp1", "cp2"])
def test_a_lora_step_within_10_percent(cp: int, checkpointing: bool) -> None:
    """The tiny Llama with LoRA (fp32): the adapters' weights, gradients and AdamW state exactly, the frozen
    base's weights exactly, and the step's saved activations and peak (no base gradient, no head gradient in
    the fused loss, every linear's ``[tokens, 8]`` down-projection saved) within 10% of the plan."""
    from lightning_cp.plan.lora import LoRA

    step = _Step(_llama_lora, checkpointing, tiled=False, cp=cp)
    with step.peers.recording():
        step()
    layout = Layout(gpus=cp, cp=cp, checkpointing=checkpointing)
    planned = estimate(
        step.shape, step.tokens, layout, precision="32-true", device="cpu", flash=False, lora=LoRA(8)
    )
    trained = [p for p in step.model.parameters() if p.requires_grad]
    states = [t for state in step.optimizer.state.values() for t in state.values() if t.dim() > 0]
    assert planned.parameters == _bytes(step.model.parameters())
    assert planned.optimizer == _bytes(states) == 2 * _bytes(trained)
    with step.peers.recording():
        saved = saved_bytes(step.model, step.hidden)
        tracker = PeakTracker()
        with tracker:
            step()
    assert all(p.grad is None for p in step.model.parameters() if not p.requires_grad)
    buckets = planned.gradients - _bytes(trained)
    planned_step = planned.counted - planned.parameters - planned.optimizer - buckets
    assert abs(planned.activations - saved) <= TOLERANCE * saved, (planned.activations, saved)
    assert abs(planned_step - tracker.peak) <= TOLERANCE * tracker.peak, (planned_step, tracker.peak)


def test_an_mla_layer_s_peak_falls_with_the_heads_expanded_per_round_as_planned(monkeypatch) -> None:
    """One MLA layer (8 heads, keys of 24 + 8, values of 32, a latent of 32) as rank 0 of 2, its latent
    all-gathered (``latent_attention``): expanding one head per round instead of all 8 at once lowers the peak by
    the plan's ``3 (D + Dv) (1 - 1/8)`` per gathered token, within 10%; the latent's own buffers do not change."""
    from lightning_cp.parallel.latent_attention import latent_attention

    monkeypatch.setattr(_varlen, "SCORE_BLOCK_BYTES", 2**20)
    heads, nope, rope, value, rank, tokens, cp = 8, 24, 8, 32, 32, 4096, 2
    shape = ModelShape(
        hidden=heads * value,
        layers=1,
        heads=heads,
        kv_heads=heads,
        head_dim=nope + rope,
        ffn=1,
        vocab=1,
        tied=False,
        params=1,
        architecture="hf",
        value_head_dim=value,
        latent_dim=rank + rope,
    )
    peaks, planned = {}, {}
    for per_gather in (heads, 1):
        peers = SimulatedCPGroup(cp)
        mode = AttentionMode("allgather", per_gather)
        batch = {"input_ids": torch.zeros(1, tokens, dtype=torch.long)}
        shard = shard_batch(batch, cp, 0, cp_group=peers.exchange(0), attention=mode)["cp_shard"]
        local = shard.local_tokens
        q = torch.randn(1, heads, local, nope + rope, requires_grad=True)
        latent = torch.randn(1, 1, local, rank, requires_grad=True)
        k_rot = torch.randn(1, 1, local, rope, requires_grad=True)
        weight = torch.randn(heads * (nope + value), rank, requires_grad=True)
        dout = torch.randn(1, heads, local, value)

        def step(q=q, latent=latent, k_rot=k_rot, weight=weight, shard=shard, dout=dout) -> None:
            latent_attention(q, latent, k_rot, weight, cp_shard=shard, value_dim=value).backward(dout)

        with peers.recording():
            step()  # the recordings
            q.grad = latent.grad = k_rot.grad = weight.grad = None
            tracker = PeakTracker()
            with tracker:
                step()
        peaks[per_gather] = tracker.peak
        layout = Layout(gpus=cp, cp=cp, kv_heads_per_gather=per_gather)
        planned[per_gather] = estimate(
            shape, tokens, layout, precision="32-true", device="cpu", flash=False
        ).attention
    measured_drop, planned_drop = peaks[heads] - peaks[1], planned[heads] - planned[1]
    assert abs(measured_drop - planned_drop) <= TOLERANCE * planned_drop, (measured_drop, planned_drop)


def test_a_dsa_model_s_saved_tensors_within_10_percent_in_the_absorbed_form() -> None:
    """A tiny DeepSeek-V3.2 as rank 0 of 2: its sparse layers attend in MLA's absorbed form, which keeps each
    head's query (latent + rotary dims) and output (latent dims) in the latent's space for the backward beside
    the layer's own tensors (without them the plan counted 40% too little)."""
    model, shape = hf_model(
        model_type="deepseek_v32",
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=8,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        index_topk=64,
        index_n_heads=4,
        index_head_dim=32,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    from lightning_cp.hf.indexers import adapt_indexers
    from lightning_cp.hf.latent import adapt_latent_attention

    adapt_indexers(model)  # as the strategies' setup does
    assert adapt_latent_attention(model)
    peers, tokens = SimulatedCPGroup(2), TOKENS // 4
    ids = {"input_ids": torch.randint(0, VOCAB, (1, 2 * tokens), generator=torch.Generator().manual_seed(0))}
    batch = shard_batch(ids, 2, 0, cp_group=peers.exchange(0))

    def hidden() -> torch.Tensor:
        return model.model(
            input_ids=batch["input_ids"],
            position_ids=batch["position_ids"],
            cp_shard=batch["cp_shard"],
            use_cache=False,
        ).last_hidden_state

    with peers.recording():
        saved = saved_bytes(model, hidden)
    planned = estimate(
        shape, 2 * tokens, Layout(gpus=2, cp=2), precision="32-true", device="cpu", flash=False
    )
    kept = planned.activations + planned.selections
    assert abs(kept - saved) <= TOLERANCE * saved, (kept, saved)
