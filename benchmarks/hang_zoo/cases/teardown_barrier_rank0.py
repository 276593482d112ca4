"""A barrier at the end of training on rank 0 only, "to wait for the others" before writing results: rank 1 has
already left (GestaltCogTeam/BasicTS#250: "train will hang with ddp when the process exit")."""

from benchmarks.hang_zoo.expect import Hang
from benchmarks.hang_zoo.user import Net, hang_starts, loader, trainer

EXPECT = Hang(rank=0, line='self.trainer.strategy.barrier("results")', cause="collective on some ranks",
              certain=True)  # fmt: skip


class Case(Net):
    def on_train_end(self) -> None:
        if self.global_rank == 0:
            hang_starts()
            self.trainer.strategy.barrier("results")


if __name__ == "__main__":
    trainer(max_epochs=1).fit(Case(), loader())
