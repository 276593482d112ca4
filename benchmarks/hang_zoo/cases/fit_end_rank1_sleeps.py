"""Rank 1 never finishes its ``on_fit_end`` (an upload that does not return, no collective), after training's last
collective: no peer waits in a collective, so no timeout fires; rank 0 left at exit with the job's store, exit 0, and
rank 1 ran on ("sometimes train will hang with ddp when the process exit", GestaltCogTeam/BasicTS#250; Lightning#11841:
a job that freezes without errors)."""

import time

from benchmarks.hang_zoo.expect import Hang
from benchmarks.hang_zoo.user import Net, hang_starts, loader, trainer

EXPECT = Hang(rank=1, line="time.sleep(3600)", cause="outside any collective")


class Case(Net):
    def on_fit_end(self) -> None:
        if self.global_rank == 1:
            hang_starts()
            time.sleep(3600)


if __name__ == "__main__":
    trainer().fit(Case(), loader())
