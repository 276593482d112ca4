"""The loopback rendezvous: the ranks' start is not held to a collective's timeout."""

import threading
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


def test_rank_0_says_who_joined_at_5_s_then_every_10_s_and_names_the_missing_node_at_the_start_timeout(
    monkeypatch, capsys
):
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
    assert [s.split(" for ")[0] for s in said] == ["lit_ddp: waiting 5 s", "lit_ddp: waiting 15 s"]
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
    assert "lit-ddp-fit: waiting 5 s for rank 1 (node 1) to join" in result.stderr


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_under_lightnings_launcher_a_node_whose_rank_0_never_starts_names_it_in_one_line(tmp_path):
    """Node 1 started alone: nothing listens at MASTER_ADDR:MASTER_PORT. Its first rank (not rank 0, which never
    came) names node 0, and the job exits 1 at the start's timeout; before, torch's client dialed past it in silence
    and ended in a C++ traceback."""
    from tests.runner import run_fit

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "NODE_RANK": "1"}
    result = run_fit("--trainer.num_nodes", "2", "--devices", "1", "--trainer.strategy.timeout_s", "8",
                     cwd=tmp_path, env=env, timeout=150)  # fmt: skip
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(
        f"lit-ddp-fit: StartTimeoutError: rank 0 (node 0) never joined: its store at 127.0.0.1:{env['MASTER_PORT']} "
        "did not answer rank 1 (node 1, host "
    ), result.stderr[-2000:]
    assert "-> a node that never started, or out of reach" in last
    assert "lit-ddp-fit: waiting 5 s: rank 0 (node 0) has not joined" in result.stderr


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
    assert 12 < now[0] < 13 and rendezvous.FAILED not in store.data  # said once at 5 s, then the group came
    assert capsys.readouterr().err.startswith("lit_ddp: waiting 5 s for rank 1 (node 0) to join")
    with pytest.raises(StartTimeoutError) as raised:
        rendezvous.meet(Store(), 0, 2, 5.0, {"host": "a"}, 2, "127.0.0.1:29500", lambda: now[0])
    assert str(raised.value).endswith("-> a rank that started on its node but never reached fit: what its script "
                                      "does before (a slow read, a wait of its own; its log)")  # fmt: skip


def test_a_rank_whose_store_host_never_answers_says_so_at_5_s_then_every_10_s_and_names_node_0_at_the_start_timeout(
    monkeypatch, capsys
):
    """Nothing listens at rank 0's address (its node never started): rank 2, the first of node 1, says so, names node
    0 at the start's timeout with how this rank was started, and dials no more; rank 3 keeps quiet."""
    from lit_ddp.errors import StartTimeoutError
    from lit_ddp.run import rendezvous

    now, port = [0.0], free_port()  # free: nothing listens there

    def tick(seconds):
        now[0] += 0.2

    monkeypatch.setattr(rendezvous.time, "sleep", tick)
    started = {"host": "b", "num_nodes": 2, "devices": 2}
    with pytest.raises(StartTimeoutError) as raised:
        rendezvous.reach("127.0.0.1", port, 2, 2, 25.0, started, clock=lambda: now[0])
    assert str(raised.value).startswith(
        f"rank 0 (node 0) never joined: its store at 127.0.0.1:{port} did not answer rank 2 (node 1, host b, "
        "num_nodes 2, devices 2) in 25 s (Connection refused) -> a node that never started, or out of reach: start "
        "node 0 (NODE_RANK 0) with the same MASTER_ADDR and MASTER_PORT"
    )
    said = capsys.readouterr().err.splitlines()
    assert [s.split(":")[1] for s in said] == [" waiting 5 s", " waiting 15 s"]
    assert said[0].endswith(f"rank 0 (node 0) has not joined, its store at 127.0.0.1:{port} does not answer rank 2 "
                            "(node 1, host b, num_nodes 2, devices 2) (Connection refused)")  # fmt: skip
    assert raised.value.speaks  # rank 0 never came: this rank says it (lit_ddp.run.lifecycle.exit_code)
    now[0] = 0.0
    with pytest.raises(StartTimeoutError) as quiet:
        rendezvous.reach("127.0.0.1", port, 3, 2, 25.0, started, speak=False, clock=lambda: now[0])
    assert capsys.readouterr().err == "" and not quiet.value.speaks
    assert not rendezvous.reach("127.0.0.1", port, 3, 2, 25.0, started, done=lambda: now[0] > 3)  # the group came


@pytest.mark.timeout(60)
def test_a_rank_that_dials_before_its_store_listens_reaches_it_once_it_does():
    """Rank 0's node starts 1 s after this one: the dial waits for it, quietly, and the store then answers."""
    from lit_ddp.run import rendezvous

    port = free_port()
    opened = threading.Timer(1.0, lambda: opened.store.append(dist.TCPStore("127.0.0.1", port, 2, is_master=True,
                                                                            wait_for_workers=False)))  # fmt: skip
    opened.store = []
    opened.start()
    assert rendezvous.reach("127.0.0.1", port, 1, 1, 30.0, {})
    opened.join()
    client = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=10))
    client.set("k", "v")
    assert opened.store[0].get("k") == b"v"
