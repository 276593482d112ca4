"""A barrier in ``setup`` under ``if self.global_rank == 0``: before any step, rank 1 goes on to DDP's broadcast of
the weights while rank 0 waits in the barrier. Found by lit_ddp#48 (over 200 s, nothing printed); the setup-barrier
discussion of Lightning#7202."""

from benchmarks.hang_zoo.expect import Hang
from benchmarks.hang_zoo.user import Net, hang_starts, loader, trainer

EXPECT = Hang(rank=0, line="self.trainer.strategy.barrier()", cause="collective on some ranks", certain=True)


class Case(Net):
    def setup(self, stage: str) -> None:
        if self.global_rank == 0:
            hang_starts()
            self.trainer.strategy.barrier()


if __name__ == "__main__":
    trainer().fit(Case(), loader())
