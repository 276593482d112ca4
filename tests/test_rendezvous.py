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


class Store:
    """The rendezvous store's calls ``meet`` makes, in a dict."""

    def __init__(self) -> None:
        self.data: dict[str, object] = {}

    def set(self, key, value):
        self.data[key] = value

    def get(self, key):
        value = self.data[key]
        return value.encode() if isinstance(value, str) else value

    def check(self, keys):
        return all(k in self.data for k in keys)

    def add(self, key, n):
        self.data[key] = int(self.data.get(key, 0)) + n
        return self.data[key]


def test_rank_0_says_who_joined_every_10_s_and_names_the_missing_node_at_the_start_timeout(monkeypatch, capsys):
    """4 ranks, 2 a node: node 0's joined, node 1's never do."""
    from lit_ddp.errors import StartTimeoutError
    from lit_ddp.run import rendezvous

    store, now = Store(), [0.0]
    store.set(f"{rendezvous.STARTED}1", '{"rank": 1, "host": "a", "num_nodes": 2}')
    store.add(rendezvous.JOINED, 1)

    def tick(seconds):
        now[0] += 0.2

    monkeypatch.setattr(rendezvous.time, "sleep", tick)
    with pytest.raises(StartTimeoutError) as raised:
        rendezvous.meet(store, 0, 4, 25.0, {"host": "a", "num_nodes": 2}, 2, "10.0.0.1:29500", lambda: now[0])
    line = str(raised.value)
    assert line.startswith("ranks 2, 3 (node 1) never joined rank 0's store at 10.0.0.1:29500 in 25 s; joined: "
                           "ranks 0, 1 (node 0, host a, num_nodes 2) -> a node that never joined: ")  # fmt: skip
    said = capsys.readouterr().err.splitlines()
    assert [s.split(" for ")[0] for s in said] == ["lit_ddp: waiting 10 s", "lit_ddp: waiting 20 s"]
    assert store.data[rendezvous.FAILED] == line  # the other ranks that joined raise it too
    with pytest.raises(StartTimeoutError, match="never joined"):
        rendezvous.meet(store, 1, 4, 25.0, {}, 2, "10.0.0.1:29500", lambda: now[0])


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_under_lightnings_launcher_a_node_that_never_starts_is_named_in_one_line(tmp_path):
    from tests.runner import run_fit

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "NODE_RANK": "0"}
    result = run_fit("--trainer.num_nodes", "2", "--devices", "1", "--trainer.strategy.timeout_s", "15",
                     cwd=tmp_path, env=env, timeout=150)  # fmt: skip
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "lit-ddp-fit: StartTimeoutError: rank 1 (node 1) never joined rank 0's store at "
        f"127.0.0.1:{env['MASTER_PORT']} in 15 s; joined: rank 0 (node 0, "
    ), result.stderr[-2000:]
    assert "lit-ddp-fit: waiting 10 s for rank 1 (node 1) to join" in result.stderr


def test_a_watch_beside_torchs_rendezvous_stops_meeting_once_the_group_exists_and_names_a_rank_of_a_started_node(
    monkeypatch, capsys
):
    """``done``: the process group exists (every rank came, whichever joined the watch's keys); a rank missing from a
    node whose other ranks joined is named as one that never reached fit, not as a node that never started."""
    from lit_ddp.errors import StartTimeoutError
    from lit_ddp.run import rendezvous

    store, now = Store(), [0.0]

    def tick(seconds):
        now[0] += 0.2

    monkeypatch.setattr(rendezvous.time, "sleep", tick)
    rendezvous.meet(store, 0, 2, 25.0, {"host": "a"}, 2, "127.0.0.1:29500", lambda: now[0], done=lambda: now[0] > 12)
    assert 12 < now[0] < 13 and rendezvous.FAILED not in store.data  # said once at 10 s, then the group came
    assert capsys.readouterr().err.startswith("lit_ddp: waiting 10 s for rank 1 (node 0) to join")
    with pytest.raises(StartTimeoutError) as raised:
        rendezvous.meet(Store(), 0, 2, 5.0, {"host": "a"}, 2, "127.0.0.1:29500", lambda: now[0])
    assert str(raised.value).endswith("-> a rank that started on its node but never reached fit: what its script "
                                      "does before (a slow read, a wait of its own; its log)")  # fmt: skip
