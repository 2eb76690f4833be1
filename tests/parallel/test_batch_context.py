"""The per-batch record that attention without arguments reads."""

import pytest
import torch

from lightning_cp.parallel import shard_batch
from lightning_cp.parallel.batch_context import current_batch, set_current_batch


def test_records_the_layout_and_positions_of_a_sharded_batch_until_cleared():
    batch = shard_batch({"input_ids": torch.arange(10).view(2, 5)}, 1, 0)
    set_current_batch(batch)
    try:
        record = current_batch()
        assert record.cp_shard is batch["cp_shard"] and record.position_ids is batch["position_ids"]
        assert not record.positions_checked
    finally:
        set_current_batch(None)
    assert current_batch() is None


def test_an_unsharded_batch_is_rejected():
    with pytest.raises(ValueError, match=r"no \['cp_shard', 'position_ids'\].*shard_batch"):
        set_current_batch({"input_ids": torch.zeros(1, 4, dtype=torch.long)})
    assert current_batch() is None
