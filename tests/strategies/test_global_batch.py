"""What a run resumed on another (dp, cp) layout is told about its global batch."""

from __future__ import annotations

from lightning_cp.strategies.global_batch import GlobalBatch, GlobalBatchRecord, global_batch_change


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
