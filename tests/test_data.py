import json

import pytest
import torch
from lightning.pytorch import Callback

from lit_ddp import FixedBatchDataModule, LinearRegression
from lit_ddp.lab.data import global_batch, shard


def test_shards_partition_the_global_batch():
    x, y = global_batch(dim=8, rows=12, seed=3)
    shards = [shard(dim=8, batch_size=4, seed=3, rank=r, world_size=3) for r in range(3)]
    assert torch.equal(torch.cat([s[0] for s in shards]), x)
    assert torch.equal(torch.cat([s[1] for s in shards]), y)
    assert not torch.equal(shards[0][0], shards[1][0])


def test_global_batch_depends_only_on_seed_and_size():
    """N ranks x batch B and 1 rank x batch N*B draw the very same rows."""
    two_ranks = torch.cat([shard(8, 4, 0, r, 2)[0] for r in range(2)])
    one_rank = shard(8, 8, 0, 0, 1)[0]
    assert torch.equal(two_ranks, one_rank)
    assert not torch.equal(global_batch(8, 8, seed=0)[0], global_batch(8, 8, seed=1)[0])


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="batch_size=0"):
        FixedBatchDataModule(batch_size=0)


class RecordBatches(Callback):
    """Per rank: the rows trained on, and whether every step reused the same device tensors."""

    def __init__(self, out_dir):
        self.out_dir = out_dir
        self.ptrs = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.ptrs.append((batch[0].data_ptr(), batch[1].data_ptr()))
        self.first_row = batch[0][0, :4].tolist()

    def on_train_end(self, trainer, pl_module):
        result = {"first_row": self.first_row, "same_tensors": len(set(self.ptrs)) == 1, "steps": len(self.ptrs)}
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def test_ranks_train_on_different_rows_of_one_fixed_batch(make_trainer, tmp_path):
    trainer = make_trainer(max_steps=3, callbacks=[RecordBatches(tmp_path)])
    trainer.fit(LinearRegression(dim=16), FixedBatchDataModule(dim=16, batch_size=4, seed=7))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    expected_x, _ = global_batch(dim=16, rows=8, seed=7)
    for rank, result in enumerate(ranks):
        assert result["steps"] == 3
        assert result["same_tensors"], "the batch must be placed once and reused, not copied every step"
        assert result["first_row"] == pytest.approx(expected_x[4 * rank, :4].tolist())
    assert ranks[0]["first_row"] != ranks[1]["first_row"]
