"""A validation sharded by hand, 4 batches on rank 0 and 3 on rank 1, each batch's predictions gathered with
``self.all_gather`` and nothing logged: rank 0 gathers its fourth batch while rank 1 is back in training, at its next
step's gradient all-reduce ("Validation loop hangs", torchtitan#1618: one rank at batch 89 of its shard, the other at
86, where the shards differ in length)."""

from torch.utils.data import DataLoader

from benchmarks.hang_zoo.expect import Hang
from benchmarks.hang_zoo.user import Net, NoPadding, Rows, hang_starts, loader, trainer

EXPECT = Hang(rank=0, line="self.all_gather(preds)", cause="uneven data", certain=True)


class Case(Net):
    def validation_step(self, batch, batch_idx):
        if self.global_rank == 0 and batch_idx == 3:
            hang_starts()
        preds = self.layer(batch[0])
        return self.all_gather(preds)

    def val_dataloader(self):
        return DataLoader(Rows(13), batch_size=2, sampler=NoPadding(13, self.global_rank, self.trainer.world_size))


if __name__ == "__main__":
    trainer(use_distributed_sampler=False, val_check_interval=4).fit(Case(), loader())
