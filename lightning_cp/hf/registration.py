"""Registering ``"lightning_cp"`` with ``transformers`` without importing it on ``import lightning_cp``.

``transformers`` keeps attention functions in ``AttentionInterface`` (``transformers.modeling_utils``)
and mask builders in ``AttentionMaskInterface`` (``transformers.masking_utils``); both are class-wide
registries. Importing those modules costs about a second, which every process and DataLoader worker
would pay, so :func:`install` registers into each module that is already loaded and, for the others,
puts a finder on ``sys.meta_path`` that registers right after ``transformers`` loads them: before any
model can be built with ``attn_implementation="lightning_cp"``.

A few families pick their attention *class* from a table of their own keyed by the implementation name
(Falcon's ``FALCON_ATTENTION_CLASSES``, GPT-Neo's, Bark's), outside the attention interface; asked for
``"lightning_cp"`` they would fail inside ``transformers`` with a bare ``KeyError``. Every such table of a
``transformers`` modeling module gets a ``"lightning_cp"`` entry that raises
:class:`UnsupportedAttentionClasses` with the reason and what to do instead, when the module is loaded.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

from lightning_cp.constants import ATTN_IMPLEMENTATION
from lightning_cp.hf.attention import hf_context_parallel_attention
from lightning_cp.hf.masks import mask_for_hf


class UnsupportedAttentionClasses(ValueError):
    """A model whose attention classes come from a table of its own, which ``"lightning_cp"`` cannot reach."""


def _register_attention() -> None:
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, hf_context_parallel_attention)


def _register_mask() -> None:
    from transformers.masking_utils import AttentionMaskInterface

    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, mask_for_hf)


_REGISTRATIONS: dict[str, Callable[[], None]] = {
    "transformers.modeling_utils": _register_attention,
    "transformers.masking_utils": _register_mask,
}


def _is_modeling_module(name: str) -> bool:
    return name.startswith("transformers.models.") and name.rpartition(".")[2].startswith("modeling_")


def _refuse_in_attention_class_tables(module: ModuleType) -> None:
    """Give every ``*_ATTENTION_CLASSES`` table of a modeling module a ``"lightning_cp"`` entry that refuses."""
    for name, table in list(vars(module).items()):
        if (
            name.endswith("ATTENTION_CLASSES")
            and isinstance(table, dict)
            and ATTN_IMPLEMENTATION not in table
        ):
            table[ATTN_IMPLEMENTATION] = _Refusal(
                f'attn_implementation="{ATTN_IMPLEMENTATION}": {module.__name__.split(".")[2]} computes attention '
                f"in classes of its own ({name}: {', '.join(map(repr, table))}), outside transformers' attention "
                "interface, so it cannot be made context-parallel. Build it with one of those implementations "
                "and train it with cp=1."
            )


class _Refusal:
    """Stands where an attention class is looked up: building it raises :class:`UnsupportedAttentionClasses`."""

    def __init__(self, message: str) -> None:
        self.message = message

    def __call__(self, *args: object, **kwargs: object) -> None:
        raise UnsupportedAttentionClasses(self.message)


def install() -> None:
    """Register ``attn_implementation="lightning_cp"`` with ``transformers`` now or when it is loaded.

    Does nothing when ``transformers`` is not installed. Called by ``import lightning_cp``.
    """
    if importlib.util.find_spec("transformers") is None:
        return
    pending = {}
    for name, register in _REGISTRATIONS.items():
        if name in sys.modules:
            _safely(register)
        else:
            pending[name] = register
    for name, module in list(sys.modules.items()):
        if _is_modeling_module(name) and module is not None:
            _refuse_in_attention_class_tables(module)
    if not any(isinstance(finder, _RegisterOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterOnImport(pending))


def _safely(register: Callable[[], None]) -> None:
    # A transformers without these registries must still import: warn instead of breaking it.
    try:
        register()
    except (ImportError, AttributeError) as error:
        warnings.warn(
            f'lightning_cp could not register attn_implementation="{ATTN_IMPLEMENTATION}" with this '
            f"transformers ({error}); install a supported version: pip install 'lightning-cp[hf]'.",
            stacklevel=2,
        )


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loading of the watched modules so that registration follows it: the
    two registries, once each, and every modeling module's attention class tables."""

    def __init__(self, pending: dict[str, Callable[[], None]]) -> None:
        self._pending = pending

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        register = self._pending.pop(fullname, None)
        if register is None and not _is_modeling_module(fullname):
            return None
        spec = self._spec_from_other_finders(fullname, path, target)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def load_then_register(module: ModuleType) -> None:
            load(module)
            if register is None:
                _refuse_in_attention_class_tables(module)
            else:
                _safely(register)

        spec.loader.exec_module = load_then_register  # type: ignore[method-assign]
        return spec

    def _spec_from_other_finders(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None
    ) -> ModuleSpec | None:
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None)
            if finder is self or find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                return spec
        return None
