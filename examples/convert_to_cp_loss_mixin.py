"""Converting an existing ``LightningModule`` to context parallelism, before and after.

``BeforeLM`` is a typical language-model ``LightningModule``: it builds the ``[B, S, vocab]`` logits with its
LM head, shifts them against the labels itself and calls ``F.cross_entropy``. ``AfterLM`` is the same
model converted to :class:`~lightning_cp.CPLossMixin` and :class:`~lightning_cp.MegatronCPStrategy`. The
changes, all in ``training_step`` and the ``Trainer``:

1. Bases: ``class AfterLM(CPLossMixin, ...)`` with the mixin *first*, so that its ``__init__`` (the metrics)
   and its ``on_before_optimizer_step`` (the gradient-accumulation rescaling) run before Lightning's.
2. No shifting: the strategy shifts ``labels`` to the next token *before* splitting the sequence over the
   CP ranks (after the split a rank no longer has the token that follows its last one) and hands the step
   ``labels``, ``position_ids`` and this rank's ``input_ids``.
3. No logits: ``self.lm_loss(hidden, self.head.weight, batch)`` fuses the head matmul with the loss, chunk
   by chunk, on this rank's tokens; nothing of size ``[tokens, vocab]`` is ever built.
4. The model gets ``batch["position_ids"]`` (a rank's tokens are not contiguous, so positions cannot be
   ``arange``) and the batch's ``cp_shard`` for its attention (the shard carries the CP group).
   ``lightning_cp.models.GPT`` is such a model; in your own, replace
   ``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` with
   ``context_parallel_attention(q, k, v, cp_shard=batch["cp_shard"])``. A Hugging Face model needs
   ``attn_implementation="lightning_cp"`` and ``cp_shard=batch["cp_shard"]`` in its call (see the README).
5. No ``self.log("train/loss", ...)``: the mixin logs ``train/loss`` (the mean over every target token of
   the global batch), perplexity, accuracy and token counts, reduced over all ranks.
6. ``Trainer(strategy=MegatronCPStrategy(cp=...))``.

Parameter names do not change, so existing checkpoints load into the converted class.

Run it (CPU, a few seconds)::

    python examples/convert_to_cp_loss_mixin.py

It trains both for a few steps on one process, from the same weights on the same batch, and prints both
losses: they agree, since the conversion changes where the loss is computed, not its value. On 8
GPUs the same ``AfterLM`` runs with ``Trainer(accelerator="gpu", devices=8, strategy=MegatronCPStrategy(cp=4))``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from lightning_cp import CPLossMixin, MegatronCPStrategy
from lightning_cp.models import GPT, GPTConfig

CONFIG = GPTConfig(vocab_size=64, n_layer=2, n_head=2, n_embd=32)
STEPS = 6


class CopyPrompts(Dataset):
    """Hugging Face-style samples: a random prompt, then the same tokens as the answer.

    ``labels`` are aligned with ``input_ids`` (not shifted) and ``-100`` on the prompt, which is not scored.
    """

    def __init__(self, num_samples: int, prompt_len: int = 12, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        prompts = torch.randint(0, CONFIG.vocab_size, (num_samples, prompt_len), generator=generator)
        self.input_ids = torch.cat([prompts, prompts], dim=1)
        self.labels = self.input_ids.clone()
        self.labels[:, :prompt_len] = -100

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"input_ids": self.input_ids[i], "labels": self.labels[i]}


class BeforeLM(LightningModule):
    """The existing module: full logits, its own shift, ``F.cross_entropy``."""

    def __init__(self, config: GPTConfig = CONFIG, lr: float = 1e-2) -> None:
        super().__init__()
        self.body = GPT(config)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lr = lr

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        input_ids, labels = batch["input_ids"], batch["labels"]
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        hidden = self.body(input_ids, positions)
        logits = self.head(hidden)  # [B, S, vocab]: at 128K tokens x 152K vocab this alone is ~37 GiB in bf16
        loss = F.cross_entropy(
            logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()
        )  # token t predicts t + 1
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


# In your code you edit the class in place; subclassing here keeps what does not change written once.
class AfterLM(CPLossMixin, BeforeLM):  # CHANGE 1: the mixin first
    """The converted module: this rank's tokens, fused head + loss, no shift, no logits."""

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        # CHANGE 2 and 4: `batch` is this CP rank's shard, with next-token labels and true positions.
        hidden = self.body(batch["input_ids"], batch["position_ids"], cp_shard=batch["cp_shard"])
        # CHANGE 3 and 5: no logits, no shift, no self.log; the loss is normalized over the global batch.
        return self.lm_loss(hidden, self.head.weight, batch)


class LossHistory(Callback):
    """Collects a logged loss after every training step."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: object) -> None:
        self.losses.append(trainer.callback_metrics[self.key].item())


def _train(module: LightningModule, key: str, **trainer_kwargs: object) -> list[float]:
    history = LossHistory(key)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[history],
        **trainer_kwargs,
    )
    # One batch of 8 samples, fitted for STEPS steps: under the strategy Lightning's distributed sampler
    # shuffles the training samples, and inside one batch the order does not change the loss.
    trainer.fit(module, DataLoader(CopyPrompts(num_samples=8), batch_size=8))
    return history.losses


def main() -> None:
    torch.manual_seed(0)
    before = BeforeLM()
    after = AfterLM()
    after.load_state_dict(before.state_dict())  # same parameter names: old checkpoints load unchanged

    before_losses = _train(before, "train/loss")
    # CHANGE 6: the strategy (cp=1 on this one process; cp=4 on 8 GPUs shards every sequence over 4 ranks).
    after_losses = _train(after, "train/loss_step", strategy=MegatronCPStrategy(cp=1))

    print("step  before: F.cross_entropy(logits)  after: CPLossMixin.lm_loss")
    for step, (old, new) in enumerate(zip(before_losses, after_losses)):
        print(f"{step:>4}  {old:>29.6f}  {new:>29.6f}")
    gap = max(abs(old - new) for old, new in zip(before_losses, after_losses))
    print(f"max |before - after| over {STEPS} steps: {gap:.2e}")


if __name__ == "__main__":
    main()
