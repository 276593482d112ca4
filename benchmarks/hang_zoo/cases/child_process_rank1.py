"""Rank 1 runs a command in its step that never returns (``subprocess.run`` of a stuck tool, no timeout): it waits
for its child process, outside any collective, while rank 0 waits in the all-reduce (Lightning#11841: a job that
freezes without errors). The child must not outlive the job: ``subprocess`` runs no at-fork hook, so it does not
die with its rank by itself."""

import subprocess

from benchmarks.hang_zoo.expect import Hang
from benchmarks.hang_zoo.user import Net, hang_starts, loader, trainer

EXPECT = Hang(rank=1, line='subprocess.run(["sleep", "3600"])', cause="outside any collective")


class Case(Net):
    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and self.global_step == 3:
            hang_starts()
            subprocess.run(["sleep", "3600"])
        return self.loss(batch)


if __name__ == "__main__":
    trainer().fit(Case(), loader())
