"""A mixture of experts trained with ``HFCausalLM(tiled=True)`` under CP: the same training as the untiled,
unsharded ``transformers`` model, its load-balancing loss included.

The reference is ``transformers``' own loss with ``output_router_logits=True`` (the cross-entropy plus
``router_aux_loss_coef`` times the load-balancing loss of the whole batch) in a plain single-process loop.
"""

from unittest import mock

import pytest
import torch
from lightning.pytorch import Callback, seed_everything
from torch.utils.data import DataLoader, DistributedSampler

from lightning_cp import MegatronCPStrategy
from lightning_cp.adaptation import applied
from lightning_cp.data import LongRangeCopyDataset, collate_padded
from lightning_cp.memory import tiling
from lightning_cp.models import HFCausalLM
from tests._trainer import cp_trainer
from tests.hf import _matrix
from tests.hf.support_table import Outcome

transformers = pytest.importorskip("transformers")

VOCAB = 61
BATCH = 4
STEPS = 2
LR = 1e-2
CONFIG = {
    "model_type": "qwen3_moe",
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "output_router_logits": True,
    "router_aux_loss_coef": 0.5,
}


def _data():
    # Every row whole (no padding), so the reference's load-balancing loss counts the same tokens.
    return LongRangeCopyDataset(num_samples=BATCH * STEPS, seq_len=24, vocab_size=VOCAB, seed=5)


def _reference():
    """Per-step cross-entropy and the first step's gradients of the untiled model trained on its own loss
    (with the load-balancing term)."""
    seed_everything(0)
    config = transformers.AutoConfig.for_model(**CONFIG)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
    losses, grads = [], {}
    # Lightning's training sampler shuffles with seed 0, the same permutation for any number of replicas.
    sampler = DistributedSampler(_data(), num_replicas=1, rank=0, shuffle=True, seed=0)
    for batch in DataLoader(_data(), batch_size=BATCH, sampler=sampler, collate_fn=collate_padded):
        labels = torch.where(batch["loss_mask"].bool(), batch["input_ids"], -100)
        out = model(input_ids=batch["input_ids"], labels=labels)
        assert float(out.aux_loss) > 0
        optimizer.zero_grad()
        out.loss.backward()
        grads = grads or {name: p.grad.clone() for name, p in model.named_parameters()}
        optimizer.step()
        losses.append(out.loss.item() - CONFIG["router_aux_loss_coef"] * out.aux_loss.item())
    return losses, grads


class _Record(Callback):
    """Every step's logged loss, and the first step's gradients (summed over the ranks by DDP)."""

    def __init__(self):
        self.losses, self.grads = [], {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        prefix = "model."
        if not self.grads:
            self.grads = {n[len(prefix) :]: p.grad.clone() for n, p in pl_module.named_parameters()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(trainer.callback_metrics["train/loss_step"].item())


def _fit_tiled(cp):
    """dp1 x cp: the tiled model's per-step cross-entropy and first gradients, tiles of 5 tokens."""
    module = HFCausalLM(CONFIG, lr=LR, tiled=True)
    seed_everything(0)
    module.configure_model()
    assert "tiling" in applied(module.model.model.layers[0].mlp.experts)
    recorder = _Record()
    trainer = cp_trainer(cp, max_steps=STEPS, callbacks=[recorder], strategy=MegatronCPStrategy(cp=cp))
    loader = DataLoader(_data(), batch_size=BATCH, collate_fn=collate_padded)
    with mock.patch.object(tiling, "auto_tile_tokens", lambda tokens, dim: 5):  # several tiles a rank
        trainer.fit(module, loader)
    return recorder.losses, recorder.grads


def test_dp1_cp2_tiled_experts_train_as_the_untiled_unsharded_model(world2):
    """The losses of two steps, and every gradient of the first (the routers' through the load-balancing
    loss and the tiles' routing weights). (Adam's first steps turn round-off-sized gradients of the
    rarely routed experts into whole steps, so the weights are not what is compared.)"""
    losses, grads = world2.run(_fit_tiled, 2)[0]
    want_losses, want_grads = _reference()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5, atol=1e-6)
    assert grads.keys() == want_grads.keys()
    for name, want in want_grads.items():
        torch.testing.assert_close(grads[name], want, rtol=1e-4, atol=1e-6, msg=name)
    assert float(want_grads["model.layers.0.mlp.gate.weight"].abs().max()) > 1e-3


_FAMILIES = ["qwen3_moe", "qwen3_5_moe_text", "qwen3_next", "mixtral", "gpt_oss", "deepseek_v3", "glm4_moe"]
"""transformers' mixture-of-experts blocks ``tile_experts`` knows (``tests/memory/test_tiling.py`` holds
each at cp = 1)."""


def test_each_family_s_tiled_experts_train_exactly_at_cp2(world2):
    """The family matrix's step (``tests/hf/_matrix.py``: padded rows, the loss and every gradient against
    ``transformers``' own unsharded, untiled model) with ``HFCausalLM(tiled=True)`` in tiles of 3 tokens, the
    routers' load-balancing loss included where the family has one; every layer a mixture of experts."""
    fields = {"output_router_logits": True, "router_aux_loss_coef": 0.5}
    cases = [
        (
            name,
            name,
            {**fields, **({"first_k_dense_replace": 0} if name in ("deepseek_v3", "glm4_moe") else {})},
        )
        for name in _FAMILIES
    ]
    results = world2.run(_matrix.run, cases, tiled=True)
    failures = {}
    for name in _FAMILIES:
        ranks = [rank[name] for rank in results]
        failure = _matrix.failure(name, ranks, Outcome())
        tiled = ranks[0].get("tiled", [])
        if failure is None and not any(module.endswith(".experts") for module in tiled):
            failure = f"no experts tiled: {tiled}"
        if failure is not None:
            failures[name] = failure
    assert not failures, failures
