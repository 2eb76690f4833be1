"""CPLossMixin.policy_loss: every objective, at every DP x CP layout, padded or packed, with gradient
accumulation, on a tiny GPT (CP attention included), equals the single-process reference of materialized
logits (tests/loss/_policy_reference.py): loss metrics and every parameter's gradient. A user's registered
loss among them: docs/usage.md's CISPO, run as written there."""

from __future__ import annotations

import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning.pytorch.trainer.states import RunningStage

from lightning_cp import CPLossMixin, PolicyObjective
from lightning_cp.data import collate_packed, collate_padded
from lightning_cp.loss import AggregationWeights, PolicyLossTerms, register_aggregation, register_policy_loss
from lightning_cp.models import GPT, GPTConfig
from lightning_cp.parallel import groups, shard_batch
from lightning_cp.parallel.layout import set_current_layout
from tests.loss._policy_reference import Rollout, draw_rollouts, objective_of_step, samples

VOCAB, HIDDEN = 24, 16


def _documented_objective() -> PolicyObjective:
    """docs/usage.md's "Your own policy loss" example, run as written: it registers ``"cispo"`` (here, and in
    every worker process that imports this module) and builds ``objective``."""
    usage = (Path(__file__).resolve().parents[2] / "docs" / "usage.md").read_text()
    section = usage[usage.index("## Your own policy loss") :]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    namespace = {"__name__": "docs.usage"}
    exec(compile(code, "docs/usage.md", "exec"), namespace)  # noqa: S102 (the documented code, as written)
    return namespace["objective"]


def _cispo_reference(ratio, logp, advantage, low, high):
    """CISPO from its paper's formula: ``-sg(clip(r_t)) * A * logp_t``, clipped where ``r_t`` leaves the bounds."""
    weight = ratio.detach()
    return -weight.clamp(low, high) * advantage * logp, ((weight < low) | (weight > high)).float()


REFERENCE_LOSSES = {"cispo": _cispo_reference}
"""The reference's policy loss for each registered one (the clipped surrogate is built into it)."""
MICRO_BATCHES, SLOTS = 2, 4  # a step: 2 micro-batches x 4 data-parallel slots (dp ranks take slots evenly)

OBJECTIVES = {
    # GRPO with DAPO's clip-higher, k3 KL and an entropy bonus, sampled at temperature 0.7.
    "grpo": PolicyObjective(clip_high=0.28, kl_coef=0.1, entropy_coef=0.01, temperature=0.7),
    # GSPO: the sequence's ratio, one term per sequence; tight clips as GSPO uses (scaled to this noise).
    "gspo": PolicyObjective(
        clip_low=0.05,
        clip_high=0.08,
        ratio="sequence",
        aggregation="seq-mean-token-mean",
        kl_coef=0.05,
        kl_estimator="k1",
    ),
    # Dr. GRPO: sums over each completion, over sequences x the largest completion length.
    "dr-grpo": PolicyObjective(
        aggregation="seq-mean-token-sum",
        token_normalizer=12,
        kl_coef=0.02,
        kl_estimator="k2",
        entropy_coef=0.02,
    ),
    # The sequence ratio under a token mean (GSPO-token), at temperature 1.3, no KL term but its metric.
    "gspo-token-mean": PolicyObjective(ratio="sequence", clip_low=0.03, temperature=1.3),
    # Per-sequence token means with the token ratio, on-policy (no old log-probs: every ratio is 1).
    "on-policy-seq-mean": PolicyObjective(aggregation="seq-mean-token-mean", entropy_coef=0.05),
    # A user's loss (registered by the documented example): the frame's CP sums serve it unchanged.
    "cispo": _documented_objective(),
}
ON_POLICY = {"on-policy-seq-mean"}


class _Policy(CPLossMixin, LightningModule):
    log_tokens_per_sec = False

    def __init__(self):
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.gpt = GPT(GPTConfig(vocab_size=VOCAB, n_layer=1, n_head=2, n_embd=HIDDEN))
        self.head = self.gpt.lm_head_weight
        self.logged: dict = {}

    def log(self, name, value, **kwargs):
        self.logged[name] = value

    def hidden(self, batch):
        """``[B, S_local, H]`` of a sharded batch: CP attention over the shard's group."""
        return self.gpt(batch["input_ids"], batch["position_ids"], cp_shard=batch["cp_shard"])

    def logits(self, ids):
        """``[L, V]`` logits of one whole sequence, on one process."""
        return self.gpt(torch.tensor([ids]), torch.arange(len(ids))[None])[0] @ self.head.T

    def grads(self):
        return {name: param.grad.clone() for name, param in self.named_parameters()}


def _rollouts(on_policy: bool) -> list[list[list[Rollout]]]:
    """The step's rollouts, their old log-probs the initial policy's (temperature 1) plus noise."""
    module = _Policy()
    return draw_rollouts(
        module.logits,
        range(VOCAB),
        MICRO_BATCHES,
        SLOTS,
        on_policy=on_policy,
    )


def _objective_of_step(rollouts: list[Rollout], logits: list[torch.Tensor], objective: PolicyObjective):
    """The reference's objective and metrics, with the reference's version of a registered loss."""
    return objective_of_step(rollouts, logits, objective, REFERENCE_LOSSES.get(objective.loss))


def _reference(name: str) -> tuple[dict, torch.Tensor, torch.Tensor]:
    objective = OBJECTIVES[name]
    module = _Policy()
    rollouts = [r for slots in _rollouts(name in ON_POLICY) for slot in slots for r in slot]
    loss, metrics = _objective_of_step(rollouts, [module.logits(r.ids) for r in rollouts], objective)
    loss.backward()
    return metrics, module.grads()


def _sharded(cp: int, packed: bool, names: list[str]) -> dict:
    """Each objective's step on this rank: its micro-batches sharded, the loss divided by the accumulation as
    Lightning does, the mixin's rescale, DDP's mean over DP x CP; the logged metrics' values of the step."""
    layout = groups.initialize(tp=1, cp=cp)
    set_current_layout(layout)
    out = {}
    for name in names:
        module = _Policy()
        module._trainer = SimpleNamespace(training=True, state=SimpleNamespace(stage=RunningStage.TRAINING))
        per_rank = SLOTS // layout.dp
        for slots in _rollouts(name in ON_POLICY):
            mine = [
                r for slot in slots[layout.dp_rank * per_rank : (layout.dp_rank + 1) * per_rank] for r in slot
            ]
            mine_samples = samples(mine)
            batch = shard_batch(
                collate_packed(mine_samples) if packed else collate_padded(mine_samples),
                cp,
                layout.cp_rank,
                cp_group=layout.cp_group,
            )
            loss = module.policy_loss(module.hidden(batch), module.head, batch, OBJECTIVES[name])
            (loss / MICRO_BATCHES).backward()
        module._cp_objective.rescale_gradients(module.parameters(), MICRO_BATCHES)
        for param in module.parameters():
            dist.all_reduce(param.grad, group=layout.loss_group)
            param.grad /= layout.dp * cp
        metrics = {
            key.removeprefix("train/rl/").removesuffix("_epoch"): value.compute().item()
            for key, value in module.logged.items()
            if key.endswith("_epoch")
        }
        out[name] = (metrics, module.grads())
    set_current_layout(None)
    groups.destroy()
    return out


def _assert_matches(got: dict, name: str, reference: tuple) -> None:
    metrics, grads = got[name]
    ref_metrics, ref_grads = reference
    assert metrics.keys() == ref_metrics.keys(), name
    for key, value in ref_metrics.items():
        assert metrics[key] == pytest.approx(value, rel=1e-6, abs=1e-8), f"{name}: {key}"
    assert grads.keys() == ref_grads.keys()
    for key, expected in ref_grads.items():
        where = f"{name} {key}"
        torch.testing.assert_close(
            grads[key], expected, rtol=1e-5, atol=1e-7, msg=lambda m, w=where: f"{w}: {m}"
        )


@pytest.fixture(scope="module")
def references() -> dict:
    return {name: _reference(name) for name in OBJECTIVES}


def test_the_cases_reach_every_branch(references):
    """Clipping both taken and not, ratios away from 1 (but for the on-policy case), a KL that is not 0."""
    for name, (metrics, _) in references.items():
        if name in ON_POLICY:
            assert metrics["ratio_mean"] == pytest.approx(1.0) and metrics["clip_fraction"] == 0.0
            continue
        assert 0.1 < metrics["clip_fraction"] < 0.9, name
        assert abs(metrics["ratio_mean"] - 1) > 1e-3 and metrics["kl"] > 1e-3, name


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("cp", [2, 4], ids=["dp2-cp2", "dp1-cp4"])
def test_every_objective_is_exact_on_four_ranks(world4, references, cp, packed):
    for got in world4.run(_sharded, cp, packed, list(OBJECTIVES)):
        for name in OBJECTIVES:
            _assert_matches(got, name, references[name])


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_every_objective_is_exact_at_dp1_cp2(world2, references, packed):
    for got in world2.run(_sharded, 2, packed, list(OBJECTIVES)):
        for name in OBJECTIVES:
            _assert_matches(got, name, references[name])


def test_the_loss_outside_training_is_the_global_objective(world2, references):
    """Evaluation (no trainer, no gradient): every rank returns the whole batch's objective."""
    assert math.isfinite(references["grpo"][0]["loss"])
    for losses in world2.run(_evaluation_losses):
        for name, loss in losses.items():
            assert loss == pytest.approx(_single_batch_reference(name), rel=1e-5), name


def _single_batch_reference(name: str) -> float:
    module = _Policy()
    rollouts = [r for slot in _rollouts(name in ON_POLICY)[0] for r in slot]
    return _objective_of_step(rollouts, [module.logits(r.ids) for r in rollouts], OBJECTIVES[name])[0].item()


def _evaluation_losses() -> dict:
    layout = groups.initialize(tp=1, cp=2)
    set_current_layout(layout)
    out = {}
    for name, objective in OBJECTIVES.items():
        module = _Policy()
        batch = collate_packed(samples([r for slot in _rollouts(name in ON_POLICY)[0] for r in slot]))
        batch = shard_batch(batch, 2, layout.cp_rank, cp_group=layout.cp_group)
        with torch.no_grad():
            out[name] = module.policy_loss(module.hidden(batch), module.head, batch, objective).item()
    set_current_layout(None)
    groups.destroy()
    return out


def test_a_kl_term_without_reference_log_probs_and_a_batch_without_advantages_are_refused():
    module = _Policy()
    unreferenced = samples([r for slot in _rollouts(False)[0] for r in slot])
    for sample in unreferenced:
        del sample["ref_logprobs"]
    batch = shard_batch(collate_packed(unreferenced), 1, 0)
    hidden = module.hidden(batch)
    with pytest.raises(ValueError, match=r"kl_coef=0.1\) needs the reference model's log-probs"):
        module.policy_loss(hidden, module.head, batch, OBJECTIVES["grpo"])
    del batch["advantages"]
    with pytest.raises(ValueError, match="needs a sharded rollout batch with 'advantages'"):
        module.policy_loss(hidden, module.head, batch, PolicyObjective())


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"clip_low": 1.0}, r"clip_low=1.0\) must be in \[0, 1\)"),
        ({"clip_high": -0.1}, "clip_high=-0.1"),
        ({"ratio": "document"}, "ratio='document'"),
        ({"kl_estimator": "k4"}, "kl_estimator='k4'"),
        ({"aggregation": "mean"}, "aggregation='mean'"),
        ({"kl_coef": float("nan")}, "kl_coef=nan"),
        ({"entropy_coef": -1.0}, "entropy_coef=-1.0"),
        ({"token_normalizer": 0.0}, "token_normalizer=0.0"),
        ({"token_normalizer": 4096.0}, "only applies to aggregation='seq-mean-token-sum'"),
        ({"temperature": 0.0}, "temperature=0.0"),
    ],
)
def test_an_objective_that_makes_no_sense_is_refused(options, match):
    with pytest.raises(ValueError, match=match):
        PolicyObjective(**options)


def _collectives() -> dict:
    """The all-reduces (and their elements) of lm_loss and of policy_loss on the same packed batch at cp = 2."""
    layout = groups.initialize(tp=1, cp=2)
    set_current_layout(layout)
    module = _Policy()
    rollouts = [r for slot in _rollouts(False)[0] for r in slot]
    batch = shard_batch(collate_packed(samples(rollouts)), 2, layout.cp_rank, cp_group=layout.cp_group)
    hidden = module.hidden(batch)
    calls = {}
    all_reduce = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls[name].append(tensor.numel())
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        for name, loss in (
            ("lm", lambda: module.lm_loss(hidden, module.head, batch)),
            ("policy", lambda: module.policy_loss(hidden, module.head, batch, OBJECTIVES["gspo"])),
        ):
            calls[name] = []
            loss()
    finally:
        dist.all_reduce = all_reduce
        set_current_layout(None)
        groups.destroy()
    return {"calls": calls, "sequences": len(rollouts)}


def test_the_policy_step_communicates_the_lm_step_s_scalars_and_two_numbers_per_sequence(world2):
    """Under CP the policy loss adds one all-reduce of 2 numbers per sequence (over the CP group) to the LM
    loss's two scalars over DP x CP (the head's own collectives aside: none here)."""
    for got in world2.run(_collectives):
        assert got["calls"]["lm"] == [2]
        assert sorted(got["calls"]["policy"]) == [2, 2 * got["sequences"]]


def test_a_step_value_covers_every_micro_batch_of_its_optimizer_step():
    """The step value logged at the step's last micro-batch is the whole optimizer step's, and starts over after
    it; the epoch value covers every step."""
    module = _Policy()
    module._trainer = SimpleNamespace(
        training=True, state=SimpleNamespace(stage=RunningStage.TRAINING), accumulate_grad_batches=2
    )
    first, second = ([r for slot in slots for r in slot] for slots in _rollouts(False))
    epoch = []
    for step in ([first, second], [second, second]):
        for micro_batch in step:
            batch = shard_batch(collate_packed(samples(micro_batch)), 1, 0)
            module.policy_loss(module.hidden(batch), module.head, batch, OBJECTIVES["grpo"])
        module.on_before_optimizer_step(None)
        rollouts = [r for micro_batch in step for r in micro_batch]
        epoch += rollouts
        for name, expected in _reference_metrics(module, rollouts).items():
            got = module.logged[f"train/rl/{name}_step"].item()
            assert got == pytest.approx(expected, rel=1e-6, abs=1e-8), (len(epoch), name)
    for name, expected in _reference_metrics(module, epoch).items():
        assert module.logged[f"train/rl/{name}_epoch"].compute().item() == pytest.approx(
            expected, rel=1e-6, abs=1e-8
        )


def _reference_metrics(module: _Policy, rollouts: list[Rollout]) -> dict[str, float]:
    with torch.no_grad():
        return _objective_of_step(rollouts, [module.logits(r.ids) for r in rollouts], OBJECTIVES["grpo"])[1]


def _loss_and_reference(
    objective: PolicyObjective,
    on_policy: bool = False,
    untrained: list[Rollout] = (),
    reference: PolicyObjective | None = None,
) -> tuple[float, float]:
    """One packed micro-batch's objective from ``policy_loss`` (evaluation, one process), with the
    ``untrained`` rollouts (no completion: no target) among its sequences, and the reference's without them
    (of ``reference``, default ``objective``)."""
    module = _Policy()
    rollouts = [r for slot in _rollouts(on_policy)[0] for r in slot]
    batch = shard_batch(collate_packed(samples([*untrained, *rollouts])), 1, 0)
    with torch.no_grad():
        loss = module.policy_loss(module.hidden(batch), module.head, batch, objective).item()
        logits = [module.logits(r.ids) for r in rollouts]
        return loss, _objective_of_step(rollouts, logits, reference or objective)[0].item()


def test_a_zero_upper_clip_is_a_bound_not_the_default():
    """clip_high=0.0 clips every ratio above 1 (read as unset, it would be clip_low's 0.2)."""
    zero = PolicyObjective(clip_high=0.0, kl_coef=0.1)
    loss, expected = _loss_and_reference(zero)
    assert loss == pytest.approx(expected, rel=1e-5)
    assert expected != pytest.approx(_loss_and_reference(PolicyObjective(kl_coef=0.1))[1], rel=1e-2)


@pytest.mark.parametrize("name", ["gspo", "dr-grpo", "on-policy-seq-mean"])
def test_a_sequence_without_targets_counts_in_no_normalizer(name):
    """A sequence-mean counts the sequences that have a target: a prompt without completion (or a data-parallel
    rank's padding) leaves the objective as it is without it."""
    on_policy = name in ON_POLICY
    old = None if on_policy else []
    untrained = [Rollout([5, 6, 7], [], 0.0, old, []), Rollout([8], [], 0.0, old, [])]
    loss, expected = _loss_and_reference(OBJECTIVES[name], on_policy, untrained)
    assert loss == pytest.approx(expected, rel=1e-5)


@register_aggregation("test-sequence-sum")
def _sequence_sum(inputs, objective):
    """Dr. GRPO's aggregation with a token normalizer of 1, written as a user would."""
    return AggregationWeights(inputs.valid.float(), inputs.sequence_count)


def test_a_registered_aggregation_weighs_and_normalizes_the_objective():
    objective = PolicyObjective(aggregation="test-sequence-sum", kl_coef=0.1)
    dr_grpo = PolicyObjective(aggregation="seq-mean-token-sum", kl_coef=0.1)
    loss, expected = _loss_and_reference(objective, reference=dr_grpo)
    assert loss == pytest.approx(expected, rel=1e-5)
    assert expected != pytest.approx(_loss_and_reference(PolicyObjective(kl_coef=0.1))[1], rel=1e-2)


@pytest.mark.parametrize(
    ("options", "registered", "register"),
    [
        ({"loss": "grpo"}, "'ppo', ", "register_policy_loss"),
        (
            {"aggregation": "mean"},
            "'token-mean', 'seq-mean-token-mean', 'seq-mean-token-sum', ",
            "register_aggregation",
        ),
    ],
    ids=["loss", "aggregation"],
)
def test_an_unregistered_name_is_one_line_that_lists_the_registered_ones(options, registered, register):
    with pytest.raises(ValueError, match=f"{next(iter(options))}='") as error:
        PolicyObjective(**options)
    message = str(error.value)
    assert "\n" not in message and registered in message and f"lightning_cp.loss.{register}" in message


def test_a_name_registered_to_another_function_is_refused_and_the_same_function_again_is_not():
    with pytest.raises(
        ValueError, match=r"policy loss 'ppo' is already registered \(lightning_cp\.loss\.policy_re"
    ):
        register_policy_loss("ppo")(lambda tokens, objective: None)
    with pytest.raises(ValueError, match="'token-mean' is already registered"):
        register_aggregation("token-mean")(_sequence_sum)
    assert register_aggregation("test-sequence-sum")(_sequence_sum) is _sequence_sum
    with pytest.raises(
        ValueError, match=r"token_normalizer=12\) only applies to aggregation='seq-mean-token-sum',"
    ):
        PolicyObjective(aggregation="test-sequence-sum", token_normalizer=12)


@register_policy_loss("test-sequence-total")
def _one_value(tokens, objective):
    """A mistake: one value for the whole batch instead of one per token."""
    return PolicyLossTerms(-(tokens.advantages * tokens.logprobs).sum())


def test_a_registered_loss_without_a_value_per_token_is_refused():
    with pytest.raises(
        ValueError, match=r"loss='test-sequence-total'\) returned loss of shape \(\); it must give"
    ):
        _loss_and_reference(PolicyObjective(loss="test-sequence-total"))
