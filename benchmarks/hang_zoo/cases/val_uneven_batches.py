"""A validation sampler of one's own that does not pad: rank 0 gets 4 batches, rank 1 gets 3, and each batch's
predictions are gathered with ``self.all_gather``; rank 1 goes on to reduce the epoch's ``val_mse`` while rank 0
gathers its fourth batch ("Validation stuck when trainers have different data size", Lightning#20561)."""

import torch
from torch.utils.data import DataLoader

from benchmarks.hang_zoo.expect import Hang
from benchmarks.hang_zoo.user import Net, NoPadding, Rows, hang_starts, loader, trainer

EXPECT = Hang(rank=0, line="self.all_gather(preds)", cause="uneven data", certain=True)


class Case(Net):
    def validation_step(self, batch, batch_idx):
        if self.global_rank == 0 and batch_idx == 3:
            hang_starts()
        preds = self.layer(batch[0])
        everyone = self.all_gather(preds)
        self.log("val_mse", torch.nn.functional.mse_loss(preds, batch[1]), sync_dist=True)
        return everyone

    def val_dataloader(self):
        return DataLoader(Rows(13), batch_size=2, sampler=NoPadding(13, self.global_rank, self.trainer.world_size))


if __name__ == "__main__":
    trainer(use_distributed_sampler=False).fit(Case(), loader())
