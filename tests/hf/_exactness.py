"""One training step of a family under CP against ``transformers``' own unsharded model, shared by the hybrid and
the sparse-attention family tests.

A family is a config dict (``model_type`` and sizes); weights are drawn at the config's ``initializer_range``.
:func:`train_step` runs, on every rank of the shared pool, the strategy's setup checks and one
``HFCausalLM.training_step`` on this rank's shard of a fixed global batch (padded rows, or packed rows of
documents of one token, shorter and longer than a chunk), and rank 0 adds the reference: ``transformers``' own
``model(input_ids, labels=...)`` on the whole padded batch, or on every packed document alone, with the same
initial weights and the family's default attention. :func:`failures` compares the loss (rtol 1e-5) and every
parameter's gradient (5e-5 of its norm, plus 1e-6 of the whole gradient's).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
import torch.distributed as dist

from lightning_cp.hf import check_models
from lightning_cp.models import HFCausalLM
from lightning_cp.parallel import groups, shard_batch
from lightning_cp.parallel.layout import set_current_layout

VOCAB = 96
INIT = 0.2  # 10x transformers' default initializer_range
PADDED_SHAPE = (2, 21)  # a row per DP rank at dp = 2; odd: the split pads
PACKED_ROWS = ((1, 9, 4, 13), (11, 2, 6))  # documents of one token, shorter and longer than a chunk


def rows(packed: bool) -> list[dict[str, torch.Tensor]]:
    """The global batch as one dict per row (a row per DP rank at dp = 2, both rows at dp = 1)."""
    g = torch.Generator().manual_seed(1)
    if not packed:
        ids = torch.randint(3, VOCAB, PADDED_SHAPE, generator=g)
        return [{"input_ids": ids[i : i + 1]} for i in range(PADDED_SHAPE[0])]
    out = []
    for lengths in PACKED_ROWS:
        ids = torch.randint(3, VOCAB, (1, sum(lengths)), generator=g)
        out.append({"input_ids": ids, "cu_seqlens": torch.tensor([0, *lengths]).cumsum(0)})
    return out


def documents(packed: bool) -> list[torch.Tensor]:
    """Every sequence of the global batch alone, ``[1, L]`` each."""
    out = []
    for row in rows(packed):
        if "cu_seqlens" in row:
            out += list(row["input_ids"].split(row["cu_seqlens"].diff().tolist(), dim=1))
        else:
            out.append(row["input_ids"])
    return out


def local_batch(packed: bool, layout) -> dict[str, torch.Tensor]:
    """This DP rank's part of the global batch: its row at dp = 2, every sequence at dp = 1."""
    batch = rows(packed)
    if layout.dp == len(batch):
        return batch[layout.dp_rank]
    if not packed:
        return {"input_ids": torch.cat([r["input_ids"] for r in batch])}
    lengths = [n for row in PACKED_ROWS for n in row]
    ids = torch.cat([r["input_ids"] for r in batch], dim=1)
    return {"input_ids": ids, "cu_seqlens": torch.tensor([0, *lengths]).cumsum(0)}


def train_step(configs: dict[str, dict], cp: int, packed: bool, **options: Any) -> dict:
    """On every rank: each family's loss and gradients (averaged over DP x CP as DDP does) after the setup
    check and one ``HFCausalLM.training_step`` (built with ``options``: ``gradient_checkpointing=True``); rank 0
    also gives the reference of its initial weights."""
    import transformers

    layout = groups.initialize(tp=1, cp=cp)
    set_current_layout(layout)
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    results = {}
    try:
        for name, config in configs.items():
            torch.manual_seed(0)
            module = HFCausalLM(config, **options)
            module.configure_model()
            check_models(module, layout, torch.device("cpu"))
            initial = copy.deepcopy(module.model.state_dict())
            module.train()
            batch = shard_batch(local_batch(packed, layout), cp, layout.cp_rank, cp_group=layout.cp_group)
            loss = module.training_step(batch, 0)
            loss.backward()
            results[name] = averaged(loss, list(module.model.named_parameters()), layout)
            if dist.get_rank() == 0:
                results[name]["expected"] = reference(config, initial, packed)
    finally:
        set_current_layout(None)
    return results


def averaged(loss: torch.Tensor, params: list[tuple[str, torch.Tensor]], layout) -> dict:
    """``{"loss", "grads"}``: this rank's loss and the gradients of ``params`` (name, parameter) averaged over DP x
    CP as DDP does (one all-reduce over the layout's loss group), the gradients flat, by name."""
    flat = torch.cat([grad(p).flatten() for _, p in params] + [loss.detach().reshape(1)])
    dist.all_reduce(flat, group=layout.loss_group)
    flat /= layout.dp * layout.cp
    grads = dict(zip([n for n, _ in params], flat[:-1].split([p.numel() for _, p in params]), strict=True))
    return {"loss": flat[-1], "grads": grads}


def grad(param: torch.Tensor) -> torch.Tensor:
    return param.grad if param.grad is not None else torch.zeros_like(param)


def reference(config: dict, state: dict, packed: bool) -> dict:
    """``transformers``' own loss of the global batch (every sequence alone when packed) and its gradients."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    model.load_state_dict(state)
    model.train()
    sequences = documents(packed)
    targets = sum(d.shape[1] - 1 for d in sequences)
    total = sum(
        model(input_ids=d, labels=d, use_cache=False).loss * (d.shape[1] - 1)
        for d in sequences
        if d.shape[1] > 1
    )
    loss = total / targets
    loss.backward()
    return {"loss": loss.detach(), "grads": {n: grad(p).flatten() for n, p in model.named_parameters()}}


def failures(results: dict) -> list[str]:
    """What differs between each family's step and its reference: the loss, or the first gradient that does."""
    found = []
    for name, got in results.items():
        want = got["expected"]
        if not torch.allclose(got["loss"], want["loss"], rtol=1e-5, atol=0.0):
            found.append(f"{name}: loss {got['loss'].item():.8f} != {want['loss'].item():.8f}")
            continue
        total = torch.cat(list(want["grads"].values())).norm()
        for key, expected in want["grads"].items():
            error = (got["grads"][key] - expected).norm()
            if error > 5e-5 * expected.norm() + 1e-6 * total:
                found.append(
                    f"{name}: gradient of {key}: error {error:.3e}, reference norm {expected.norm():.3e}"
                )
                break
    return found


class _FirstStep(HFCausalLM):
    """Records the weights it starts from, and the loss and gradients of its first optimizer step as the
    strategy leaves them (DDP's averages over DP x CP, or FSDP's shards gathered)."""

    def on_train_start(self) -> None:
        self.initial = {n: _whole(t).clone() for n, t in self.model.state_dict().items()}

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        layout = self.trainer.strategy.layout
        self.grads = {n: _whole(grad(p)).flatten() for n, p in self.model.named_parameters()}
        loss = self.step_loss.clone()
        dist.all_reduce(loss, group=layout.loss_group)
        self.loss = loss / (layout.dp * layout.cp)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.step_loss = loss.detach()
        return loss


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def fit_step(configs: dict[str, dict], cp: int, fsdp: bool) -> dict:
    """On every rank: each family's first step through ``Trainer.fit`` under the package's strategy (DDP's own
    unused-parameter check and gradient averaging, or FSDP's) on the padded global batch; rank 0 also gives the
    reference of its initial weights. The same keys as :func:`train_step`'s results."""
    import transformers
    from torch.utils.data import DataLoader

    from lightning_cp import MegatronCPFSDPStrategy, MegatronCPStrategy
    from lightning_cp.data import collate_padded
    from tests._trainer import quiet_trainer

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    dp = dist.get_world_size() // cp
    data = [{"input_ids": row["input_ids"][0]} for row in rows(packed=False)]
    results = {}
    for name, config in configs.items():
        torch.manual_seed(0)
        module = _FirstStep(config)
        strategy = (MegatronCPFSDPStrategy if fsdp else MegatronCPStrategy)(cp=cp)
        trainer = quiet_trainer(devices=dist.get_world_size(), strategy=strategy, max_steps=1)
        loader = DataLoader(data, batch_size=len(data) // dp, collate_fn=collate_padded)
        trainer.fit(module, loader)
        results[name] = {"loss": module.loss, "grads": module.grads}
        if dist.get_rank() == 0:
            results[name]["expected"] = reference(config, module.initial, packed=False)
    return results
