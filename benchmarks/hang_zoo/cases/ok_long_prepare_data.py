"""Healthy: a download in ``prepare_data`` longer than the watchdog's threshold; Lightning runs it on local rank 0
while rank 1 waits in Lightning's barrier after it."""

import time

from benchmarks.hang_zoo.expect import Healthy
from benchmarks.hang_zoo.user import LONG_S, Net, loader, trainer

EXPECT = Healthy()


class Case(Net):
    def prepare_data(self) -> None:
        time.sleep(LONG_S)  # the download


if __name__ == "__main__":
    trainer(max_epochs=1).fit(Case(), loader())
