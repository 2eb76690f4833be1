"""The one way the package adapts a model's modules in place: each kind of adaptation once, in one order.

The package changes what some modules of a user's model do without changing their parameters or names:
sequence tiles (:mod:`lightning_cp.memory.tiling`), the context-parallel forward of token mixers and sparse
indexers (:mod:`lightning_cp.hf.mixers`, :mod:`lightning_cp.hf.indexers`), the check of a model's calls on a
batch's shard (:mod:`lightning_cp.hf.sharded_calls`) and the host copies of checkpointed layers' inputs
(:mod:`lightning_cp.memory.offload`). Every one goes through :func:`replace_forward` or :func:`add_hooks`, which
record it in one attribute of the module (:func:`applied`): applying a kind again does nothing (a strategy's
setup may run twice on one model: ``fit``, then ``validate``), and a kind applied after one that comes later
in :data:`STAGES` is refused, since it would wrap that one and change what it sees.

Imports nothing of ``lightning_cp``: every package that adapts modules may use it.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

from torch import nn

STAGES = ("tiling", "token_mixer", "indexer", "latent", "sharded_calls", "offload")
"""The kinds of adaptation, in the order they are applied to one module: tiles in ``configure_model``, then the
strategies' setup (the context-parallel forwards, MLA's latent handed to the attention unexpanded
(:mod:`lightning_cp.hf.latent`), the check of sharded calls, then activation checkpointing and the offload of
what it saves)."""

_APPLIED = "_lightning_cp_adaptations"


def applied(module: nn.Module) -> tuple[str, ...]:
    """The kinds of :data:`STAGES` applied to ``module``, in the order they were."""
    return getattr(module, _APPLIED, ())


def replace_forward(
    module: nn.Module, stage: str, forward: Callable[..., Any], *, bind: bool = True, method: str = "forward"
) -> bool:
    """Make ``forward`` ``module``'s forward (an instance attribute: the class and its other instances keep
    theirs), once for ``stage``; or its ``method`` of another name (MLA's ``expand_kv``).

    Args:
        module: the module to adapt.
        stage: one of :data:`STAGES`.
        forward: the new forward; with ``bind``, a function taking the module first (bound to it), else a
            callable that stands for ``module.forward`` as it is (a wrapper built around it).
        bind: whether to bind ``forward`` to ``module``.
        method: the name of the method replaced (``"forward"`` unless another, e.g. ``"expand_kv"``).

    Returns:
        ``False`` when ``stage`` was applied to ``module`` before (nothing changes), else ``True``.

    Raises:
        ValueError: an unknown ``stage``, or one that comes before a stage already applied (see the module
            docstring).
    """
    if not _record(module, stage):
        return False
    setattr(module, method, types.MethodType(forward, module) if bind else forward)
    return True


def add_hooks(
    module: nn.Module,
    stage: str,
    pre: Callable[..., Any] | None = None,
    post: Callable[..., Any] | None = None,
    *,
    with_kwargs: bool = False,
    prepend: bool = False,
) -> bool:
    """Register a forward pre-hook ``pre`` and a forward hook ``post`` (run even when the forward raises) on
    ``module``, once for ``stage``; ``with_kwargs`` and ``prepend`` as ``nn.Module``'s registration takes them.

    Returns / Raises: as :func:`replace_forward`.
    """
    if not _record(module, stage):
        return False
    if pre is not None:
        module.register_forward_pre_hook(pre, with_kwargs=with_kwargs, prepend=prepend)
    if post is not None:
        module.register_forward_hook(post, with_kwargs=with_kwargs, prepend=prepend, always_call=True)
    return True


def _record(module: nn.Module, stage: str) -> bool:
    """Add ``stage`` to ``module``'s record; ``False`` when it is there already."""
    if stage not in STAGES:
        raise ValueError(f"adaptation stage {stage!r}: choose one of {', '.join(STAGES)}.")
    done = applied(module)
    if stage in done:
        return False
    later = [kind for kind in done if STAGES.index(kind) > STAGES.index(stage)]
    if later:
        raise ValueError(
            f"{type(module).__name__}: the {stage!r} adaptation would wrap the {later[0]!r} one already applied "
            f"(the order is {', '.join(STAGES)}): apply {stage!r} first, e.g. tile the model in configure_model, "
            "before the strategy's setup."
        )
    setattr(module, _APPLIED, (*done, stage))
    return True
