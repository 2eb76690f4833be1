"""The memory plan against ``torch.cuda.max_memory_allocated``: a GPT and a Llama step in bf16-mixed.

The same steps as ``test_measured.py`` (one sequence, the fused loss, backward, AdamW) on one GPU under
``torch.autocast`` with fp32 master weights, FlashAttention through SDPA; the step's peak above the
parameters and AdamW state within 10% of the plan's.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_cp.memory import tile_model
from lightning_cp.models.gpt import GPT, GPTConfig
from lightning_cp.ops import linear_cross_entropy
from lightning_cp.parallel.sharding import shard_batch
from lightning_cp.plan import Layout, ModelShape, estimate
from lightning_cp.strategies._modules import apply_checkpointing
from tests.plan._measure import llama

pytestmark = pytest.mark.gpu

TOKENS = 32768
VOCAB = 32768


def _gpt() -> tuple[nn.Module, ModelShape]:
    config = GPTConfig(vocab_size=VOCAB, n_layer=4, n_head=8, n_embd=1024, tie_embeddings=False)
    return GPT(config), ModelShape.from_gpt_config(config)


def _llama() -> tuple[nn.Module, ModelShape]:
    return llama(vocab=VOCAB, hidden=1024, ffn=2816, layers=4, heads=8, kv_heads=2)


def _step(model: nn.Module, batch: dict, optimizer: torch.optim.Optimizer) -> None:
    ids, pos, shard = batch["input_ids"], batch["position_ids"], batch["cp_shard"]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        if isinstance(model, GPT):
            hidden, head = model(ids, pos, cp_shard=shard), model.lm_head_weight
        else:
            out = model.model(input_ids=ids, position_ids=pos, cp_shard=shard, use_cache=False)
            hidden, head = out.last_hidden_state, model.lm_head.weight
        loss = linear_cross_entropy(hidden.flatten(0, 1), head, batch["labels"].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize("build", [_gpt, _llama], ids=["gpt", "llama"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "ckpt"])
@pytest.mark.parametrize("tiled", [False, True], ids=["mlp", "tiled"])
def test_step_peak_within_10_percent_of_the_plan(build, checkpointing: bool, tiled: bool) -> None:
    device = torch.device("cuda")
    model, shape = build()
    model.to(device)
    if tiled:
        tile_model(model)
    if checkpointing:
        layer = model.blocks[0] if isinstance(model, GPT) else model.model.layers[0]
        apply_checkpointing(model, [type(layer)])
    batch = shard_batch({"input_ids": torch.randint(0, VOCAB, (1, TOKENS), device=device)}, 1, 0)
    optimizer = torch.optim.AdamW(model.parameters())
    _step(model, batch, optimizer)  # AdamW's state exists from here on
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    _step(model, batch, optimizer)
    measured = torch.cuda.max_memory_allocated() - base
    layout = Layout(gpus=1, cp=1, checkpointing=checkpointing, tiled=tiled)
    planned = estimate(shape, TOKENS, layout, precision="bf16-mixed")
    planned_step = planned.counted - planned.parameters - planned.optimizer
    assert abs(planned_step - measured) <= 0.10 * measured, (planned.as_dict(), measured)
