"""A fake of the CUDA calls of ``MemoryProfilerCallback``, and what the callback's tests share.

The fakes log every call into one event list next to the model's ``training_step``, so a test can
read off exactly on which steps recording started, stopped and dumped. The snapshot the fake returns
(:func:`recorded_snapshot`) is written by hand in the recorded format (segments, blocks, device_traces,
frames), and its peak is worked out by hand in its docstring, so the offline report is checked against
arithmetic, not against itself.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_cp.callbacks import MemoryProfilerCallback
from tests._trainer import quiet_trainer

MiB = 2**20

GiB = 2**30

_S = 64 * MiB  # base address of the segment the trace allocates


def _frames(*entries: tuple[str, int, str]) -> list[dict]:
    return [{"filename": f, "line": line, "name": name} for f, line, name in entries]


FRAMES_C = _frames(
    ("/venv/lib/python3.11/site-packages/torch/nn/modules/linear.py", 125, "forward"),
    ("/venv/lib/python3.11/site-packages/torch/nn/modules/module.py", 1775, "_call_impl"),
    ("/home/me/project/model.py", 42, "forward"),
)
FRAMES_D = _frames(("/home/me/project/model.py", 50, "training_step"))
FRAMES_E = _frames(
    ("/home/me/project/model.py", 61, "big_buffer"),
    ("??", 0, "c10::cuda::CUDACachingAllocator::malloc"),
    ("/home/me/project/model.py", 70, "training_step"),
)
FRAMES_F = _frames(("/home/me/project/model.py", 80, "small"))
FRAMES_A = _frames(("/home/me/project/model.py", 5, "__init__"))


def recorded_snapshot() -> dict:
    """A snapshot of one device in the format of ``torch.cuda.memory._snapshot()``.

    Before the trace: A (1 MiB, live to the end) and B (0.5 MiB, freed in the trace) -> 1.5 MiB.
    Events: segment +16 MiB; alloc C 2 MiB (3.5); alloc D 3 MiB (6.5); free B (6.0); alloc E 4 MiB
    (10.0 = peak, live: E 4, D 3, C 2, A 1); free D (7.0); alloc F 1 MiB (8.0); free C (6.0); OOM.
    Reserved: 2 MiB segment of A and B before the trace, 18 MiB from event 0 on.
    """

    def ev(action: str, addr: int, size: int, frames: list[dict] = ()) -> dict:
        return {"action": action, "addr": addr, "size": size, "stream": 0, "frames": list(frames)}

    trace = [
        ev("segment_alloc", _S, 16 * MiB),
        ev("alloc", _S, 2 * MiB, FRAMES_C),
        ev("alloc", _S + 2 * MiB, 3 * MiB, FRAMES_D),
        ev("free_requested", 1 * MiB, MiB // 2),
        ev("free_completed", 1 * MiB, MiB // 2),
        ev("alloc", _S + 5 * MiB, 4 * MiB, FRAMES_E),
        ev("free_requested", _S + 2 * MiB, 3 * MiB),
        ev("free_completed", _S + 2 * MiB, 3 * MiB),
        ev("alloc", _S + 2 * MiB, 1 * MiB, FRAMES_F),
        ev("free_requested", _S, 2 * MiB),
        ev("free_completed", _S, 2 * MiB),
        {"action": "oom", "size": 64 * MiB, "device_free": 1 * MiB, "stream": 0, "frames": FRAMES_E},
    ]

    def block(addr: int, size: int, state: str, frames: list[dict] = ()) -> dict:
        return {"address": addr, "size": size, "requested_size": size, "state": state, "frames": list(frames)}

    segments = [
        {
            "device": 0,
            "address": 0,
            "total_size": 2 * MiB,
            "stream": 0,
            "segment_type": "large",
            "allocated_size": 1 * MiB,
            "active_size": 1 * MiB,
            "blocks": [block(0, 1 * MiB, "active_allocated", FRAMES_A), block(1 * MiB, 1 * MiB, "inactive")],
        },
        {
            "device": 0,
            "address": _S,
            "total_size": 16 * MiB,
            "stream": 0,
            "segment_type": "large",
            "allocated_size": 5 * MiB,
            "active_size": 5 * MiB,
            "blocks": [
                block(_S, 2 * MiB, "inactive"),
                block(_S + 2 * MiB, 1 * MiB, "active_allocated", FRAMES_F),
                block(_S + 3 * MiB, 2 * MiB, "inactive"),
                block(_S + 5 * MiB, 4 * MiB, "active_allocated", FRAMES_E),
                block(_S + 9 * MiB, 7 * MiB, "inactive"),
            ],
        },
    ]
    return {"segments": segments, "device_traces": [trace]}


class FakeCuda:
    """The CUDA calls of the callback; every call is appended to ``events`` next to the model's steps."""

    def __init__(
        self, snapshot: dict | Callable[[], dict] | None = None, on_record: Callable[[], None] | None = None
    ) -> None:
        self.events: list[tuple] = []
        self.history_kwargs: list[dict] = []
        self.observers: list = []
        self.snapshot = recorded_snapshot() if snapshot is None else snapshot  # or a function making one
        self.on_record = on_record  # called when recording starts
        self.max_allocated = 3 * GiB
        self.max_reserved = 5 * GiB

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", self._record)
        monkeypatch.setattr(torch.cuda.memory, "_snapshot", self._snapshot)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.max_allocated)
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: self.max_reserved)
        monkeypatch.setattr(
            torch.cuda, "reset_peak_memory_stats", lambda device=None: self.events.append(("reset",))
        )
        # CPU builds of torch have no such function: raising=False adds it.
        monkeypatch.setattr(torch._C, "_cuda_attach_out_of_memory_observer", self._attach, raising=False)
        return self

    def _record(self, enabled="all", **kwargs) -> None:
        self.events.append(("record", enabled))
        self.history_kwargs.append(kwargs)
        if enabled and self.on_record is not None:
            self.on_record()

    def _snapshot(self, device=None) -> dict:
        self.events.append(("snapshot",))
        return self.snapshot() if callable(self.snapshot) else copy.deepcopy(self.snapshot)

    def _attach(self, observer) -> None:
        self.events.append(("attach",))
        self.observers.append(observer)

    def allocator_oom(self) -> None:
        """What the allocator does before it raises an out-of-memory error."""
        for observer in self.observers:
            observer(0, 64 * MiB, 80 * GiB, 1 * MiB)

    def without(self, *kinds: str) -> list[tuple]:
        return [e for e in self.events if e[0] not in kinds]


class StepModel(BoringModel):
    """``BoringModel`` that logs ``("train", global_step)`` into the fake's event list."""

    def __init__(
        self, events: list[tuple], oom_at: int | None = None, caught_oom: FakeCuda | None = None
    ) -> None:
        super().__init__()
        self.events = events
        self.oom_at = oom_at
        self.caught_oom = caught_oom

    def training_step(self, batch, batch_idx):
        step = self.trainer.global_step
        self.events.append(("train", step))
        if step == self.oom_at:
            if self.caught_oom is not None:
                self.caught_oom.allocator_oom()  # user code catches it and goes on
            else:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB")
        return super().training_step(batch, batch_idx)


def fit(
    tmp_path: Path, callback: MemoryProfilerCallback, model: BoringModel, max_steps: int = 6, **kwargs
) -> Trainer:
    trainer = quiet_trainer(
        default_root_dir=tmp_path, max_steps=max_steps, callbacks=[callback], limit_val_batches=0, **kwargs
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module=r"lightning\.pytorch")
        trainer.fit(model)
    return trainer


def names(dirpath: Path) -> list[str]:
    return sorted(p.name for p in dirpath.iterdir()) if dirpath.exists() else []


def stems(dirpath: Path) -> set[str]:
    return {n.split(".pickle")[0] for n in names(dirpath) if n.endswith(".pickle")}


def storage_span(tensor: torch.Tensor) -> tuple[int, int]:
    """The bytes of a contiguous tensor, from its storage (independent of ``data_ptr``)."""
    start = tensor.untyped_storage().data_ptr() + tensor.storage_offset() * tensor.element_size()
    return start, start + tensor.numel() * tensor.element_size()
