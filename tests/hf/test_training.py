"""``HFCausalLM`` under ``MegatronCPStrategy``: the same training as the unsharded ``transformers`` model.

The reference is ``transformers``' own loss, ``model(input_ids, labels=...).loss`` with ``"sdpa"``
attention, in a plain single-process loop with the same AdamW on the same global batches. Between
steps the model is plain ``"sdpa"`` attention again.
"""

from unittest import mock

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Callback, seed_everything
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler

from lightning_cp import MegatronCPFSDPStrategy, MegatronCPStrategy, PolicyObjective
from lightning_cp.adaptation import applied
from lightning_cp.data import LongRangeCopyDataset, collate_padded
from lightning_cp.hf import decoder
from lightning_cp.memory import tiling
from lightning_cp.models import HFCausalLM
from lightning_cp.parallel import shard_batch
from tests._trainer import cp_trainer as _trainer
from tests._trainer import quiet_trainer
from tests.hf._families import tiny_config, transformers
from tests.hf._models import CONFIGS, VOCAB, assert_grads_close, build

GLOBAL_BATCH = 4
STEPS = 3
LR = 1e-2


def _dataset():
    # Unequal lengths: padded rows with unequal loss masks, and a different number of targets per rank.
    return LongRangeCopyDataset(
        num_samples=GLOBAL_BATCH * STEPS, seq_len=26, vocab_size=VOCAB, seed=3, min_len=10
    )


class _Losses(Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(trainer.callback_metrics["train/loss_step"].item())


MODES = {
    "allgather": {},
    "allgather-by-head": {"cp_attention": "allgather", "kv_heads_per_gather": 1},
    "ulysses": {"cp_attention": "ulysses"},
}
"""The CP attention modes (the strategies' arguments): at cp = 4 Ulysses replicates the two key/value heads."""


def _fit(cps, gradient_checkpointing=False, mode="allgather", tiled=False):
    """For each model and CP size: per-step losses and final weights after STEPS optimizer steps."""
    results = {}
    for name in CONFIGS:
        for cp in cps:
            module = HFCausalLM(
                CONFIGS[name], lr=LR, gradient_checkpointing=gradient_checkpointing, tiled=tiled
            )
            seed_everything(0)
            module.configure_model()
            assert ("tiling" in applied(module.model.model.norm)) == tiled
            recorder = _Losses()
            strategy = MegatronCPStrategy(cp=cp, **MODES[mode])
            trainer = _trainer(cp, max_steps=STEPS, callbacks=[recorder], strategy=strategy)
            dp = dist.get_world_size() // cp
            loader = DataLoader(_dataset(), batch_size=GLOBAL_BATCH // dp, collate_fn=collate_padded)
            with mock.patch.object(tiling, "auto_tile_tokens", lambda tokens, dim: 3):  # several tiles a rank
                trainer.fit(module, loader)
            results[name, cp] = recorder.losses, {k: v.clone() for k, v in module.model.state_dict().items()}
    return results


def _reference(name):
    seed_everything(0)
    model = build(name, "sdpa")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
    # Lightning's training sampler shuffles with seed 0, the same permutation for any number of replicas.
    data = _dataset()
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    losses = []
    for batch in DataLoader(data, batch_size=GLOBAL_BATCH, sampler=sampler, collate_fn=collate_padded):
        # transformers shifts the labels itself: label t is token t where token t is a target.
        labels = torch.where(batch["loss_mask"].bool(), batch["input_ids"], -100)
        loss = model(input_ids=batch["input_ids"], labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def _check(results):
    for name in CONFIGS:
        ref_losses, ref_weights = _reference(name)
        seed_everything(0)
        initial = build(name, "sdpa").state_dict()
        assert max((ref_weights[k] - initial[k]).abs().max().item() for k in initial) > 2 * LR  # weights move
        for (model, cp), (losses, weights) in results.items():
            if model != name:
                continue
            torch.testing.assert_close(
                torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6, msg=f"{name} cp={cp}"
            )
            assert weights.keys() == ref_weights.keys()
            # Weights are ~0.02 (a 1% error is 2e-4); atol 5e-5 leaves room for Adam turning a gradient at
            # round-off level into a sizeable step on the odd element.
            for key, value in ref_weights.items():
                where = f"{name} cp={cp} {key}"
                torch.testing.assert_close(
                    weights[key], value, rtol=1e-4, atol=5e-5, msg=lambda m, where=where: f"{where}: {m}"
                )


@pytest.mark.parametrize("mode", MODES)
def test_dp1_cp2_with_gradient_checkpointing_and_tiles_matches_the_unsharded_model(world2, mode):
    # The recomputed layers get cp_shard again: without it they would refuse the sharded positions. The
    # tiled MLPs and norms (HFCausalLM(tiled=True)) run inside them.
    _check(world2.run(_fit, (2,), gradient_checkpointing=True, mode=mode, tiled=True)[0])


@pytest.mark.parametrize("mode", MODES)
def test_dp2_cp2_and_dp1_cp4_match_the_unsharded_model(world4, mode):
    _check(world4.run(_fit, (2, 4), mode=mode)[0])


# A mixture of experts whose router load-balancing loss weighs as much as the LM loss: the aux loss of the
# global batch (every DP rank's rows, every CP rank's tokens) is what transformers adds to its labels= loss.
_MOE = {"output_router_logits": True, "router_aux_loss_coef": 1.0}


def _fit_moe(cp):
    """Per-step losses and final weights of a tiny Qwen3-MoE trained at (dp, cp) = (world / cp, cp)."""
    config = tiny_config("qwen3_moe", **_MOE).to_dict()
    module = HFCausalLM(config, lr=LR)
    seed_everything(0)
    module.configure_model()
    recorder = _Losses()
    dp = dist.get_world_size() // cp
    # Rows of one length: transformers' aux loss counts every token, ours the real ones (the CP padding aside).
    data = LongRangeCopyDataset(num_samples=GLOBAL_BATCH * STEPS, seq_len=26, vocab_size=VOCAB, seed=3)
    _trainer(cp, max_steps=STEPS, callbacks=[recorder]).fit(
        module, DataLoader(data, batch_size=GLOBAL_BATCH // dp, collate_fn=collate_padded)
    )
    return recorder.losses, {k: v.clone() for k, v in module.model.state_dict().items()}


def _moe_reference():
    seed_everything(0)
    model = transformers.AutoModelForCausalLM.from_config(
        tiny_config("qwen3_moe", **_MOE), attn_implementation="sdpa"
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
    data = LongRangeCopyDataset(num_samples=GLOBAL_BATCH * STEPS, seq_len=26, vocab_size=VOCAB, seed=3)
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    losses = []
    for batch in DataLoader(data, batch_size=GLOBAL_BATCH, sampler=sampler, collate_fn=collate_padded):
        labels = torch.where(batch["loss_mask"].bool(), batch["input_ids"], -100)
        out = model(input_ids=batch["input_ids"], labels=labels)
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        losses.append((out.loss - _MOE["router_aux_loss_coef"] * out.aux_loss).item())  # what is logged
    return losses, model.state_dict()


def test_dp2_cp2_moe_with_its_router_loss_matches_the_unsharded_model(world4):
    """The router statistics are reduced over DP x CP (the loss group): over CP only, each DP replica would
    balance its own rows, and the averaged gradients would move the weights elsewhere."""
    ref_losses, ref_weights = _moe_reference()
    losses, weights = world4.run(_fit_moe, 2)[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    # In norm per tensor: Adam turns a round-off gradient of an expert's odd element into a visible step (a
    # few 1e-5), while the weights moved ~3e-2 per element; a 1% error of that move fails by far.
    for key, value in ref_weights.items():
        error = (weights[key] - value).norm()
        assert error <= 1e-4 * value.norm(), f"{key}: error {error:.3e}, norm {value.norm():.3e}"


class _SdpaModule(HFCausalLM):
    def configure_model(self):
        super().configure_model()
        self.model.set_attn_implementation("sdpa")


def _fit_error(module_class):
    """The message of the ``ValueError`` that fitting ``module_class`` (Qwen3) at cp=2 raises, if any."""
    module = module_class(CONFIGS["qwen3"])
    try:
        _trainer(2, max_steps=1).fit(module, DataLoader(_dataset(), batch_size=2, collate_fn=collate_padded))
    except ValueError as error:
        return str(error)
    return None


def test_an_sdpa_model_under_cp_fails_at_setup(world2):
    for message in world2.run(_fit_error, _SdpaModule):
        assert message is not None and "cp=2" in message and 'attn_implementation="lightning_cp"' in message


class _CallsBetweenSteps(Callback):
    """After each step: the model on a batch of another shape with a padding mask, against ``"sdpa"``;
    then on the step's own sharded batch without its shard, which must be refused."""

    def __init__(self):
        self.differences, self.errors = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        reference = build("llama", "sdpa")
        reference.load_state_dict(pl_module.model.state_dict())
        ids = torch.randint(0, VOCAB, (3, 7), generator=torch.Generator().manual_seed(batch_idx))
        mask = torch.ones_like(ids)
        mask[1, :3] = 0
        with torch.no_grad():
            logits, expected = (
                m(input_ids=ids, attention_mask=mask).logits for m in (pl_module.model, reference)
            )
        self.differences.append((logits - expected)[mask.bool()].abs().max().item())
        try:
            pl_module.model.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
        except ValueError as error:
            self.errors.append(str(error))


def _fit_with_calls_between_steps():
    seed_everything(0)
    module = HFCausalLM(CONFIGS["llama"])
    calls = _CallsBetweenSteps()
    trainer = _trainer(2, max_steps=2, callbacks=[calls])
    trainer.fit(module, DataLoader(_dataset(), batch_size=2, collate_fn=collate_padded))
    return calls.differences, calls.errors


def test_between_steps_the_model_is_sdpa_and_refuses_the_shard_without_cp_shard(world2):
    for differences, errors in world2.run(_fit_with_calls_between_steps):
        assert len(differences) == 2 and max(differences) < 1e-5
        assert len(errors) == 2 and all("cp_shard=batch['cp_shard']" in error for error in errors)


class _CallsUnderFSDP(Callback):
    """After each step, as a user's callback would: the whole weights on rank 0, then the model's forward on
    another batch (a padding mask) and greedy ``generate``, on every rank; the root unit sharded again after."""

    def __init__(self):
        self.weights, self.logits, self.generated, self.resharded = [], [], [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.weights.append(trainer.strategy.full_state_dict())
        ids = torch.randint(0, VOCAB, (3, 7), generator=torch.Generator().manual_seed(batch_idx))
        mask = torch.ones_like(ids)
        mask[1, :3] = 0
        with torch.no_grad():
            self.logits.append(pl_module.model(input_ids=ids, attention_mask=mask).logits)
            prompt = ids[:1, :4]
            self.generated.append(pl_module.model.generate(prompt, max_new_tokens=6, do_sample=False))
        self.resharded.append(isinstance(pl_module.model.get_input_embeddings().weight, DTensor))


def _fit_fsdp_with_calls_between_steps(cp):
    seed_everything(0)
    module = HFCausalLM(CONFIGS["qwen3"])
    calls = _CallsUnderFSDP()
    trainer = _trainer(cp, max_steps=2, strategy=MegatronCPFSDPStrategy(cp=cp), callbacks=[calls])
    dp = dist.get_world_size() // cp
    trainer.fit(module, DataLoader(_dataset(), batch_size=GLOBAL_BATCH // dp, collate_fn=collate_padded))
    return {name: getattr(calls, name) for name in ("weights", "logits", "generated", "resharded")}


@pytest.mark.parametrize("world", ["world2", "world4"], ids=["dp1-cp2", "dp2-cp2"])
def test_under_fsdp_a_callback_s_forward_and_generate_equal_an_sdpa_copy_of_the_gathered_weights(
    world, request
):
    per_rank = request.getfixturevalue(world).run(_fit_fsdp_with_calls_between_steps, 2)
    assert all(rank["weights"] == [{}, {}] for rank in per_rank[1:])  # the whole weights on rank 0 only
    for step, weights in enumerate(per_rank[0]["weights"]):
        reference = build("qwen3", "sdpa")
        reference.load_state_dict({name.removeprefix("model."): value for name, value in weights.items()})
        ids = torch.randint(0, VOCAB, (3, 7), generator=torch.Generator().manual_seed(step))
        mask = torch.ones_like(ids)
        mask[1, :3] = 0
        with torch.no_grad():
            expected = reference(input_ids=ids, attention_mask=mask).logits
            generated = reference.generate(ids[:1, :4], max_new_tokens=6, do_sample=False)
        for rank in per_rank:
            got = rank["logits"][step][mask.bool()]
            torch.testing.assert_close(got, expected[mask.bool()], rtol=1e-5, atol=1e-5)
            assert torch.equal(rank["generated"][step], generated)
            assert rank["resharded"][step]
    first, second = (weights["model.lm_head.weight"] for weights in per_rank[0]["weights"])
    assert not torch.equal(first, second)  # the weights of each step


class _DataloaderIterModule(HFCausalLM):
    def training_step(self, dataloader_iter):
        batch, batch_idx, _ = next(dataloader_iter)
        return super().training_step(batch, batch_idx)


def test_a_dataloader_iter_step_is_refused_at_setup(world2):
    for message in world2.run(_fit_error, _DataloaderIterModule):
        assert message is not None
        assert (
            "training_step(self, dataloader_iter)" in message
            and "training_step(self, batch, batch_idx)" in message
        )


@pytest.mark.parametrize("temperature", [None, 0.7], ids=["lm", "objective-at-0.7"])
def test_predict_step_gives_the_log_probability_of_every_target(temperature):
    # Without a strategy (cp = 1): the batch sharded by hand, against log_softmax of the model's own logits,
    # at the temperature of the objective (the sampler's: RL's old / reference log-probs), else 1.
    seed_everything(0)
    objective = None if temperature is None else PolicyObjective(temperature=temperature)
    module = HFCausalLM(CONFIGS["llama"], objective=objective)
    module.configure_model()
    batch = collate_padded([_dataset()[i] for i in range(3)])
    shard = shard_batch(batch, 1, 0)
    out = module.predict_step(shard, 0)
    with torch.no_grad():
        logits = module.model(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
    target = shard["labels"] != -100
    expected = (
        (logits / (temperature or 1.0))
        .log_softmax(-1)
        .gather(-1, shard["labels"].clamp(min=0)[..., None])[..., 0]
    )
    assert target.sum() > 10 and torch.equal(out["labels"], shard["labels"])
    torch.testing.assert_close(out["logprobs"][target], expected[target], rtol=1e-5, atol=1e-5)
    assert (out["logprobs"][~target] == 0).all()


class _BareWeightModule(HFCausalLM):
    """A user's step with the LM-head weight alone (the README's plain recipe), wrong for a scaled head."""

    def training_step(self, batch, batch_idx):
        return self.lm_loss(self(batch), self.model.lm_head.weight, batch)


def _bare_weight_error(fsdp):
    config = tiny_config("cohere", logit_scale=0.125).to_dict()
    data = LongRangeCopyDataset(num_samples=4, seq_len=26, vocab_size=config["vocab_size"], seed=3)
    strategy = MegatronCPFSDPStrategy(cp=2) if fsdp else MegatronCPStrategy(cp=2)
    trainer = quiet_trainer(devices=2, strategy=strategy, max_steps=1)
    try:
        trainer.fit(_BareWeightModule(config), DataLoader(data, batch_size=2, collate_fn=collate_padded))
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_the_weight_of_a_scaled_head_alone_is_refused(world2, fsdp):
    """Cohere multiplies its logits by logit_scale: the loss of the bare weight is refused, also under FSDP,
    where the weight a step sees is the one FSDP gathers (marked by the probe run after sharding)."""
    for message in world2.run(_bare_weight_error, fsdp):
        assert message is not None and "CohereForCausalLM (its logits apply logit_scale=0.125)" in message


class _CausalLMWithoutShard(HFCausalLM):
    """The plain ``transformers`` recipe unchanged: the shard's tokens alone, neither cp_shard nor position_ids."""

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch["input_ids"]).logits.float().mean()


class _DecoderWithoutShard(HFCausalLM):
    def training_step(self, batch, batch_idx):
        return decoder(self.model)(batch["input_ids"]).last_hidden_state.mean()


@pytest.mark.parametrize("module_class", [_CausalLMWithoutShard, _DecoderWithoutShard], ids=["lm", "decoder"])
def test_a_call_on_the_shard_without_cp_shard_or_positions_is_refused(world2, module_class):
    """Without the batch's position_ids the attention cannot tell the shard from a whole sequence (each rank
    would attend within its own tokens): the model's call itself refuses the shard's input_ids."""
    for message in world2.run(_fit_error, module_class):
        assert (
            message is not None and "without its shard" in message and "cp_shard=batch['cp_shard']" in message
        )


class _CacheOfTheStep(HFCausalLM):
    """The README's recipe without ``use_cache=False``: which cache the decoder's call returns, per step."""

    def __init__(self, config, use_cache):
        super().__init__(config)
        self.use_cache, self.caches = use_cache, []

    def training_step(self, batch, batch_idx):
        extra = {} if self.use_cache is None else {"use_cache": self.use_cache}
        out = decoder(self.model)(
            input_ids=batch["input_ids"],
            position_ids=batch["position_ids"],
            cp_shard=batch["cp_shard"],
            **extra,
        )
        self.caches.append(type(out.past_key_values).__name__)
        return out.last_hidden_state.float().mean()


def _caches(use_cache):
    module = _CacheOfTheStep(CONFIGS["qwen3"], use_cache)
    _trainer(2, max_steps=2).fit(module, DataLoader(_dataset(), batch_size=2, collate_fn=collate_padded))
    assert module.model.config.use_cache  # transformers' default: a cache for every call that gives none
    return module.caches


def test_a_call_with_cp_shard_keeps_no_kv_cache_unless_asked(world2):
    """A cache of a shard cannot be continued and would keep every layer's K/V of the shard to the end of
    the step: a call with cp_shard and no use_cache runs without one; an explicit use_cache is kept."""
    assert world2.run(_caches, None) == [["NoneType", "NoneType"]] * 2
    assert world2.run(_caches, True) == [["DynamicCache", "DynamicCache"]] * 2


# gpt-oss's attention sinks under DP x CP with clipping: each CP rank's sinks gradient covers its own queries
# and DDP sums the ranks' parts; the clipping norm must be that of the summed gradient (clipped before that
# reduction, each rank's part is scaled by a coefficient of its own). Only the sinks and the query biases train
# (gradients of like size), so that the sinks are a large part of the norm; the clip is far below it.
_SINKS_CLIP = 1e-4
_TRAINED = ("sinks", "q_proj.bias")


class _SinksOnly(HFCausalLM):
    """A model of which only ``_TRAINED`` trains, keeping the gradients as clipped for the optimizer step."""

    def configure_model(self):
        super().configure_model()
        for name, param in self.model.named_parameters():
            param.requires_grad_(name.endswith(_TRAINED))

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        self.clipped = {
            name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
            for name, p in self.model.named_parameters()
            if p.grad is not None
        }


def _sinks_clipped(strategy_class):
    """The clipped gradients of one step of a tiny gpt-oss (a window on alternate layers) at (dp, cp) = (2, 2)."""
    module = _SinksOnly(tiny_config("gpt_oss", sliding_window=4).to_dict())
    seed_everything(0)
    module.configure_model()
    trainer = _trainer(2, max_steps=1, gradient_clip_val=_SINKS_CLIP, strategy=strategy_class(cp=2))
    trainer.fit(module, DataLoader(_dataset(), batch_size=GLOBAL_BATCH // 2, collate_fn=collate_padded))
    return module.clipped


def _reference_sinks_clipped():
    """The same step of the unsharded model (eager attention: SDPA ignores the sinks) on the whole global batch."""
    seed_everything(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("gpt_oss", sliding_window=4))
    data = _dataset()
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    batch = next(iter(DataLoader(data, batch_size=GLOBAL_BATCH, sampler=sampler, collate_fn=collate_padded)))
    labels = torch.where(batch["loss_mask"].bool(), batch["input_ids"], -100)
    model(input_ids=batch["input_ids"], labels=labels).loss.backward()
    trained = {name: param for name, param in model.named_parameters() if name.endswith(_TRAINED)}
    norm = torch.nn.utils.clip_grad_norm_(trained.values(), _SINKS_CLIP)
    return {name: param.grad for name, param in trained.items()}, norm


@pytest.mark.parametrize("strategy_class", [MegatronCPStrategy, MegatronCPFSDPStrategy], ids=["ddp", "fsdp"])
def test_clipping_under_dp_x_cp_takes_the_norm_of_the_sinks_gradient_summed_over_cp(world4, strategy_class):
    expected, norm = _reference_sinks_clipped()
    assert norm > 5 * _SINKS_CLIP  # clipping matters
    for clipped in world4.run(_sinks_clipped, strategy_class):
        assert clipped.keys() == expected.keys()
        assert_grads_close(clipped, expected)
