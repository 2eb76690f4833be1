"""Multi-head latent attention families train exactly under CP with the latent exchanged, not every head's keys.

- the dense MLA families at dp 2 x cp 2 (padded rows) and dp 1 x cp 4 (packed documents of one token and more),
  loss and every parameter's gradient (``kv_b_proj``'s included, summed over CP as the strategies do) against
  ``transformers``' own unsharded model (:mod:`tests.hf._exactness`, weights at 10x the default initializer
  range), with every all-gather of the step counted: the latent and rotary part (``kv_lora_rank +
  qk_rope_head_dim`` per token) and never the expanded heads; the DSA families' absorbed form is checked by
  ``tests/hf/test_sparse_attention.py``'s matrix, through ``Trainer.fit`` too;
- without ``cp_shard``, or with another attention implementation, the adapted model is the same model.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_cp.hf.latent import LATENT_OF, adapt_latent_attention
from lightning_cp.models import HFCausalLM
from lightning_cp.parallel import groups
from tests.hf import _exactness
from tests.hf._families import tiny_config
from tests.parallel._collectives import recorded_collectives

transformers = pytest.importorskip("transformers")

RANK, ROPE, HEADS, NOPE, VALUE = 16, 8, 4, 16, 12
_SHAPE = {
    "vocab_size": _exactness.VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_attention_heads": HEADS,
    "num_key_value_heads": HEADS,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "kv_lora_rank": RANK,
    "q_lora_rank": 32,
    "qk_rope_head_dim": ROPE,
    "qk_nope_head_dim": NOPE,
    "v_head_dim": VALUE,
    "max_position_embeddings": 256,
    "num_hidden_layers": 2,
    "first_k_dense_replace": 1,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "initializer_range": _exactness.INIT,
}
# DeepSeek-V2's and V3's attention (V2 with a query of full rank), GLM-4.7-Flash's, and Kimi-Linear's MLA layer
# beside its linear-attention one.
MLA: dict[str, dict] = {
    "deepseek_v3": {"model_type": "deepseek_v3", **_SHAPE},
    "deepseek_v2": {"model_type": "deepseek_v2", **_SHAPE, "q_lora_rank": None},
    "glm4_moe_lite": {"model_type": "glm4_moe_lite", **_SHAPE},
    "kimi_linear": {
        "model_type": "kimi_linear",
        **_SHAPE,
        "layer_types": ["linear_attention", "full_attention"],
        "linear_num_heads": 4,
        "linear_head_dim": 8,
    },
}
LATENT_WIDTH = RANK + ROPE
EXPANDED_WIDTH = HEADS * (NOPE + ROPE + VALUE)
# The other dense MLA families of transformers 5.24, at the family matrix's tiny configs and their own
# initializer range (tests/hf/_families.py): LongCat-Flash, MiniCPM3, Youtu, AXK1, Bailing's hybrid.
OTHER_MLA = ("axk1", "bailing_hybrid", "longcat_flash", "minicpm3", "youtu")


def _widths(config: dict) -> tuple[int, int]:
    """The latent's and the expanded heads' width per token of an MLA config."""
    nope, rope = config["qk_nope_head_dim"], config["qk_rope_head_dim"]
    return config["kv_lora_rank"] + rope, config["num_attention_heads"] * (nope + rope + config["v_head_dim"])


def _recorded_step(configs: dict[str, dict], cp: int, packed: bool) -> dict:
    """:func:`_exactness.train_step` of each family, with the per-token widths of the step's all-gathers."""
    results = {}
    for name, config in configs.items():
        with recorded_collectives() as calls:
            results.update(_exactness.train_step({name: config}, cp, packed))
        groups.destroy()  # train_step creates the groups of its layout
        results[name]["gathered"] = [
            _width(call.shape) for call in calls if call.kind == "all_gather" and len(call.shape) > 1
        ]
    return results


def _width(shape: tuple[int, ...]) -> int:
    width = 1
    for size in shape[1:]:
        width *= size
    return width


@pytest.mark.parametrize(("cp", "packed"), [(2, False), (4, True)], ids=["dp2-cp2-padded", "dp1-cp4-packed"])
def test_mla_families_train_exactly_with_the_latent_exchanged(world4, cp, packed):
    configs = {**MLA, **{name: tiny_config(name).to_dict() for name in OTHER_MLA}}
    results = world4.run(_recorded_step, configs, cp, packed)[0]
    failures = _exactness.failures(results)
    assert not failures, "\n".join(failures)
    for name, result in results.items():
        gathered = result["gathered"]
        latent, expanded = _widths(configs[name])
        # One all-gather of the latent per MLA layer in the forward, one in the backward.
        assert gathered.count(latent) >= 2, (name, gathered)
        assert expanded not in gathered, (name, gathered)


@pytest.mark.parametrize("name", ["deepseek_v3", "kimi_linear"])
def test_without_cp_shard_the_adapted_model_is_the_model(name):
    torch.manual_seed(0)
    module = HFCausalLM(MLA[name])
    module.configure_model()
    model = module.model
    ids = torch.randint(3, _exactness.VOCAB, (2, 11), generator=torch.Generator().manual_seed(3))
    before = model(input_ids=ids, use_cache=False).logits
    assert adapt_latent_attention(model)
    layer = next(m for m in model.modules() if hasattr(m, "kv_b_proj"))
    latent, k_rot = torch.randn(1, 1, 5, RANK), torch.randn(1, 1, 5, ROPE)
    assert getattr(layer.expand_kv(latent, k_rot)[0], LATENT_OF) is layer
    assert torch.equal(model(input_ids=ids, use_cache=False).logits, before)
    model.config._attn_implementation = "sdpa"  # another implementation gets the family's own keys and values
    key, value = layer.expand_kv(latent, k_rot)
    assert key.shape == (1, HEADS, 5, NOPE + ROPE) and value.shape == (1, HEADS, 5, VALUE)


ATTENTION_LINEARS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


NF4 = {"quantize": "nf4", "nf4_block_size": 16, "nf4_scaler_block_size": 4}  # blocks the tiny weights hold


def _lora_step(config: dict, cp: int, packed: bool, quantize: bool) -> dict:
    """Every rank: one step of ``config`` with LoRA on every linear layer of its attention (``quantize``: QLoRA,
    the decoder's linear weights NF4), ``B`` drawn non-zero so that the adapters change the keys and values; the
    adapters' gradients averaged over DP x CP, the step's all-gather widths, and on rank 0 ``transformers`` +
    ``peft``'s loss and gradients (the same weights, quantized by ``torchao`` the same way)."""
    import peft

    from lightning_cp.hf import check_models
    from lightning_cp.hf.lora import LoRA
    from lightning_cp.parallel import shard_batch
    from lightning_cp.parallel.layout import set_current_layout

    layout = groups.initialize(tp=1, cp=cp)
    set_current_layout(layout)
    try:
        torch.manual_seed(0)
        dense = HFCausalLM(config)  # the weights the LoRA model is built with, before any quantization
        dense.configure_model()
        torch.manual_seed(0)
        settings = {"target_modules": list(ATTENTION_LINEARS), **(NF4 if quantize else {})}
        module = HFCausalLM(config, lora=LoRA(rank=4, alpha=8.0, **settings))
        module.configure_model()
        check_models(module, layout, torch.device("cpu"))  # the strategies' setup: checks, then adapts
        model = module.model
        targets = sorted({n.rsplit(".lora_A", 1)[0] for n, _ in model.named_parameters() if ".lora_A." in n})
        assert any(t.endswith("kv_b_proj") for t in targets)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".lora_B." in name:
                    p.normal_(0, 0.3, generator=torch.Generator().manual_seed(len(name)))
        adapters = {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_" in n}
        module.train()
        batch = shard_batch(
            _exactness.local_batch(packed, layout), cp, layout.cp_rank, cp_group=layout.cp_group
        )
        with recorded_collectives() as calls:
            loss = module.training_step(batch, 0)
            loss.backward()
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        result = _exactness.averaged(loss, trainable, layout)
        grads = result["grads"]
        result["gathered"] = [_width(c.shape) for c in calls if c.kind == "all_gather" and len(c.shape) > 1]
        if dist.get_rank() == 0:
            reference = transformers.AutoModelForCausalLM.from_config(
                transformers.AutoConfig.for_model(**config)
            )
            reference.load_state_dict(dense.model.state_dict())
            if quantize:
                from torchao.quantization import to_nf4

                for linear in reference.model.layers.modules():
                    if isinstance(linear, torch.nn.Linear):
                        weight = to_nf4(
                            linear.weight.detach(), NF4["nf4_block_size"], NF4["nf4_scaler_block_size"]
                        )
                        linear.weight = torch.nn.Parameter(weight, requires_grad=False)
            reference = peft.inject_adapter_in_model(
                peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets), reference
            )
            missing, unexpected = reference.load_state_dict(adapters, strict=False)
            assert not unexpected and not [n for n in missing if ".lora_" in n], (missing, unexpected)
            reference.train()
            docs = _exactness.documents(packed)
            total = sum(d.shape[1] - 1 for d in docs)
            want = sum(
                reference(input_ids=d, labels=d, use_cache=False).loss * (d.shape[1] - 1)
                for d in docs
                if d.shape[1] > 1  # a document of one token has no target
            )
            (want / total).backward()
            result["expected"] = {
                "loss": (want / total).detach(),
                "grads": {n: p.grad.flatten() for n, p in reference.named_parameters() if n in grads},
            }
        return result
    finally:
        set_current_layout(None)
        groups.destroy()


@pytest.mark.parametrize("quantize", [False, True], ids=["lora", "qlora"])
def test_a_lora_adapter_on_kv_b_proj_keeps_the_latent_exchanged(world4, quantize):
    """LoRA's default targets include ``kv_b_proj``: its merged weight ``W + scaling B A`` (QLoRA's ``W``
    dequantized) expands the latent (hf/latent.py's ``kv_b_weight``), so the layer still all-gathers the latent,
    never the expanded heads, and the step is ``transformers`` + ``peft``'s on every packed document alone
    (``kv_b_proj``'s ``A`` and ``B`` gradients included)."""
    pytest.importorskip("peft")
    if quantize:
        pytest.importorskip("torchao")
    config = MLA["deepseek_v3"]
    result = world4.run(_lora_step, config, 4, True, quantize)[0]
    assert not _exactness.failures({"deepseek_v3": result}), _exactness.failures({"deepseek_v3": result})
    assert any("kv_b_proj.lora_A" in n for n in result["grads"])
    latent, expanded = _widths(config)
    assert result["gathered"].count(latent) >= 2 and expanded not in result["gathered"], result["gathered"]
