"""The mask hook behind ``attn_implementation="lightning_cp"``: a mask built on first use, or never.

``transformers`` builds one mask per forward with the function registered for the implementation in its
``AttentionMaskInterface``, which does not see the forward's keyword arguments. :func:`mask_for_hf` therefore
returns a :class:`DeferredMask` that only records what ``sdpa_mask`` would be called with. With ``cp_shard`` the
attention never builds it (the shard defines causality and document boundaries; no ``[S_local, S_local]`` mask
exists); without, the first layer builds it and every layer shares it.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from lightning_cp.constants import ATTN_IMPLEMENTATION


class DeferredMask:
    """The SDPA mask of one forward, built on first use and then shared by every layer.

    Holds the keyword arguments ``transformers`` gave the mask hook (sizes, offsets, the mask pattern
    function, the user's 2-D ``attention_mask``); :meth:`build` returns ``sdpa_mask(**arguments)``
    (``[B, 1, S, S]`` bool, or ``None`` where SDPA's ``is_causal`` suffices), computed once. Also records
    what a context-parallel forward has verified (its ``position_ids`` tensor, a padding mask of ones), so
    each check runs once per forward.

    Only the registered attention function may read it. A model that uses the mask itself (adds it to
    its own scores, moves it, combines it with an ALiBi bias) computes attention outside ``transformers``'
    attention interface, which ``"lightning_cp"`` cannot reach: a tensor operation on the mask raises a
    ``ValueError`` that says so, and a tensor attribute an ``AttributeError`` with the same message. A slice
    (``mask[:, 0]``, what a sparse-attention layer hands its indexer) is a deferred mask of the slice, for the
    adapted indexer to build without ``cp_shard`` (:mod:`lightning_cp.hf.indexers`) and to ignore with it.
    """

    def __init__(self, arguments: dict[str, Any], index: Any = None) -> None:
        self.arguments = arguments
        self.index = index
        self.verified_positions: Tensor | None = None
        self.verified_no_padding = False
        self._masks: dict[str, Tensor | None] = {}

    @property
    def padding_mask(self) -> Tensor | None:
        """The 2-D ``[B, S]`` padding mask the model was called with (``attention_mask=``), if any."""
        return self.arguments.get("attention_mask")

    def build(self) -> Tensor | None:
        """``transformers.masking_utils.sdpa_mask`` of the recorded arguments (the first call computes it)."""
        if "sdpa" not in self._masks:
            from transformers.masking_utils import sdpa_mask

            self._masks["sdpa"] = self._indexed(sdpa_mask(**self.arguments))
        return self._masks["sdpa"]

    def build_additive(self) -> Tensor:
        """``transformers.masking_utils.eager_mask``: the same mask as 0 / -inf floats, for eager attention."""
        if "eager" not in self._masks:
            from transformers.masking_utils import eager_mask

            arguments = {k: v for k, v in self.arguments.items() if k != "allow_is_causal_skip"}
            self._masks["eager"] = self._indexed(eager_mask(**arguments))
        return self._masks["eager"]

    def _indexed(self, mask: Tensor | None) -> Tensor | None:
        return mask if mask is None or self.index is None else mask[self.index]

    def _misuse(self, use: str) -> str:
        model_type = getattr(self.arguments.get("config"), "model_type", "this model")
        if self.index is not None:  # a slice handed on, as sparse attention hands its indexer mask[:, 0]
            use = (
                f"{use} of a slice of it; a sparse-attention model reads it in its indexer until "
                "lightning_cp.hf.check_models or the strategy's setup adapts the indexers"
            )
        return (
            f'attn_implementation="{ATTN_IMPLEMENTATION}": {model_type} uses the attention mask itself ({use}) '
            "instead of handing it to the registered attention function, so its attention runs outside "
            "transformers' attention interface and cannot be made context-parallel. Build this model with "
            'attn_implementation="sdpa" (or "eager") and train it with cp=1.'
        )

    def __getattr__(self, name: str) -> Any:
        # An AttributeError still, so that getattr(mask, name, default) keeps its meaning.
        raise AttributeError(name if name.startswith("__") else self._misuse(f".{name}"))

    def __getitem__(self, index: Any) -> DeferredMask:
        """The mask of ``mask[index]``, deferred alike (a sparse-attention layer hands its indexer
        ``mask[:, 0, :, :]``); any use of it as a tensor still raises."""
        if self.index is not None:
            raise ValueError(self._misuse("indexing twice"))
        return DeferredMask(self.arguments, index)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # Not a TypeError: torch turns that into NotImplemented for an operator, and Python into a bare
        # "unsupported operand type(s)".
        mask = next(a for a in (*args, *(kwargs or {}).values()) if isinstance(a, DeferredMask))
        raise ValueError(mask._misuse(getattr(func, "__name__", str(func))))


def mask_for_hf(**arguments: Any) -> DeferredMask | Tensor | None:
    """The ``AttentionMaskInterface`` entry: a :class:`DeferredMask` of ``sdpa_mask``'s arguments.

    Only a mask whose queries and keys coincide (equal lengths, offsets 0: every context-parallel step,
    and a forward with an empty dynamic cache) is deferred. With a filled or static cache the mask is built
    at once: ``generate`` with a static cache builds masks ahead of the forward and handles them as tensors.
    """
    q_offset = arguments.get("q_offset", 0)
    queries_are_keys = (
        not isinstance(q_offset, Tensor)
        and q_offset == 0
        and arguments.get("kv_offset", 0) == 0
        and arguments["kv_length"] == arguments["q_length"]
    )
    mask = DeferredMask(arguments)
    return mask if queries_are_keys else mask.build()
