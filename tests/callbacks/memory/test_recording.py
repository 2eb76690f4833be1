"""The allocator recording: its options reach PyTorch, and the OOM observer never keeps its target alive."""

from __future__ import annotations

import gc

import torch

from lightning_cp.callbacks.memory.recording import AllocatorRecording


class _Target:
    def __init__(self) -> None:
        self.calls = 0

    def on_oom(self) -> None:
        self.calls += 1


def test_the_oom_observer_is_attached_once_and_holds_its_target_weakly(monkeypatch):
    history, observers = [], []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kwargs: history.append(kwargs))
    # CPU builds of torch have no such function: raising=False adds it.
    monkeypatch.setattr(torch._C, "_cuda_attach_out_of_memory_observer", observers.append, raising=False)
    target = _Target()
    recording = AllocatorRecording("all", 7, on_oom=target.on_oom)

    recording.start()
    recording.stop()
    recording.start()
    assert recording.on
    assert history == [
        {"enabled": "all", "stacks": "all", "max_entries": 7, "clear_history": True},
        {"enabled": None},
        {"enabled": "all", "stacks": "all", "max_entries": 7, "clear_history": True},
    ]
    [observer] = observers
    observer(0, 64, 1024, 0)
    assert target.calls == 1

    del target, recording
    gc.collect()
    observer(0, 64, 1024, 0)  # PyTorch keeps the observer: it must not resurrect or call a dead target
    assert [o for o in gc.get_objects() if isinstance(o, _Target)] == []
