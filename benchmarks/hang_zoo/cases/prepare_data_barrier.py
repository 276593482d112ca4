"""A collective in ``prepare_data``, which Lightning calls on local rank 0 only (Lightning#7202: prepare_data and the
barriers around setup): rank 0 waits in the barrier, rank 1 in Lightning's own after prepare_data."""

from benchmarks.hang_zoo.expect import Hang
from benchmarks.hang_zoo.user import Net, hang_starts, loader, trainer

EXPECT = Hang(rank=0, line="self.trainer.strategy.reduce(", cause="collective on some ranks", certain=True)


class Case(Net):
    def prepare_data(self) -> None:
        hang_starts()
        self.files = self.trainer.strategy.reduce(self.layer.weight.sum(), reduce_op="sum")


if __name__ == "__main__":
    trainer().fit(Case(), loader())
