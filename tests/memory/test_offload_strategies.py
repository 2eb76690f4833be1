"""``offload_activations=True`` (and ``tile_model``) under both strategies at dp=1 x cp=2: the unsharded model's training.

The references are the hand-written single-process loops of the strategy tests (the GPT's
``F.cross_entropy`` on materialized logits, ``transformers``' own ``labels=`` loss for the tiny Llama),
without checkpointing or offload. The offloaded bytes are counted from the inputs the checkpointed layers
receive. Every case runs on the shared pool of 2 gloo ranks.
"""

from unittest import mock

import pytest
import torch
from lightning.pytorch import Callback, seed_everything
from torch.distributed._composable import checkpoint
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_cp import MegatronCPFSDPStrategy, MegatronCPStrategy
from lightning_cp.data import collate_padded
from lightning_cp.memory import offload, tile_model
from lightning_cp.models import GPTModule, HFCausalLM
from tests._trainer import cp_trainer
from tests.hf import test_training as hf_training
from tests.hf._models import CONFIGS
from tests.strategies import test_megatron_cp as gpt_training


class _Counts(Callback):
    """Per step: the bytes of the distinct positional tensors the checkpointed layers receive, and the losses."""

    def __init__(self, layers):
        self.layers, self.input_bytes, self.losses = layers, [], []

    def on_train_start(self, trainer, pl_module):
        for layer in self.layers(pl_module):
            layer.register_forward_pre_hook(self._record)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen = set()
        self.input_bytes.append(0)

    def _record(self, module, args):
        if torch.is_grad_enabled() and checkpoint.state(module).enable_hook:  # not its recomputation
            for arg in args:
                if isinstance(arg, torch.Tensor) and arg.untyped_storage().data_ptr() not in self.seen:
                    self.seen.add(arg.untyped_storage().data_ptr())
                    self.input_bytes[-1] += arg.numel() * arg.element_size()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(trainer.callback_metrics["train/loss_step"].item())

    def on_train_end(self, trainer, pl_module):
        stats = trainer.strategy.activation_offload.stats
        self.stats = (stats.offloaded_bytes, dict(stats.bytes_by_module), stats.prefetched_tensors)
        self.weights = {
            k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in pl_module.model.state_dict().items()
        }


def _fit(model, fsdp, tiled, offload_activations=True):
    """Train with checkpointing + offload (every saved input offloaded: ``MIN_OFFLOAD_BYTES`` 0) and, if
    ``tiled``, every MLP over tiles of 4 tokens and every norm over tiles of 3 (several tiles per rank's
    shard)."""
    seed_everything(0)
    if model == "gpt":
        module, layer_class = GPTModule(gpt_training.CONFIG, lr=gpt_training.LR), "_Block"
        counts = _Counts(lambda m: m.model.blocks)
        loader = gpt_training._loader(gpt_training.GLOBAL_BATCH, False, gpt_training._dataset())
        steps = gpt_training.STEPS
    else:
        module, layer_class = HFCausalLM(CONFIGS["llama"], lr=hf_training.LR), "LlamaDecoderLayer"
        module.configure_model()
        counts = _Counts(lambda m: m.model.model.layers)
        loader = DataLoader(
            hf_training._dataset(), batch_size=hf_training.GLOBAL_BATCH, collate_fn=collate_padded
        )
        steps = hf_training.STEPS
    if tiled:
        tile_model(module.model, tile_tokens=3)
    strategy = (MegatronCPFSDPStrategy if fsdp else MegatronCPStrategy)(
        cp=2, activation_checkpointing=[layer_class], offload_activations=offload_activations
    )
    with mock.patch.object(offload, "MIN_OFFLOAD_BYTES", 0):
        cp_trainer(2, strategy=strategy, max_steps=steps, callbacks=[counts]).fit(module, loader)
    return counts.losses, counts.weights, counts.input_bytes, counts.stats


@pytest.mark.parametrize(
    "model, fsdp, tiled, offload_activations",
    [
        ("gpt", False, False, True),
        ("gpt", True, False, True),
        ("llama", False, False, True),
        ("llama", True, False, 1),
        ("gpt", False, True, True),
        ("llama", True, True, True),
    ],
    ids=["gpt-ddp", "gpt-fsdp", "llama-ddp", "llama-fsdp-first-layer", "gpt-ddp-tiled", "llama-fsdp-tiled"],
)
def test_offloaded_training_equals_the_unsharded_model(world2, model, fsdp, tiled, offload_activations):
    """Also with the tiled MLPs, norms and projections (``tile_model``) inside the checkpointed layers,
    under DDP and FSDP2, and with the first layer's inputs only offloaded (``offload_activations=1``, the
    plan's ``+offload:1``)."""
    if model == "gpt":
        ref_losses, ref_weights = gpt_training._reference(False)
        names = [f"model.blocks.{i}" for i in range(gpt_training.CONFIG.n_layer)]
    else:
        ref_losses, ref_weights = hf_training._reference("llama")
        names = [f"model.model.layers.{i}" for i in range(CONFIGS["llama"]["num_hidden_layers"])]
    layers = len(names)
    if offload_activations is not True:
        names = names[:offload_activations]
    for losses, weights, input_bytes, (offloaded, by_module, prefetched) in world2.run(
        _fit, model, fsdp, tiled, offload_activations
    ):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        for key, value in ref_weights.items():
            torch.testing.assert_close(weights[key], value, rtol=1e-4, atol=5e-5, msg=key)
        # Every (offloaded) checkpointed layer's input of every step went to the host, and nothing else did
        # (a Llama's layers all get their hidden states alone, of one size).
        if offload_activations is True:
            assert offloaded == sum(input_bytes) > 0
        else:
            assert offloaded == sum(input_bytes) * offload_activations // layers > 0
        assert sorted(by_module) == names
        assert prefetched >= len(input_bytes) * (len(names) - 1)
