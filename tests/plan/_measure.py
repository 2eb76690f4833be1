"""Independent measurements of a training step's memory on the CPU, for the plan's tests.

``saved_bytes``: autograd's ``saved_tensors_hooks`` (storages counted once, parameters left out).
``PeakTracker``: a ``TorchDispatchMode`` that counts every storage an operator creates while it is alive
(a weak reference's finalizer subtracts it), so its peak is the allocator's view of the step.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lightning_cp.plan import ModelShape


def llama(
    *, vocab: int, hidden: int, ffn: int, layers: int, heads: int, kv_heads: int
) -> tuple[nn.Module, ModelShape]:
    """A random Llama with ``attn_implementation="lightning_cp"``, and the plan's shape of it."""
    transformers = pytest.importorskip("transformers")
    config = {
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
    }
    hf = transformers.AutoConfig.for_model(**config)
    model = transformers.AutoModelForCausalLM.from_config(hf, attn_implementation="lightning_cp")
    return model, ModelShape.from_hf_config(config)


def hf_model(**config: object) -> tuple[nn.Module, ModelShape]:
    """A random ``transformers`` causal LM of ``config`` (a dict with its ``model_type``) with
    ``attn_implementation="lightning_cp"``, and the plan's shape of it."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoConfig.for_model(**config)
    model = transformers.AutoModelForCausalLM.from_config(hf, attn_implementation="lightning_cp")
    return model, ModelShape.from_hf_config(config)


def saved_bytes(model: nn.Module, forward: Callable[[], object]) -> int:
    """Bytes of the distinct storages autograd saves during ``forward()``, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        forward()
    return sum(seen.values())


class PeakTracker(TorchDispatchMode):
    """Live bytes of the storages created under the mode, and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._tracked: set[int] = set()

    def _release(self, key: int, nbytes: int) -> None:
        self._tracked.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
                storage = tensor.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self._tracked and storage.nbytes():
                    self._tracked.add(key)
                    self.live += storage.nbytes()
                    weakref.finalize(storage, self._release, key, storage.nbytes())
        self.peak = max(self.peak, self.live)
        return out
