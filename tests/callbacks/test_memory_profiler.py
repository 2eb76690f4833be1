"""``MemoryProfilerCallback`` through a real ``Trainer`` on CPU, with the CUDA allocator APIs faked
(``tests/callbacks/_fake_cuda.py``): on which steps and ranks it records and dumps, what an OOM does,
the LightningCLI forms of its options, and DDP."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_cp.callbacks import MemoryProfilerCallback
from tests._trainer import quiet_trainer
from tests.callbacks._fake_cuda import (
    FakeCuda,
    GiB,
    StepModel,
    fit,
    names,
    recorded_snapshot,
    stems,
)


def test_records_single_steps_and_windows(tmp_path, monkeypatch):
    fake = FakeCuda().install(monkeypatch)
    callback = MemoryProfilerCallback(
        steps=["3-4", 1], max_entries=1234, dirpath=tmp_path / "snaps", log_peak=False
    )
    fit(tmp_path, callback, StepModel(fake.events))

    assert fake.events == [
        ("train", 0),
        ("record", "all"),
        ("attach",),
        ("train", 1),
        ("snapshot",),
        ("record", None),
        ("train", 2),
        ("record", "all"),
        ("train", 3),
        ("train", 4),
        ("snapshot",),
        ("record", None),
        ("train", 5),
    ]
    assert fake.history_kwargs[0] == {"stacks": "python", "max_entries": 1234, "clear_history": True}
    assert names(tmp_path / "snaps") == sorted(
        f"{stem}.{ext}"
        for stem in ("step_000001.rank00", "step_000003-000004.rank00")
        for ext in ("pickle", "png", "md", "html")
    )
    raw = (tmp_path / "snaps" / "step_000001.rank00.pickle").read_bytes()
    assert raw[:2] == b"\x80\x04"  # pickle protocol 4, which the memory_viz page reads
    assert pickle.loads(raw) == recorded_snapshot()


def test_window_spans_every_micro_batch_of_gradient_accumulation(tmp_path, monkeypatch):
    fake = FakeCuda().install(monkeypatch)
    callback = MemoryProfilerCallback(steps=["1-2"], dirpath=tmp_path, log_peak=False, dump_on_oom=False)
    fit(tmp_path, callback, StepModel(fake.events), max_steps=4, accumulate_grad_batches=2)

    assert fake.events == [
        ("train", 0),
        ("train", 0),
        ("record", "all"),
        ("train", 1),
        ("train", 1),
        ("train", 2),
        ("train", 2),
        ("snapshot",),
        ("record", None),
        ("train", 3),
        ("train", 3),
    ]
    assert stems(tmp_path) == {"step_000001-000002.rank00"}


def test_window_cut_short_by_max_steps_dumps_what_was_recorded(tmp_path, monkeypatch):
    fake = FakeCuda().install(monkeypatch)
    callback = MemoryProfilerCallback(steps=["4-9"], dirpath=tmp_path, log_peak=False)
    with pytest.warns(UserWarning, match="inside the window 4-9; dumping steps 4-5"):
        fit(tmp_path, callback, StepModel(fake.events), max_steps=6)

    assert fake.without("attach") == [
        ("train", 0),
        ("train", 1),
        ("train", 2),
        ("train", 3),
        ("record", "all"),
        ("train", 4),
        ("train", 5),
        ("snapshot",),
        ("record", None),
    ]
    assert stems(tmp_path) == {"step_000004-000005.rank00"}


@pytest.mark.parametrize(
    ("ranks", "global_rank", "local_rank", "records"),
    [
        ("all", 3, 1, True),
        ([0, 3], 3, 1, True),
        ([0, 2], 3, 1, False),
        ("local_zero", 3, 1, False),
        ("local_zero", 4, 0, True),
    ],
)
def test_rank_selection(tmp_path, monkeypatch, ranks, global_rank, local_rank, records):
    fake = FakeCuda().install(monkeypatch)
    monkeypatch.setattr(Trainer, "global_rank", property(lambda self: global_rank))
    monkeypatch.setattr(Trainer, "local_rank", property(lambda self: local_rank))
    monkeypatch.setattr(Trainer, "world_size", property(lambda self: 8))
    callback = MemoryProfilerCallback(steps=[1], ranks=ranks, dirpath=tmp_path / "snaps", log_peak=False)
    fit(tmp_path, callback, StepModel(fake.events), max_steps=2)

    recorded = [e for e in fake.events if e[0] in ("record", "snapshot")]
    if records:
        assert recorded == [("record", "all"), ("snapshot",), ("record", None)]
        assert stems(tmp_path / "snaps") == {f"step_000001.rank{global_rank:02d}"}
    else:
        assert recorded == []
        assert names(tmp_path / "snaps") == []


def test_oom_dumps_then_propagates_when_the_whole_fit_is_recorded(tmp_path, monkeypatch):
    fake = FakeCuda().install(monkeypatch)
    callback = MemoryProfilerCallback(steps=None, dirpath=tmp_path, log_peak=False)
    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate"):
        fit(tmp_path, callback, StepModel(fake.events, oom_at=2))

    # steps=None records from setup on, so the OOM at step 2 finds a recording with history.
    assert fake.events == [
        ("record", "all"),
        ("attach",),
        ("train", 0),
        ("train", 1),
        ("train", 2),
        ("snapshot",),
        ("record", None),
    ]
    assert stems(tmp_path) == {"oom_step_000002.rank00"}
    assert (tmp_path / "oom_step_000002.rank00.png").exists()


def test_oom_outside_the_recorded_steps_warns_and_dumps_nothing(tmp_path, monkeypatch):
    fake = FakeCuda().install(monkeypatch)
    callback = MemoryProfilerCallback(steps=[4], dirpath=tmp_path, log_peak=False)
    with (
        pytest.raises(torch.OutOfMemoryError),
        pytest.warns(UserWarning, match=r"Record it with steps=\[2\]"),
    ):
        fit(tmp_path, callback, StepModel(fake.events, oom_at=2))

    assert fake.events == [("train", 0), ("train", 1), ("train", 2)]
    assert names(tmp_path) == []


def test_caught_oom_is_dumped_by_the_allocator_observer(tmp_path, monkeypatch):
    fake = FakeCuda().install(monkeypatch)
    callback = MemoryProfilerCallback(steps=["1-3"], dirpath=tmp_path, log_peak=False)
    trainer = fit(tmp_path, callback, StepModel(fake.events, oom_at=2, caught_oom=fake), max_steps=5)

    assert trainer.global_step == 5
    # The observer is attached once recording is on; the OOM at step 2 dumps, the window dumps at its end.
    assert fake.events == [
        ("train", 0),
        ("record", "all"),
        ("attach",),
        ("train", 1),
        ("train", 2),
        ("snapshot",),
        ("train", 3),
        ("snapshot",),
        ("record", None),
        ("train", 4),
    ]
    assert stems(tmp_path) == {"oom_step_000002.rank00", "step_000001-000003.rank00"}


def test_other_errors_stop_recording_without_a_dump(tmp_path, monkeypatch):
    fake = FakeCuda().install(monkeypatch)

    class Broken(StepModel):
        def training_step(self, batch, batch_idx):
            if self.trainer.global_step == 2:
                raise ValueError("a bug in the model")
            return super().training_step(batch, batch_idx)

    with pytest.raises(ValueError, match="a bug in the model"):
        fit(tmp_path, MemoryProfilerCallback(steps=["1-3"], dirpath=tmp_path), Broken(fake.events))

    assert fake.without("reset") == [
        ("train", 0),
        ("record", "all"),
        ("attach",),
        ("train", 1),
        ("record", None),
    ]
    assert names(tmp_path) == []


def test_oom_seen_by_the_observer_is_not_dumped_twice(tmp_path, monkeypatch):
    fake = FakeCuda().install(monkeypatch)

    class ObservedOOM(StepModel):
        def training_step(self, batch, batch_idx):
            if self.trainer.global_step == 1:
                fake.allocator_oom()
                raise torch.OutOfMemoryError("CUDA out of memory.")
            return super().training_step(batch, batch_idx)

    with pytest.raises(torch.OutOfMemoryError):
        fit(tmp_path, MemoryProfilerCallback(dirpath=tmp_path, log_peak=False), ObservedOOM(fake.events))

    assert fake.events.count(("snapshot",)) == 1
    assert fake.events[-1] == ("record", None)
    assert stems(tmp_path) == {"oom_step_000001.rank00"}


def test_lightning_cli_yaml_reaches_the_callback(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n"
        "  callbacks:\n"
        "    - class_path: lightning_cp.callbacks.MemoryProfilerCallback\n"
        "      init_args:\n"
        "        steps: [3, '10-12']\n"
        "        ranks: [0, 3]\n"
        "        max_entries: 5000\n"
        f"        dirpath: {tmp_path / 'snaps'}\n"
        "        stacks: all\n"
        "        dump_on_oom: false\n"
        "        log_peak: false\n"
    )
    cli = LightningCLI(BoringModel, run=False, args=["--config", str(config)], save_config_callback=None)

    [callback] = [c for c in cli.trainer.callbacks if isinstance(c, MemoryProfilerCallback)]
    assert list(callback.steps) == [3, "10-12"]
    assert callback.ranks == [0, 3]
    assert callback.max_entries == 5000
    assert Path(callback.dirpath) == tmp_path / "snaps"
    assert callback.stacks == "all"
    assert callback.dump_on_oom is False and callback.log_peak is False


def test_lightning_cli_flags_append_the_callback():
    args = [
        "--trainer.callbacks+=lightning_cp.callbacks.MemoryProfilerCallback",
        '--trainer.callbacks.steps=[2, "5-7"]',
        "--trainer.callbacks.ranks=local_zero",
    ]
    cli = LightningCLI(BoringModel, run=False, args=args, save_config_callback=None)

    [callback] = [c for c in cli.trainer.callbacks if isinstance(c, MemoryProfilerCallback)]
    assert list(callback.steps) == [2, "5-7"]
    assert callback.ranks == "local_zero"
    assert callback.max_entries == 100_000 and callback.stacks == "python"


def _ddp_fit(tmp: str, ranks: list[int], dirpaths: list[str]) -> dict:
    """One rank of a real 2-process DDP fit (gloo), with the CUDA calls faked on this rank."""
    rank = torch.distributed.get_rank()
    fake = FakeCuda()
    fake.max_allocated = (rank + 1) * GiB  # rank 1 peaks higher: the logged value is the max over ranks
    callback = MemoryProfilerCallback(steps=[1], ranks=ranks, dirpath=dirpaths[rank])
    trainer = quiet_trainer(
        default_root_dir=tmp,
        max_steps=3,
        devices=2,
        strategy="ddp",
        callbacks=[callback],
        limit_val_batches=0,
    )
    with pytest.MonkeyPatch.context() as mp:
        fake.install(mp)
        try:
            trainer.fit(StepModel(fake.events))
        except MisconfigurationException as err:
            return {"error": str(err), "events": fake.events}
    return {
        "events": fake.events,
        "peak_allocated_gib": trainer.callback_metrics["memory/peak_allocated_gib"].item(),
        "files": names(Path(dirpaths[rank])),
    }


def test_ddp_records_on_selected_ranks_and_logs_the_max_over_ranks(tmp_path, world2):
    snaps = str(tmp_path / "snaps")
    results = world2.run(_ddp_fit, str(tmp_path), [1], [snaps, snaps])

    assert [r["peak_allocated_gib"] for r in results] == [2.0, 2.0]
    assert [e for e in results[0]["events"] if e[0] in ("record", "snapshot")] == []
    assert [e for e in results[1]["events"] if e[0] in ("record", "snapshot")] == [
        ("record", "all"),
        ("snapshot",),
        ("record", None),
    ]
    assert stems(Path(snaps)) == {"step_000001.rank01.dp1-cp0-tp0"}  # plain DDP: dp = world size


def test_ddp_unwritable_dirpath_on_one_rank_fails_setup_on_every_rank(tmp_path, world2):
    (tmp_path / "a_file").write_text("")
    results = world2.run(
        _ddp_fit, str(tmp_path), [0, 1], [str(tmp_path / "ok"), str(tmp_path / "a_file" / "snaps")]
    )

    assert "cannot be written on another rank" in results[0]["error"]
    assert "a_file/snaps" in results[1]["error"] and "cannot be written on rank 1" in results[1]["error"]
    assert [r["events"] for r in results] == [[], []]  # neither rank reached a training step
