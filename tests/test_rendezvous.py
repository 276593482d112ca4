"""The loopback rendezvous: the ranks' start is not held to a collective's timeout."""

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lit_ddp.run.rendezvous import init_loopback_process_group
from tests.runner import free_port

TIMEOUT = timedelta(seconds=1)
LATE_S = 2.5  # 2.5x the collectives timeout


def _rank(rank: int, world_size: int, port: int, late: int, results) -> None:
    if rank == late:
        time.sleep(LATE_S)  # a rank whose start (torch's import, on a loaded machine) outlasts the timeout
    init_loopback_process_group("gloo", rank, world_size, port, TIMEOUT, torch.device("cpu"))
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    results[rank] = (total.item(), dist.distributed_c10d._get_default_store().timeout)
    dist.destroy_process_group()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("late", [0, 2])  # the store's host, or a client that every other rank waits for
def test_a_rank_that_starts_later_than_the_collectives_timeout_still_joins(late):
    world_size = 3
    with mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_rank, args=(world_size, free_port(), late, results), nprocs=world_size,
                           start_method="spawn")  # fmt: skip
        found = dict(results)
    assert found == {r: (3.0, TIMEOUT) for r in range(world_size)}  # 0 + 1 + 2 on every rank; then 1 s a wait
