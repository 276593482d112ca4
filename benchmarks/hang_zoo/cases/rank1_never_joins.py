"""Rank 1 never reaches the rendezvous (a slow mount, a dataset read before the Trainer): rank 0 is "stuck at
Initializing distributed" (Lightning#10098, #19817)."""

import os
import time

from benchmarks.hang_zoo.expect import Hang
from benchmarks.hang_zoo.user import Net, hang_starts, loader, trainer

EXPECT = Hang(rank=1, line=None, cause="never joined")

if __name__ == "__main__":
    # Rank 1: Lightning's launcher started this process as rank 1, or srun as task 1 (Slurm starts every rank).
    if os.environ.get("LOCAL_RANK", os.environ.get("SLURM_PROCID")) == "1":
        hang_starts()
        time.sleep(3600)
    trainer().fit(Net(), loader())
