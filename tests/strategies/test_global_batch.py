"""What a run resumed on another (dp, cp) layout or accumulation is told about its global batch."""

from __future__ import annotations

import warnings

import torch
from lightning.pytorch import seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_cp.data import LongRangeDataModule
from lightning_cp.models import GPTConfig, GPTModule
from lightning_cp.strategies.global_batch import GlobalBatch, GlobalBatchRecord, global_batch_change
from tests._trainer import cp_trainer


def _batch(dp: int, cp: int, batch_size: int | None = 8, accumulate: int = 1) -> GlobalBatch:
    return GlobalBatch(
        dp=dp, cp=cp, tp=1, batch_size=batch_size, accumulate_grad_batches=accumulate, seq_len=128
    )


def test_fewer_data_parallel_ranks_halve_the_global_batch_and_the_accumulation_that_keeps_it_is_named():
    message, warn = global_batch_change(_batch(2, 2), _batch(1, 4))
    assert warn
    assert message == (
        "resumed a run of dp=2 x cp=2 x tp=1, 2 x 8 x 1 = 16 samples (at most 2048 tokens at seq_len 128) as "
        "dp=1 x cp=4 x tp=1, 1 x 8 x 1 = 8 samples (at most 1024 tokens at seq_len 128): the global batch "
        "changes from 16 to 8 samples per optimizer step (dp x batch_size x accumulate_grad_batches). To keep "
        "it, set trainer.accumulate_grad_batches=2."
    )


def test_a_batch_size_keeps_it_when_no_accumulation_can():
    message, warn = global_batch_change(_batch(2, 1, batch_size=3), _batch(4, 1, batch_size=3))
    assert warn and message.endswith(
        "changes from 6 to 12 samples per optimizer step (dp x batch_size x accumulate_grad_batches)."
    )
    message, _ = global_batch_change(_batch(1, 1, batch_size=8), _batch(4, 1, batch_size=8, accumulate=1))
    assert message.endswith("To keep it, set data.batch_size=2.")


def test_the_same_global_batch_on_another_layout_is_information_and_the_same_layout_is_nothing():
    assert global_batch_change(_batch(2, 2), _batch(1, 4, accumulate=2)) == (
        (
            "resumed a run of dp=2 x cp=2 x tp=1, 2 x 8 x 1 = 16 samples (at most 2048 tokens at seq_len 128) as "
            "dp=1 x cp=4 x tp=1, 1 x 8 x 2 = 16 samples (at most 2048 tokens at seq_len 128): the same 16 samples "
            "per optimizer step."
        ),
        False,
    )
    assert global_batch_change(_batch(2, 2), _batch(2, 2)) is None


def test_a_loader_without_batch_size_warns_when_dp_changes():
    _, warn = global_batch_change(_batch(2, 2, batch_size=None), _batch(1, 4, batch_size=None))
    assert warn
    _, warn = global_batch_change(_batch(2, 2, batch_size=None), _batch(2, 1, batch_size=None))
    assert not warn


def test_the_record_round_trips_through_a_checkpoint_state():
    record = GlobalBatchRecord()
    assert record.state_dict() == {}
    record._now = _batch(2, 2)
    restored = GlobalBatchRecord()
    restored.load_state_dict(record.state_dict())
    assert restored._before == _batch(2, 2)


def test_another_accumulation_alone_changes_the_global_batch_and_the_one_that_keeps_it_is_named():
    message, warn = global_batch_change(_batch(2, 2), _batch(2, 2, accumulate=3))
    assert warn and message.endswith(
        "the global batch changes from 16 to 48 samples per optimizer step (dp x batch_size x "
        "accumulate_grad_batches). To keep it, set trainer.accumulate_grad_batches=1."
    )


def _fit(directory: str, accumulate: int, ckpt_path: str | None = None) -> tuple[dict, list[str]]:
    """Every rank: 4 optimizer steps (an epoch is 12 batches) at dp=1 x cp=2, a checkpoint after step 3;
    returns the final weights and the warnings rank 0 gave."""
    seed_everything(0)
    module = GPTModule(GPTConfig(vocab_size=32, n_layer=1, n_head=2, n_embd=16), lr=1e-2)
    data = LongRangeDataModule(
        vocab_size=32, seq_len=16, num_train_samples=24, num_val_samples=4, batch_size=2
    )
    trainer = cp_trainer(
        2,
        max_steps=4,
        limit_val_batches=0,
        enable_checkpointing=True,
        accumulate_grad_batches=accumulate,
        callbacks=[ModelCheckpoint(dirpath=directory, every_n_train_steps=3, save_top_k=-1)],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, data, ckpt_path=ckpt_path)
    said = [
        str(w.message) for w in caught if str(w.message).startswith(("resumed", "the first optimizer step"))
    ]
    return {name: tensor.clone() for name, tensor in module.state_dict().items()}, said


def _resumed_with_another_accumulation(directory: str) -> list:
    uninterrupted = _fit(f"{directory}/first", accumulate=1)
    checkpoint = f"{directory}/first/epoch=0-step=3.ckpt"  # 3 batches of the epoch done
    return [uninterrupted, _fit(f"{directory}/x2", 2, checkpoint), _fit(f"{directory}/x3", 3, checkpoint)]


def test_a_resume_with_another_accumulation_says_so_and_that_its_first_step_is_short(world2, tmp_path):
    """Resumed after 3 batches with 2 per step, Lightning steps after 1 batch: said after that step, and the
    step is exactly the uninterrupted run's step on that batch (the loss the mean over its own tokens).
    With 3 per step the first window is whole: only the global batch is said."""
    (weights, said), (short, short_said), (_, whole_said) = world2.run(
        _resumed_with_another_accumulation, str(tmp_path)
    )[0]
    assert said == []
    head = "resumed a run of dp=1 x cp=2 x tp=1, 1 x 2 x 1 = 2 samples (at most 32 tokens at seq_len 16) as "
    changed = (
        f"{head}dp=1 x cp=2 x tp=1, 1 x 2 x 2 = 4 samples (at most 64 tokens at seq_len 16): the global batch "
        "changes from 2 to 4 samples per optimizer step (dp x batch_size x accumulate_grad_batches). To keep it, "
        "set trainer.accumulate_grad_batches=1."
    )
    short_first_step = (
        "the first optimizer step after resuming (step 4) accumulated 1 micro-batch(es), not "
        "accumulate_grad_batches=2: the run resumed in the middle of an epoch with accumulate_grad_batches "
        "changed from 1, and Lightning counts the accumulation from the epoch's first batch. Its loss is the "
        "mean over its own tokens; the next steps accumulate 2. Resume with the same accumulate_grad_batches, "
        "or from a checkpoint at the end of an epoch, to keep every step's batch."
    )
    assert short_said == [changed, short_first_step]
    for name, tensor in weights.items():
        torch.testing.assert_close(short[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    assert len(whole_said) == 1 and whole_said[0].startswith(head)
