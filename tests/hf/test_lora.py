"""LoRA and QLoRA under CP: ``HFCausalLM(lora=...)`` and a user's own ``peft`` module, both strategies.

Each fit trains two steps on one global batch (the second step's adapters are non-zero after the first) of
sequences of odd lengths, padded or packed. The reference is ``transformers`` + ``peft`` alone: the
pretrained model (``from_pretrained``, ``"sdpa"``; for QLoRA its decoder's linear weights quantized whole
with ``torchao``'s ``to_nf4``) with ``peft``'s LoRA injected, loaded with the weights the second step started
from, on every sequence alone. The second step's loss and every adapter's gradient (as the strategy leaves
it: DDP's average, FSDP's shards gathered) must equal the reference's, 2e-5 of each gradient's norm (a 1%
error fails); no base weight is trained, and after training every base weight is bit-identical to the
checkpoint's (the NF4 codes to what was loaded).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_cp import CPLossMixin, MegatronCPFSDPStrategy, MegatronCPStrategy, load_pretrained
from lightning_cp.data import collate_packed, collate_padded
from lightning_cp.hf import decoder, output_head
from lightning_cp.hf.lora import LoRA, adapter_layers, add_adapters, check_adapters
from lightning_cp.hf.probe import check_configs
from lightning_cp.models import HFCausalLM
from tests._trainer import quiet_trainer
from tests.hf._models import CONFIGS, VOCAB, assert_grads_close
from tests.hf._pretrained import save_pretrained, stored_tensors

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

LENGTHS = (13, 22, 9, 17)  # the global batch: one row per sequence (padded) or one packed row per DP rank
SETTINGS = {"rank": 4, "alpha": 8.0}
NF4 = {"quantize": "nf4", "nf4_block_size": 16, "nf4_scaler_block_size": 4}  # blocks a tiny shard holds
LR = 1e-2


def _data():
    g = torch.Generator().manual_seed(3)
    return [{"input_ids": torch.randint(0, VOCAB, (n,), generator=g)} for n in LENGTHS]


class _Record:
    """What the second step started from and computed, gathered whole on every rank (mixed into the modules)."""

    def on_train_batch_start(self, batch, batch_idx):
        if self.trainer.global_step == 1:
            self.start = {n: _whole(p).clone() for n, p in self._net().named_parameters() if not _nf4(p)}

    def on_before_optimizer_step(self, optimizer):
        super().on_before_optimizer_step(optimizer)  # the loss's rescale of the step's gradients first
        net = self._net()
        self.trainable = sorted(n for n, p in net.named_parameters() if p.requires_grad)
        self.optimized = sum(len(group["params"]) for group in optimizer.param_groups)
        if self.trainer.global_step == 1:
            self.grads = {n: _whole(p.grad) for n, p in net.named_parameters() if p.requires_grad}
            layout = self.trainer.strategy.layout
            loss = self.step_loss.clone()
            dist.all_reduce(loss, group=layout.loss_group)
            self.loss = loss / (layout.dp * layout.cp)

    def on_train_start(self):
        self.codes = {n: _codes(p).clone() for n, p in self._net().named_parameters() if _nf4(p)}

    def on_train_end(self):
        net = self._net()
        self.end = {n: _whole(p) for n, p in net.named_parameters() if not p.requires_grad and not _nf4(p)}
        self.codes_kept = all(torch.equal(_codes(net.get_parameter(n)), c) for n, c in self.codes.items())

    def results(self):
        return {k: getattr(self, k) for k in ("start", "grads", "loss", "trainable", "optimized", "end")} | {
            "codes_kept": self.codes_kept,
            "quantized": sorted(self.codes),
        }


class _LoRAModule(_Record, HFCausalLM):
    def _net(self):
        return self.model

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.step_loss = loss.detach()
        return loss


class _UserModule(_Record, CPLossMixin, LightningModule):
    """The documented recipe: ``load_pretrained`` and ``peft.get_peft_model`` in a module of one's own."""

    def __init__(self, directory):
        super().__init__()
        self.directory = directory
        self.model = None

    def configure_model(self):
        if self.model is None:
            config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
            self.model = peft.get_peft_model(load_pretrained(self.directory), config)

    def _net(self):
        return self.model.get_base_model()

    def training_step(self, batch, batch_idx):
        hidden = decoder(self._net())(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], cp_shard=batch["cp_shard"]
        ).last_hidden_state
        loss = self.lm_loss(hidden, output_head(self._net()), batch)
        self.step_loss = loss.detach()
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=LR)


def _whole(tensor):
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()


def _local(tensor):
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _nf4(tensor):
    from torchao.quantization import NF4Tensor

    return isinstance(_local(tensor), NF4Tensor)


def _codes(tensor):
    return _local(tensor).quantized_data


def _fit(source, cp, fsdp, packed, user=False, cpu_offload=False, **options):
    """Every rank: two steps of the module on the global batch at dp = world / cp; what :class:`_Record` kept."""
    torch.manual_seed(0)
    dp = dist.get_world_size() // cp
    fsdp_options = {"cpu_offload": cpu_offload} if fsdp else {}
    strategy = (MegatronCPFSDPStrategy if fsdp else MegatronCPStrategy)(cp=cp, **fsdp_options)
    if user:
        module = _UserModule(str(source))
    else:
        module = _LoRAModule(source if isinstance(source, dict) else str(source), lr=LR, **options)
    loader = DataLoader(
        _data(), batch_size=len(LENGTHS) // dp, collate_fn=collate_packed if packed else collate_padded
    )
    trainer = quiet_trainer(devices=dist.get_world_size(), strategy=strategy, max_steps=2)
    trainer.fit(module, loader)
    return module.results()


def _reference(directory, state, nf4=None):
    """``transformers`` + ``peft``: the loss of every sequence alone and the adapters' gradients."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, attn_implementation="sdpa", dtype=torch.float32
    )
    if nf4 is not None:
        from torchao.quantization import to_nf4

        for module in model.model.layers.modules():
            if isinstance(module, torch.nn.Linear):
                weight = to_nf4(module.weight.detach(), nf4["nf4_block_size"], nf4["nf4_scaler_block_size"])
                module.weight = torch.nn.Parameter(weight, requires_grad=False)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    model = peft.inject_adapter_in_model(config, model)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("base_layer" in n for n in missing), (missing, unexpected)
    model.train()
    total = sum(len(d["input_ids"]) - 1 for d in _data())
    loss = (
        sum(
            model(input_ids=d["input_ids"][None], labels=d["input_ids"][None]).loss
            * (len(d["input_ids"]) - 1)
            for d in _data()
        )
        / total
    )
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def _check(results, directory, nf4=None):
    got = results[0]
    for other in results[1:]:  # every rank gathered the same
        torch.testing.assert_close(other["loss"], got["loss"], rtol=0, atol=0)
    assert got["trainable"] and all("lora_" in n for n in got["trainable"]), got["trainable"]
    assert got["optimized"] == len(got["trainable"])  # only the adapters are in AdamW
    loss, grads = _reference(directory, got["start"], nf4)
    torch.testing.assert_close(got["loss"], loss, rtol=1e-5, atol=0)
    assert set(got["grads"]) == set(grads)
    assert all(g.norm() > 0 for g in grads.values())
    assert_grads_close(
        {n: g.flatten() for n, g in got["grads"].items()}, {n: g.flatten() for n, g in grads.items()}
    )
    stored = stored_tensors(directory)
    for name, value in got["end"].items():  # the frozen base, bit for bit
        key = name.replace(".base_layer", "")
        assert torch.equal(value, stored[key].to(value.dtype)), name
    assert got["codes_kept"]
    if nf4 is not None:
        assert len(got["quantized"]) == 14  # 2 layers x 7 projections; not the embeddings or the head


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_pretrained("llama", tmp_path_factory.mktemp("lora") / "llama")


def test_lora_at_dp1_cp2_under_fsdp_with_cpu_offload_equals_transformers_and_peft(world2, llama):
    """Packed rows; the pretrained model built on meta, each rank reading its shards."""
    _check(world2.run(_fit, llama, 2, True, True, cpu_offload=True, lora=SETTINGS), llama)


def test_user_peft_module_at_dp1_cp4_fsdp_and_dp2_cp2_ddp_equals_transformers_and_peft(world4, llama):
    """load_pretrained + peft.get_peft_model in one's own module: under FSDP (padded; the meta build meets
    peft's renamed parameters) and DDP (packed)."""
    _check(world4.run(_fit, llama, 4, True, False, user=True), llama)
    _check(world4.run(_fit, llama, 2, False, True, user=True), llama)


def test_qlora_at_cp2_equals_the_same_quantized_model_unsharded(world2, llama):
    """DDP with checkpointing and tiles (the loaded model quantized; its NF4 weights kept out of DDP's
    broadcast), and FSDP (NF4 shards, each weight quantized whole as it loads); padded rows."""
    pytest.importorskip("torchao")
    lora = SETTINGS | NF4
    options = {"gradient_checkpointing": True, "tiled": True}
    _check(world2.run(_fit, llama, 2, False, False, lora=lora, **options), llama, NF4)
    _check(world2.run(_fit, llama, 2, True, False, lora=lora), llama, NF4)


# --- refused before the first step ------------------------------------------------------------------------


def _lora_model(**settings):
    from tests.hf._models import build

    torch.manual_seed(0)
    return add_adapters(build("llama", "lightning_cp"), LoRA(**{**SETTINGS, **settings}))


def test_lora_dropout_is_refused_under_cp_but_not_without():
    module = torch.nn.ModuleDict({"model": _lora_model(dropout=0.1)})
    check_configs(module, 1)
    with pytest.raises(ValueError, match=r"LoRA dropout 0\.1.*cp=2.*LoRA\(dropout=0\.0\)"):
        check_configs(module, 2)


@pytest.mark.parametrize("model_type", ["deepseek_v3", "qwen2_moe"])
def test_all_linear_adapts_every_linear_layer_of_a_mixture_of_experts(model_type):
    """peft rewrites a mixture-of-experts model's targets named like expert projections into the fused experts'
    parameters (its transformers 4 -> 5 conversion): DeepSeek-V3's dense MLP and both families' shared experts
    went unadapted and their fused experts adapted, which the setup then refused. ``"all-linear"`` is every
    ``nn.Linear`` but the head, as named, and the setup takes it."""
    from lightning_cp.hf.lora import _all_linear
    from tests.hf._families import tiny_config

    torch.manual_seed(0)
    config = tiny_config(
        model_type,
        num_hidden_layers=2,
        **({"first_k_dense_replace": 1} if model_type == "deepseek_v3" else {}),
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    linear = set(_all_linear(model))
    assert any(name.endswith(("shared_expert.gate_proj", "shared_experts.gate_proj")) for name in linear)
    add_adapters(model, LoRA(**SETTINGS))
    adapted = {name for name, _ in adapter_layers(model)}
    assert adapted == linear
    check_adapters(model, "model", 2)


def test_dora_and_adapters_on_other_layers_are_refused():
    from tests.hf._models import build

    dora = peft.inject_adapter_in_model(
        peft.LoraConfig(r=4, target_modules=["q_proj"], use_dora=True), build("llama", "lightning_cp")
    )
    with pytest.raises(ValueError, match=r"q_proj is a DoRA adapter.*use_dora=False"):
        check_configs(torch.nn.ModuleDict({"model": dora}), 1)
    conv = peft.inject_adapter_in_model(
        peft.LoraConfig(r=2, target_modules=["conv"]), torch.nn.ModuleDict({"conv": torch.nn.Conv1d(4, 4, 3)})
    )
    with pytest.raises(
        ValueError, match=r"conv puts a LoRA adapter on a Conv1d.*leave it out of target_modules"
    ):
        check_adapters(conv, "model", 1)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"rank": 0}, r"LoRA\(rank=0\) must be a positive integer"),
        ({"dropout": 1.0}, r"LoRA\(dropout=1\.0\) must be in \[0, 1\)"),
        ({"quantize": "int4"}, r"LoRA\(quantize='int4'\) must be None or 'nf4'"),
        ({"target_modules": ["qkv"]}, r"LoRA\(target_modules=\['qkv'\]\).*named .*q_proj"),
        ({"quantize": "nf4"}, r"model\.layers\.0\.self_attn\.q_proj\.weight has 1024 weights.*64 \* 256"),
    ],
)
def test_bad_settings_are_refused_with_the_argument(settings, message):
    with pytest.raises(ValueError, match=message):
        _lora_model(**settings)


@pytest.mark.parametrize(("missing", "quantize"), [("peft", None), ("torchao", "nf4")])
def test_a_missing_backend_names_the_extra(monkeypatch, missing, quantize):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == missing else find_spec(name, *a)
    )
    with pytest.raises(ImportError, match=r"pip install 'lightning-cp\[lora\]'"):
        HFCausalLM(CONFIGS["llama"], lora={"quantize": quantize})


def test_a_cast_of_the_module_keeps_the_nf4_weights_quantized():
    """``precision="bf16-true"`` casts the module with ``module.to(torch.bfloat16)``: the NF4 weights keep
    their codes (no dequantized copy), the adapters are cast."""
    pytest.importorskip("torchao")
    module = HFCausalLM(CONFIGS["llama"], lora=SETTINGS | NF4)
    module.configure_model()
    name = "model.layers.0.self_attn.q_proj.base_layer.weight"
    codes = _codes(module.model.get_parameter(name)).clone()
    module.to(torch.bfloat16)
    weights = dict(module.model.named_parameters())
    assert _nf4(weights[name]) and torch.equal(_codes(weights[name]), codes)
    assert weights[name].dtype == torch.bfloat16
    assert weights["model.layers.0.self_attn.q_proj.lora_A.default.weight"].dtype == torch.bfloat16


def test_a_bf16_base_stays_bf16_and_its_adapters_are_fp32_master_weights():
    """``HFCausalLM(dtype="bfloat16", lora=...)`` (what ``lightning-cp plan`` prints under ``bf16-mixed``):
    the frozen base in bf16, never upcast; the adapters in fp32, their gradients fp32 under autocast."""
    module = HFCausalLM(CONFIGS["llama"], dtype="bfloat16", lora=SETTINGS)
    module.configure_model()
    dtypes = {(p.requires_grad, p.dtype) for p in module.model.parameters()}
    assert dtypes == {(False, torch.bfloat16), (True, torch.float32)}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = module.model(input_ids=torch.randint(0, VOCAB, (1, 8))).logits
    logits.float().sum().backward()
    assert {p.grad.dtype for p in module.model.parameters() if p.grad is not None} == {torch.float32}
