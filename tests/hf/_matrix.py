"""One family of the matrix on a CP group: the strategy's setup check, then one step against the unsharded model.

Run on every rank of a gloo pool (``cp = world size``): the family's tiny model is built the way
:class:`~lightning_cp.models.HFCausalLM` builds it (``"lightning_cp"`` attention, from a config dict),
:func:`lightning_cp.hf.check_models` (the ``transformers`` integration's setup steps) decides, and an
accepted model takes one forward and backward step of ``HFCausalLM.training_step`` on its shard of a padded
batch; losses and gradients are summed over
CP. Rank ``i % cp`` of family ``i`` also runs the reference: ``transformers``' own
``model(input_ids, labels=...)`` with the family's default attention, same weights, whole batch.
"""

from __future__ import annotations

import copy
import warnings

import torch
import torch.distributed as dist

from lightning_cp.hf import check_models
from lightning_cp.models import HFCausalLM
from lightning_cp.parallel import groups, shard_batch
from lightning_cp.parallel.layout import set_current_layout
from tests.hf._families import VOCAB, tiny_config, transformers

BATCH_SHAPE = (2, 19)  # two rows of an odd length: the CP split pads every row


def batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, BATCH_SHAPE, generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids}


def run(cases: list[tuple[str, str, dict]]) -> dict[str, dict]:
    """On every rank, for each ``(name, model_type, config fields)``: its outcome (see :func:`_case`)."""
    layout = groups.initialize(tp=1, cp=dist.get_world_size())
    set_current_layout(layout)
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    try:
        return {
            name: _case(model_type, fields, reference=i % layout.cp == layout.cp_rank, layout=layout)
            for i, (name, model_type, fields) in enumerate(cases)
        }
    finally:
        set_current_layout(None)


def _case(model_type: str, fields: dict, *, reference: bool, layout) -> dict:
    """``{"refused": message}``, or ``{"crash": message}``, or the step's ``{"loss", "grads"}`` summed over
    CP and (on the reference rank) ``{"expected": {"loss", "grads"}}``."""
    config = tiny_config(model_type, **fields)
    module = HFCausalLM(config.to_dict())
    try:
        torch.manual_seed(0)
        module.configure_model()
        check_models(module, layout, torch.device("cpu"))  # as the strategy's setup (CP rank 0's weights)
    except ValueError as error:
        return {"refused": str(error)}
    except Exception as error:  # noqa: BLE001 - reported as the family's crash
        return {"crash": f"setup: {type(error).__name__}: {error}"}
    out: dict = {}
    initial = copy.deepcopy(module.model.state_dict())
    try:
        module.train()
        sharded = shard_batch(batch(), layout.cp, layout.cp_rank, cp_group=layout.cp_group)
        loss = module.training_step(sharded, 0)
        loss.backward()
    except Exception as error:  # noqa: BLE001 - reported as the family's crash
        return {"crash": f"step: {type(error).__name__}: {error}"}
    names = [n for n, p in module.model.named_parameters()]
    flat = torch.cat([_grad(p).reshape(-1) for p in module.model.parameters()] + [loss.detach().reshape(1)])
    dist.all_reduce(flat, group=layout.cp_group)
    flat /= layout.cp  # DDP's average over the CP ranks
    out["loss"] = flat[-1]
    out["grads"] = dict(
        zip(names, flat[:-1].split([p.numel() for p in module.model.parameters()]), strict=True)
    )
    if reference:
        out["expected"] = _reference(config, initial)
    return out


def _grad(param: torch.nn.Parameter) -> torch.Tensor:
    return param.grad if param.grad is not None else torch.zeros_like(param)


def _reference(config, state: dict) -> dict:
    """``transformers``' own loss and gradients of the whole batch, default attention, the same weights."""
    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config))
    model.load_state_dict(state)
    model.train()
    ids = batch()["input_ids"]
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return {
        "loss": loss.detach(),
        "grads": {n: _grad(p).reshape(-1) for n, p in model.named_parameters()},
    }
