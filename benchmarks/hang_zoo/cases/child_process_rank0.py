"""Rank 0, the one that launched the others, runs a command in its step that never returns (``subprocess.run``, no
timeout): rank 1 times out, and Lightning's child-process observer in rank 0 SIGKILLs every rank and rank 0 itself
(Lightning#11841: a job that freezes without errors). The child must not outlive the job: it is killed first."""

import subprocess

from benchmarks.hang_zoo.expect import Hang
from benchmarks.hang_zoo.user import Net, hang_starts, loader, trainer

EXPECT = Hang(rank=0, line='subprocess.run(["sleep", "3600"])', cause="outside any collective")


class Case(Net):
    def training_step(self, batch, batch_idx):
        if self.global_rank == 0 and self.global_step == 3:
            hang_starts()
            subprocess.run(["sleep", "3600"])
        return self.loss(batch)


if __name__ == "__main__":
    trainer().fit(Case(), loader())
