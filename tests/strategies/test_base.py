"""What both strategies do around the model (``MegatronCPBase``): the batches are sharded with the configured
CP attention (checked by the collectives that ran), and under CP a training step whose model never reached
the other ranks through the batch's shard is refused, under DDP and under FSDP alike."""

import inspect
from collections import Counter

import pytest
import torch
from lightning.pytorch import LightningModule, seed_everything
from torch import nn
from torch.utils.data import DataLoader

from lightning_cp import CPLossMixin, MegatronCPFSDPStrategy, MegatronCPStrategy
from lightning_cp.data import LongRangeCopyDataset, collate_padded
from lightning_cp.models import GPTConfig, GPTModule
from lightning_cp.parallel import context_parallel_attention
from lightning_cp.strategies.base import MegatronCPBase
from tests._trainer import cp_trainer
from tests.parallel._collectives import kinds, recorded_collectives

VOCAB, HEADS, DIM = 32, 2, 8
STRATEGIES = {"ddp": MegatronCPStrategy, "fsdp": MegatronCPFSDPStrategy}


class _OwnAttention(CPLossMixin, LightningModule):
    """A user's own model: one causal attention layer of its own and the fused loss; ``pass_shard=False``
    forgets to give the attention the batch's shard."""

    def __init__(self, pass_shard: bool) -> None:
        super().__init__()
        self.pass_shard = pass_shard
        self.embed = nn.Embedding(VOCAB, HEADS * DIM)
        self.qkv = nn.Linear(HEADS * DIM, 3 * HEADS * DIM)
        self.head = nn.Linear(HEADS * DIM, VOCAB, bias=False)

    def training_step(self, batch, batch_idx):
        x = self.embed(batch["input_ids"])
        rows, length = x.shape[:2]
        q, k, v = self.qkv(x).view(rows, length, 3, HEADS, DIM).permute(2, 0, 3, 1, 4)
        shard = batch["cp_shard"] if self.pass_shard else None
        out = context_parallel_attention(q, k, v, cp_shard=shard).transpose(1, 2).flatten(2)
        return self.lm_loss(x + out, self.head.weight, batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit_own_model(strategy: str, pass_shard: bool) -> str | None:
    """Two steps at cp = 2; the error every rank raised, or None."""
    seed_everything(0)
    data = LongRangeCopyDataset(num_samples=4, seq_len=12, vocab_size=VOCAB, seed=0)
    trainer = cp_trainer(2, strategy=STRATEGIES[strategy](cp=2), max_steps=2)
    try:
        trainer.fit(_OwnAttention(pass_shard), DataLoader(data, batch_size=2, collate_fn=collate_padded))
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_model_that_never_gives_its_attention_the_shard_is_refused_on_every_rank(world2, strategy):
    for message in world2.run(_fit_own_model, strategy, False):
        assert message is not None and "\n" not in message
        assert message.startswith("_OwnAttention.training_step ran under cp=2 but no layer reached")
        assert 'pass cp_shard=batch["cp_shard"] to the model' in message
    assert world2.run(_fit_own_model, strategy, True) == [None, None]


MODES = {  # the strategy's arguments, and the collectives of one step of a one-layer GPT with 2 heads at cp = 2
    "allgather": ({}, {"all_gather": 2, "reduce_scatter": 1}),
    "allgather-by-head": (
        {"cp_attention": "allgather", "kv_heads_per_gather": 1},
        {"all_gather": 4, "reduce_scatter": 2},
    ),
    "ulysses": ({"cp_attention": "ulysses"}, {"all_to_all": 4}),
    "auto": ({"cp_attention": "auto"}, {"all_to_all": 4}),  # the 2 heads split over cp = 2: Ulysses
}
"""One forward and backward: the all-gather gathers K/V in the forward and again in the backward, then
reduce-scatters their gradients, once per round; Ulysses exchanges to the heads and back, each way twice."""


def _collectives_of_one_step(arguments: dict) -> Counter:
    seed_everything(0)
    module = GPTModule(GPTConfig(vocab_size=VOCAB, n_layer=1, n_head=2, n_embd=16))
    data = LongRangeCopyDataset(num_samples=2, seq_len=12, vocab_size=VOCAB, seed=0)
    trainer = cp_trainer(2, strategy=MegatronCPStrategy(cp=2, **arguments), max_steps=1)
    with recorded_collectives() as calls:
        trainer.fit(module, DataLoader(data, batch_size=2, collate_fn=collate_padded))
    return Counter(kinds(calls))


@pytest.mark.parametrize("mode", MODES)
def test_the_batches_are_sharded_with_the_configured_attention(world2, mode):
    """Every mode gives the same numbers: what shows the strategy passed its cp_attention and
    kv_heads_per_gather on to the batches' shards is the collectives the attention ran."""
    arguments, expected = MODES[mode]
    assert world2.run(_collectives_of_one_step, arguments) == [Counter(expected)] * 2


def test_ulysses_with_key_value_heads_per_gather_is_refused_at_construction():
    with pytest.raises(
        ValueError, match=r"MegatronCPStrategy: kv_heads_per_gather=2 .* cp_attention='ulysses'"
    ):
        MegatronCPStrategy(cp=2, cp_attention="ulysses", kv_heads_per_gather=2)


def test_every_shared_argument_is_documented_in_each_strategy():
    """The shared arguments are declared once (MegatronCPBase) and described there; each strategy's Args
    names every one of the package's own (a new one forgotten in a subclass's docstring fails here)."""
    shared = [
        name
        for name, parameter in inspect.signature(MegatronCPBase.__init__).parameters.items()
        if name != "self" and parameter.kind is not parameter.VAR_KEYWORD
    ]
    for name in shared:
        assert f"\n        {name}: " in MegatronCPBase.__doc__, name
    own = shared[: shared.index("kv_heads_per_gather") + 1]
    assert own == [
        "cp",
        "tp",
        "activation_checkpointing",
        "offload_activations",
        "cp_attention",
        "kv_heads_per_gather",
    ]
    for strategy in STRATEGIES.values():
        args = strategy.__doc__.split("Args:")[1].split("Raises:")[0]
        assert all(f"``{name}``" in args for name in own), strategy.__name__
