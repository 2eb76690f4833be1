"""``HFCausalLM(objective=...)`` under ``MegatronCPStrategy``: one accumulated policy step of a tiny Qwen3 and
of a tiny Qwen3.5 text model (Gated DeltaNet beside attention) equals the unsharded ``transformers`` model's,
gradients and logged metrics, against the single-process reference of tests/loss/_policy_reference.py."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Callback, seed_everything
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_cp import MegatronCPFSDPStrategy, MegatronCPStrategy, PolicyObjective
from lightning_cp.data import collate_packed, collate_padded
from lightning_cp.models import HFCausalLM
from tests._trainer import cp_trainer
from tests.hf._models import CONFIGS
from tests.hf.test_hybrid import HYBRIDS
from tests.loss._policy_reference import (
    Rollout,
    completion_logprobs,
    draw_rollouts,
    objective_of_step,
    samples,
)

transformers = pytest.importorskip("transformers")

MICRO_BATCHES, SLOTS = 2, 2  # a step: 2 micro-batches x 2 data-parallel slots
CASES = {
    "qwen3": (
        CONFIGS["qwen3"],
        PolicyObjective(clip_high=0.28, kl_coef=0.1, entropy_coef=0.01, temperature=0.7),
    ),
    "qwen3_5_text": (
        {**HYBRIDS["qwen3_5_text"], "initializer_range": 0.2},
        PolicyObjective(clip_low=0.05, ratio="sequence", aggregation="seq-mean-token-mean", kl_coef=0.05),
    ),
}


def _model(config: dict, state: dict | None = None):
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    if state is not None:
        model.load_state_dict(state)
    return model


def _rollouts(name: str, state: dict) -> list[list[list[Rollout]]]:
    """The step's rollouts, their old log-probs the initial model's at the objective's temperature plus noise."""
    config, objective = CASES[name]
    model = _model(config, state)
    return draw_rollouts(
        lambda ids: model(input_ids=torch.tensor([ids]), use_cache=False).logits[0],
        range(3, config["vocab_size"]),
        MICRO_BATCHES,
        SLOTS,
        temperature=objective.temperature,
        seed=5,
    )


def _batch(rollouts: list[Rollout], packed: bool) -> dict[str, torch.Tensor]:
    return (collate_packed if packed else collate_padded)(samples(rollouts))


def _fit(cp: int, packed: bool) -> dict:
    """Each case's step through the Trainer at (dp, cp) = (world / cp, cp), 2 micro-batches accumulated: its
    gradients and epoch metrics; rank 0 adds the reference of the same initial weights and rollouts."""
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    dp = dist.get_world_size() // cp
    results = {}
    for name, (config, objective) in CASES.items():
        module = HFCausalLM(config, lr=1e-3, objective=objective)
        seed_everything(0)
        module.configure_model()
        initial = copy.deepcopy(module.model.state_dict())
        steps = _rollouts(name, initial)
        # Lightning's sampler gives DP rank r the items r, r + dp, ...: one batch per (micro-batch, rank).
        per_rank = SLOTS // dp
        batches = [
            _batch([r for slot in slots[rank * per_rank : (rank + 1) * per_rank] for r in slot], packed)
            for slots in steps
            for rank in range(dp)
        ]
        loader = DataLoader(batches, batch_size=None, shuffle=False)
        trainer = cp_trainer(
            cp, max_steps=1, accumulate_grad_batches=MICRO_BATCHES, strategy=MegatronCPStrategy(cp=cp)
        )
        trainer.fit(module, loader)
        metrics = {
            key.removeprefix("train/rl/"): value.item()
            for key, value in trainer.callback_metrics.items()
            if key.startswith("train/rl/") and key.endswith(("_step", "_epoch"))
        }
        grads = {n: p.grad.clone() for n, p in module.model.named_parameters() if p.grad is not None}
        results[name] = {"metrics": metrics, "grads": grads}
        if dist.get_rank() == 0:
            results[name]["expected"] = _reference(name, initial, steps)
    return results


def _reference(name: str, state: dict, steps: list) -> dict:
    config, objective = CASES[name]
    model = _model(config, state)
    rollouts = [r for slots in steps for slot in slots for r in slot]
    logits = [model(input_ids=torch.tensor([r.ids]), use_cache=False).logits[0] for r in rollouts]
    loss, metrics = objective_of_step(rollouts, logits, objective)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return {"metrics": metrics, "grads": grads}


def _check(results: dict) -> None:
    for name, got in results.items():
        want = got["expected"]
        # The step's values (logged at its last micro-batch) and the epoch's (the same single step) are both
        # the whole step's: a step value of the last micro-batch alone would differ.
        expected = {
            key + suffix: value for key, value in want["metrics"].items() for suffix in ("_step", "_epoch")
        }
        assert got["metrics"].keys() == expected.keys(), name
        # The objective (~0.02) is a sum of terms of both signs: absolute round-off ~2e-7, a 1% error 2e-4.
        for key, value in expected.items():
            assert got["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), f"{name}: {key}"
        assert got["grads"].keys() == want["grads"].keys(), name
        for key, expected in want["grads"].items():
            error = (got["grads"][key] - expected).norm()
            assert error <= 2e-5 * expected.norm() + 1e-12, (
                f"{name} {key}: {error:.3e} of {expected.norm():.3e}"
            )


def test_dp2_cp2_packed_steps_equal_the_unsharded_models(world4):
    _check(world4.run(_fit, 2, True)[0])


def test_dp1_cp2_padded_steps_equal_the_unsharded_models(world2):
    _check(world2.run(_fit, 2, False)[0])


class _Gradients(Callback):
    """The model's gradients of the step (the module's own hook has rescaled them by then), whole (FSDP's
    shards gathered while the groups live)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.whole = {
            n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
            for n, p in pl_module.model.named_parameters()
            if p.grad is not None
        }


def _fit_with_lora(cp: int, fsdp: bool) -> dict:
    """The qwen3 case's step with LoRA adapters (made non-zero first, so that the policy is not its base) and
    rollouts without ``ref_logprobs``: the reference log-probs are the base model's, adapters off, computed
    in the step. The reference: ``transformers`` + ``peft``'s policy and ``transformers``' base model of the
    same weights, the rollouts' ``ref`` the base's log-probs."""
    peft = pytest.importorskip("peft")
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    config, objective = CASES["qwen3"]
    module = HFCausalLM(config, lr=1e-3, objective=objective, lora={"rank": 4, "alpha": 8.0})
    seed_everything(0)
    module.configure_model()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in module.model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    initial = copy.deepcopy(module.model.state_dict())
    policy = peft.inject_adapter_in_model(
        peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"), _model(config)
    )
    policy.load_state_dict(initial)
    base = _model(config, {k.replace(".base_layer", ""): v for k, v in initial.items() if "lora_" not in k})

    def logits(model, ids):
        return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]

    steps = draw_rollouts(
        lambda ids: logits(policy, ids),
        range(3, config["vocab_size"]),
        MICRO_BATCHES,
        1,
        seed=5,
        temperature=objective.temperature,
    )
    rollouts = [r for slots in steps for slot in slots for r in slot]
    with torch.no_grad():
        for r in rollouts:
            r.ref = completion_logprobs(logits(base, r.ids), r, objective.temperature)[0].tolist()
    batches = [
        collate_padded([{k: v for k, v in s.items() if k != "ref_logprobs"} for s in samples(slots[0])])
        for slots in steps
    ]
    strategy = (MegatronCPFSDPStrategy if fsdp else MegatronCPStrategy)(cp=cp)
    grads = _Gradients()
    trainer = cp_trainer(
        cp, max_steps=1, accumulate_grad_batches=MICRO_BATCHES, strategy=strategy, callbacks=[grads]
    )
    trainer.fit(module, DataLoader(batches, batch_size=None, shuffle=False))
    metrics = {
        key.removeprefix("train/rl/"): value.item()
        for key, value in trainer.callback_metrics.items()
        if key.startswith("train/rl/") and key.endswith(("_step", "_epoch"))
    }
    result = {"metrics": metrics, "grads": grads.whole}
    if dist.get_rank() == 0:
        loss, expected_metrics = objective_of_step(
            rollouts, [logits(policy, r.ids) for r in rollouts], objective
        )
        loss.backward()
        lora = {n: p.grad for n, p in policy.named_parameters() if "lora_" in n}
        result["expected"] = {"metrics": expected_metrics, "grads": lora}
    return {"qwen3-lora": result}


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_with_lora_the_kl_reference_is_the_base_model_computed_in_the_step(world2, fsdp):
    """No ``ref_logprobs`` in the rollouts, no ``predict`` pass: the KL term (its metric and every adapter's
    gradient) is against the base model, as ``peft``'s ``disable_adapter()`` gives it; under FSDP the
    reference's forward (the step's first, without a graph) leaves the adapters trainable."""
    _check(world2.run(_fit_with_lora, 2, fsdp)[0])
