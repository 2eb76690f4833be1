"""The setup's checks and probe (``lightning_cp.hf.check_models``: the ``transformers`` integration's setup steps
in one call): what they refuse, what they name, what they leave.

Distributed cases run at cp = 2 on the shared gloo pool; the families themselves are in
``tests/hf/test_families.py``. Here each branch is driven by a small change to a tiny Llama.
"""

import pytest
import torch
from torch import nn

from lightning_cp.hf import check_models, output_head
from lightning_cp.hf.check import check_config_is_context_parallel
from lightning_cp.ops import OutputHead
from lightning_cp.parallel import groups
from lightning_cp.parallel.layout import ParallelLayout, set_current_layout
from tests.hf._families import tiny_config, transformers
from tests.hf._models import build


class TokenMixer(nn.Module):
    """A per-layer MLP replaced by a running mean over the sequence: exact alone, wrong on a shard."""

    def forward(self, x):
        return x.cumsum(1) / torch.arange(1, x.shape[1] + 1).view(1, -1, 1)


class RefusesTheShard(nn.Module):
    """A decoder layer that fails when given the batch's shard (the model alone runs)."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, *args, **kwargs):
        if kwargs.get("cp_shard") is not None:
            raise RuntimeError("this layer cannot run on a shard\nsecond line")
        return self.layer(*args, **kwargs)


class LearnedScaleHead(nn.Linear):
    """An LM head with a learned per-token logit scale that starts at 1 (as transformers 5.24's Dory has):
    the model's logits equal the plain head's at initialization, but the scale must train."""

    def __init__(self, linear):
        super().__init__(linear.in_features, linear.out_features, bias=False)
        self.weight = linear.weight
        self.logit_scale = nn.Parameter(torch.ones(linear.out_features))

    def forward(self, hidden):
        return super().forward(hidden) * self.logit_scale


def _llama(change):
    torch.manual_seed(0)
    model = build("llama", "lightning_cp")
    if change == "mixing mlp":
        model.model.layers[1].mlp = TokenMixer()
    elif change == "scaled logits":
        model.lm_head.register_forward_hook(lambda module, args, out: out * 2.0)
    elif change == "learned head scale":
        model.lm_head = LearnedScaleHead(model.lm_head)
    elif change == "crash":
        model.model.layers[0] = RefusesTheShard(model.model.layers[0])
    elif change == "rank weights":
        with torch.no_grad():  # as an unseeded init would: other weights on every rank
            model.model.layers[0].mlp.up_proj.weight.add_(torch.distributed.get_rank())
    return model


def _check(change, cp=2):
    """The setup check of a LightningModule-like container holding the changed Llama, on every rank."""
    layout = groups.initialize(tp=1, cp=cp)
    set_current_layout(layout)
    holder = nn.ModuleDict({"llm": _llama(change)})
    try:
        check_models(holder, layout, torch.device("cpu"))
    except ValueError as error:
        return str(error)
    finally:
        set_current_layout(None)
    return {k: v.clone() for k, v in holder.state_dict().items()}


def test_a_module_mixing_tokens_outside_attention_is_refused_by_name(world2):
    for message in world2.run(_check, "mixing mlp"):
        assert "llm (LlamaForCausalLM): layers.1.mlp (TokenMixer) gives other outputs" in message
        assert "cp=2" in message and "train it with cp=1" in message


def test_a_crash_on_the_shard_is_a_refusal_with_its_first_line(world2):
    for message in world2.run(_check, "crash"):
        assert "fails on a batch sharded for context parallelism (cp=2)" in message
        assert "RuntimeError: this layer cannot run on a shard" in message and "second line" not in message


def test_weights_that_differ_between_cp_ranks_are_rank_0_s_before_the_probe(world2):
    states = world2.run(_check, "rank weights")  # a probe of unequal weights would refuse
    assert all(isinstance(state, dict) for state in states)
    for key, value in states[0].items():
        assert torch.equal(states[1][key], value), key


def test_at_dp2_cp2_each_cp_group_takes_its_own_first_rank_s_weights(world4):
    """Global ranks (0, 1) and (2, 3) are the two CP groups: each takes the weights of its own first rank
    (DDP's broadcast over DP x CP follows the probe), never global rank 0's, which the second group lacks."""
    states = world4.run(_check, "rank weights")
    assert all(isinstance(state, dict) for state in states), states
    changed = "llm.model.layers.0.mlp.up_proj.weight"
    difference = states[2][changed] - states[0][changed]  # rank 2 added 2, rank 0 nothing
    torch.testing.assert_close(difference, torch.full_like(difference, 2.0), rtol=0, atol=1e-6)
    for first, second in ((0, 1), (2, 3)):
        for key, value in states[first].items():
            assert torch.equal(states[second][key], value), (second, key)


@pytest.mark.parametrize("cp", [1, 2])
def test_logits_the_loss_would_not_compute_are_refused_on_any_cp(world2, cp):
    for message in world2.run(_check, "scaled logits", cp):
        assert "llm (LlamaForCausalLM): its logits are not what the fused loss computes" in message


@pytest.mark.parametrize("cp", [1, 2])
def test_a_head_with_parameters_of_its_own_is_refused_though_its_logits_match_at_init(world2, cp):
    for message in world2.run(_check, "learned head scale", cp):
        assert (
            "llm (LlamaForCausalLM): its output embeddings (LearnedScaleHead) are not a plain nn.Linear "
            "(parameters logit_scale)" in message
        )


def test_the_probe_leaves_a_training_model_in_training_and_marks_a_transformed_head():
    torch.manual_seed(0)
    config = tiny_config("cohere", logit_scale=0.125)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="lightning_cp")
    model.train()
    model.model.layers[0].eval()
    check_models(model, ParallelLayout(), torch.device("cpu"))
    assert model.training and not model.model.layers[0].training
    head = output_head(model)
    assert head.logit_scale == 0.125 and head.weight is model.lm_head.weight
    with pytest.raises(ValueError, match=r"CohereForCausalLM \(its logits apply logit_scale=0.125\)"):
        OutputHead.check_bare_weight(model.lm_head.weight)


@pytest.mark.parametrize(
    "model_type, fields, cp, match",
    [
        (
            "llama",
            {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
            2,
            "'dynamic'",
        ),
        ("llama4_text", {}, 2, r"attention_chunk_size=8192"),
        ("llama", {"attention_dropout": 0.1}, 1, r"set attention_dropout=0.0"),
    ],
)
def test_what_a_short_probe_cannot_reach_is_read_from_the_config(model_type, fields, cp, match):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        tiny_config(model_type, **fields), attn_implementation="lightning_cp"
    )
    with pytest.raises(ValueError, match=match):
        check_config_is_context_parallel(model, "llm", cp)


def test_dynamic_rope_is_accepted_without_cp():
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        tiny_config("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
        attn_implementation="lightning_cp",
    )
    check_models(model, ParallelLayout(), torch.device("cpu"))
