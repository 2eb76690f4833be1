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

import contextlib
import copy
import warnings
from unittest import mock

import torch
import torch.distributed as dist

from lightning_cp.adaptation import applied
from lightning_cp.hf import check_models
from lightning_cp.memory import tiling
from lightning_cp.models import HFCausalLM
from lightning_cp.parallel import groups, shard_batch
from lightning_cp.parallel.layout import set_current_layout
from tests.hf._families import VOCAB, tiny_config, transformers
from tests.hf.support_table import Outcome

BATCH_SHAPE = (2, 19)  # two rows of an odd length: the CP split pads every row

LOSS_RTOL = 1e-5
# Per parameter, in norm: a gradient within 5e-5 of the reference's norm (fp32 round-off of sums over a
# few dozen tokens is ~1e-6 .. 2e-5), or, for gradients that are zero up to round-off (a key bias, whose
# softmax makes it irrelevant), within 1e-6 of the whole model's gradient norm. A 1% error fails either.
GRAD_RTOL = 5e-5
GRAD_FLOOR = 1e-6


def batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, BATCH_SHAPE, generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids}


def run(cases: list[tuple[str, str, dict]], tiled: bool = False) -> dict[str, dict]:
    """On every rank, for each ``(name, model_type, config fields)``: its outcome (see :func:`_case`).

    ``tiled``: ``HFCausalLM(tiled=True)``, in tiles of 3 tokens (several per document of a rank's shard)."""
    layout = groups.initialize(tp=1, cp=dist.get_world_size())
    set_current_layout(layout)
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    tiles = mock.patch.object(tiling, "auto_tile_tokens", lambda tokens, dim: 3)
    try:
        with tiles if tiled else contextlib.nullcontext():
            return {
                name: _case(
                    model_type, fields, reference=i % layout.cp == layout.cp_rank, layout=layout, tiled=tiled
                )
                for i, (name, model_type, fields) in enumerate(cases)
            }
    finally:
        set_current_layout(None)


def _case(model_type: str, fields: dict, *, reference: bool, layout, tiled: bool) -> dict:
    """``{"refused": message}``, or ``{"crash": message}``, or the step's ``{"loss", "grads"}`` summed over
    CP, the names of the tiled modules (``"tiled"``) and (on the reference rank) ``{"expected": {"loss",
    "grads"}}``."""
    config = tiny_config(model_type, **fields)
    module = HFCausalLM(config.to_dict(), tiled=tiled)
    try:
        torch.manual_seed(0)
        module.configure_model()
        check_models(module, layout, torch.device("cpu"))  # as the strategy's setup (CP rank 0's weights)
    except ValueError as error:
        return {"refused": str(error)}
    except Exception as error:  # noqa: BLE001 - reported as the family's crash
        return {"crash": f"setup: {type(error).__name__}: {error}"}
    tiled_modules = [n for n, m in module.model.named_modules() if "tiling" in applied(m)]
    out: dict = {"tiled": tiled_modules}
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


def failure(name: str, ranks: list[dict], expected: Outcome) -> str | None:
    """Why ``name``'s outcome on the CP ranks is not ``expected``, or ``None``."""
    first = ranks[0]
    if "crash" in first or any("crash" in r for r in ranks):
        return f"crashed: {next(r['crash'] for r in ranks if 'crash' in r)}"
    if "refused" in first:
        if expected.exact:
            return f"refused, expected exact: {first['refused']}"
        if expected.reason.message not in first["refused"]:
            return f"refused for another reason than {expected.reason.message!r}: {first['refused']}"
        return None
    if not expected.exact:
        return f"accepted, expected refused ({expected.reason.message!r})"
    reference = next(r["expected"] for r in ranks if "expected" in r)
    if not torch.allclose(first["loss"], reference["loss"], rtol=LOSS_RTOL, atol=0.0):
        return f"loss {first['loss'].item():.8f} != {reference['loss'].item():.8f}"
    total = torch.cat(list(reference["grads"].values())).norm()
    for key, want in reference["grads"].items():
        error = (first["grads"][key] - want).norm()
        if error > GRAD_RTOL * want.norm() + GRAD_FLOOR * total:
            return f"gradient of {key}: error {error:.3e}, reference norm {want.norm():.3e}"
    return None
