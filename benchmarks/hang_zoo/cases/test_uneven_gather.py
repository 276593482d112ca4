"""A test sharded by hand without padding, 4 batches on rank 0 and 3 on rank 1, each batch's predictions gathered
with ``self.all_gather``: rank 1 ends its test and its script while rank 0 gathers its fourth batch (Lightning#12862:
"unevenly and sequentially distribute test data to multiple GPU ... gather generated translations")."""

from torch.utils.data import DataLoader

from benchmarks.hang_zoo.expect import Hang
from benchmarks.hang_zoo.user import Net, NoPadding, Rows, hang_starts, loader, trainer

EXPECT = Hang(rank=0, line="self.all_gather(preds)", cause="uneven data", certain=True)


class Case(Net):
    def test_step(self, batch, batch_idx):
        if self.global_rank == 0 and batch_idx == 3:
            hang_starts()
        preds = self.layer(batch[0])
        return self.all_gather(preds)


if __name__ == "__main__":
    fit = trainer(max_epochs=1, use_distributed_sampler=False)
    model = Case()
    fit.fit(model, loader())
    fit.test(model, DataLoader(Rows(13), batch_size=2, sampler=NoPadding(13, fit.global_rank, fit.world_size)))
