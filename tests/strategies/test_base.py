"""What both strategies do around the model (``MegatronCPBase``): under CP, a training step whose model
never reached the other ranks through the batch's shard is refused, under DDP and under FSDP alike."""

import pytest
import torch
from lightning.pytorch import LightningModule, seed_everything
from torch import nn
from torch.utils.data import DataLoader

from lightning_cp import CPLossMixin, MegatronCPFSDPStrategy, MegatronCPStrategy
from lightning_cp.data import LongRangeCopyDataset, collate_padded
from lightning_cp.parallel import context_parallel_attention
from tests._trainer import cp_trainer

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
