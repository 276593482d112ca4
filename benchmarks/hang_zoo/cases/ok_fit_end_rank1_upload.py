"""Healthy: rank 1 alone uploads for 14 s in its ``on_fit_end`` (no collective) while rank 0 has finished and waits
for it at exit (lit_ddp#52's upload, on another rank and after fit): a "waiting" line, then "moved on", exit 0."""

import time

from benchmarks.hang_zoo.expect import Healthy
from benchmarks.hang_zoo.user import Net, loader, trainer

EXPECT = Healthy()


class Case(Net):
    def on_fit_end(self) -> None:
        if self.global_rank == 1:
            time.sleep(14)


if __name__ == "__main__":
    trainer().fit(Case(), loader())
