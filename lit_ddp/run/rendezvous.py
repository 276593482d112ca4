"""The rendezvous of the ranks Lightning's launcher starts: which joined, said 5 s into the wait and every 10 s after
while some have not, and one line naming the missing ranks and nodes at the start's timeout (the store's host too,
where it never answers); on one machine, on loopback only (torch alone: the all-reduce probe's ranks use it too).

python -m lit_ddp.fit --devices 2        # the rank-0 store listens on 127.0.0.1:<port>, nowhere else
"""

import json
import socket
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from lit_ddp.errors import StartTimeoutError, prog

# How long the ranks may take to start and meet, whatever a collective's own timeout: importing torch and Lightning
# in 16 processes at once on 2 loaded cores took over 11 s here (a 10 s `timeout_s` failed the rendezvous). A rank
# that dies before it arrives still ends the job at once: Lightning's `ddp` launcher watches its children, torch's
# multiprocessing its processes, torchrun its workers.
START_TIMEOUT = timedelta(minutes=5)
ALL_ARRIVED = "lit_ddp/rendezvous/all_arrived"
JOINED = "lit_ddp/rendezvous/joined"  # how many ranks have joined (a counter)
STARTED = "lit_ddp/rendezvous/rank/"  # + rank: where and how that rank was started, as JSON
FAILED = "lit_ddp/rendezvous/failed"  # rank 0's line at the start's timeout: every rank raises it
# Rank 0 says who joined FIRST_PROGRESS_S into the wait, then every PROGRESS_S while some have not. The first comes
# early: a job whose node never starts is named then, and rank 0's own start (importing Lightning) took about 6 s of
# the first 15 here; a node a few seconds late is only "waiting", never "never joined", until the start's timeout.
FIRST_PROGRESS_S = 5.0
PROGRESS_S = 10.0
DIAL_S = 1.0  # one attempt to reach rank 0's store (a dropped SYN waits this long, a refused one not at all)


def init_loopback_process_group(
    backend: str, rank: int, world_size: int, port: int, timeout: Optional[timedelta], device: torch.device
) -> None:
    """The process group of a one-machine run, its rendezvous store listening on 127.0.0.1 only; ``timeout``
    ``None``: torch's default. The ranks meet within ``START_TIMEOUT`` at least (their start), and the store's
    operations have ``timeout`` from then on.

    Through ``env://`` the rank-0 TCPStore listens on every interface, and torch's SECURITY.md warns that its
    distributed features accept connections from anywhere.
    """
    listen_fd = None
    if rank == 0:
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", port))
        server.listen()
        listen_fd = server.detach()  # the store owns the descriptor from here on
    op_timeout = timeout or dist.default_pg_timeout
    init_process_group(backend, rank, world_size, "127.0.0.1", port, timeout, device,
                       max(op_timeout, START_TIMEOUT), {}, world_size, listen_fd)  # fmt: skip


def init_process_group(backend: str, rank: int, world_size: int, address: str, port: int,
                       timeout: Optional[timedelta], device: torch.device, start_timeout: timedelta,
                       started: dict[str, Any], ranks_per_node: int,
                       listen_fd: Optional[int] = None) -> None:  # fmt: skip
    """The process group, after every rank has joined rank 0's store at ``address:port`` (``meet``); ``started``:
    how this rank was started (its host, node, settings), for the line that names the ranks that never joined."""
    op_timeout = timeout or dist.default_pg_timeout
    # Rank 0's store does not wait for its clients in its constructor (``meet`` does, saying who joined); each
    # client retries until it connects, within the start's limit. Then every rank waits for rank 0's word that all
    # have, so none begins the backend's own rendezvous (whose waits have the collectives' timeout) while another
    # is still starting.
    if rank != 0:  # torch's client would dial in silence, and past the timeout (see ``reach``)
        reach(address, port, rank, ranks_per_node, start_timeout.total_seconds(), started,
              speak=rank % ranks_per_node == 0)  # fmt: skip
    store = dist.TCPStore(address, port, world_size, is_master=rank == 0, timeout=max(op_timeout, start_timeout),
                          master_listen_fd=listen_fd, wait_for_workers=False)  # fmt: skip
    meet(store, rank, world_size, start_timeout.total_seconds(), started, ranks_per_node, f"{address}:{port}")
    store.set_timeout(op_timeout)
    # device_id binds the NCCL communicator to this rank's GPU up front (no "using the device under current
    # context" guess in barrier()); gloo takes none.
    device_id = device if device.type == "cuda" else None
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=timeout, device_id=device_id
    )


def meet(store: dist.Store, rank: int, world_size: int, start_timeout_s: float, started: dict[str, Any],
         ranks_per_node: int, where: str, clock=time.monotonic,
         done: Callable[[], bool] = lambda: False) -> None:  # fmt: skip
    """Every rank joins; rank 0 waits for all, says who joined at ``FIRST_PROGRESS_S`` and every ``PROGRESS_S`` after
    while some have not, and at ``start_timeout_s`` raises ``StartTimeoutError`` naming the missing ranks and nodes
    (so does every rank that joined). ``done``: the start is over by other means (a watch beside torch's own
    rendezvous: the process group exists, so every rank came)."""
    store.set(f"{STARTED}{rank}", json.dumps({"rank": rank, **started}))
    store.add(JOINED, 1)
    begun, said = clock(), 0
    while True:
        if done():
            return
        if rank == 0 and store.add(JOINED, 0) >= world_size:
            store.set(ALL_ARRIVED, "1")
            return
        if rank != 0 and store.check([ALL_ARRIVED]):
            return
        if store.check([FAILED]):
            raise StartTimeoutError(store.get(FAILED).decode())
        waited = clock() - begun
        if rank == 0 and waited >= start_timeout_s:
            line = who_joined(store, world_size, ranks_per_node, where, waited, final=True)
            store.set(FAILED, line)
            raise StartTimeoutError(line)
        if rank == 0 and waited >= FIRST_PROGRESS_S + said * PROGRESS_S:
            said += 1
            print(f"{prog()}: {who_joined(store, world_size, ranks_per_node, where, waited)}", file=sys.stderr,
                  flush=True)  # fmt: skip
        time.sleep(0.2)


def reach(address: str, port: int, rank: int, ranks_per_node: int, start_timeout_s: float, started: dict[str, Any],
          speak: bool = True, clock=time.monotonic, done: Callable[[], bool] = lambda: False) -> bool:  # fmt: skip
    """Dials rank 0's store at ``address:port`` until it answers (True), or ``done`` (False): rank 0's node may start
    after this one. While it does not, says so at ``FIRST_PROGRESS_S`` and every ``PROGRESS_S`` (``speak``: the
    first rank of a node, one voice a node), and at ``start_timeout_s`` raises ``StartTimeoutError`` naming rank 0's
    node. torch's own client (TCPStore, torch 2.13) dials in silence until its timeout, then warns "retrying" and
    dials again after a backoff of tens of seconds, and ends in a C++ traceback: a job whose node 0 never started
    said no word of node 0 in 120 s (the zoo's ``nodes_rank0_never_starts``, killed then by the zoo's runner)."""
    where, me = f"{address}:{port}", f"rank {rank} (node {rank // ranks_per_node}"
    how = ", ".join(f"{k} {v}" for k, v in started.items() if k != "rank")
    me += f", {how})" if how else ")"
    begun, said = clock(), 0
    while not done():
        try:
            socket.create_connection((address, port), timeout=DIAL_S).close()
            return True
        except OSError as err:  # refused: nothing listens yet; timed out: dropped on the way, or no such host yet
            why = err.strerror or type(err).__name__
        waited = clock() - begun
        if waited >= start_timeout_s:
            raise StartTimeoutError(
                f"rank 0 (node 0) never joined: its store at {where} did not answer {me} in {waited:.0f} s ({why}) "
                f"-> a node that never started, or out of reach: start node 0 (NODE_RANK 0) with the same MASTER_ADDR "
                f"and MASTER_PORT, and check that this node reaches {where} (a firewall, a partition)",
                speaks=speak,
            )
        if speak and waited >= FIRST_PROGRESS_S + said * PROGRESS_S:
            said += 1
            print(f"{prog()}: waiting {waited:.0f} s: rank 0 (node 0) has not joined, its store at {where} does not "
                  f"answer {me} ({why})", file=sys.stderr, flush=True)  # fmt: skip
        time.sleep(0.2)
    return False


def who_joined(store: dist.Store, world_size: int, ranks_per_node: int, where: str, waited: float,
               final: bool = False) -> str:  # fmt: skip
    """``ranks 2, 3 (node 1) never joined rank 0's store at 10.0.0.1:29500 in 60 s; joined: ranks 0, 1 (node 0,
    host a, started with num_nodes 2, devices 2) -> ...``, or while waiting ``waiting 5 s for ranks 2, 3 ...``."""
    joined = {r: json.loads(store.get(f"{STARTED}{r}")) for r in range(world_size) if store.check([f"{STARTED}{r}"])}
    missing = [r for r in range(world_size) if r not in joined]
    nodes = sorted({r // ranks_per_node for r in missing})
    missing_text = f"{_ranks(missing)} (node{'s' if len(nodes) > 1 else ''} {', '.join(map(str, nodes))})"
    by_node: dict[str, list[int]] = {}
    for r, info in joined.items():
        how = ", ".join(f"{k} {v}" for k, v in info.items() if k not in ("rank", "host"))
        by_node.setdefault(f"node {r // ranks_per_node}, host {info.get('host', '?')}" + (f", {how}" if how else ""),
                           []).append(r)  # fmt: skip
    joined_text = "; ".join(f"{_ranks(rs)} ({node})" for node, rs in by_node.items())
    if not final:
        return (f"waiting {waited:.0f} s for {missing_text} to join rank 0's store at {where}; joined: "
                f"{joined_text}")  # fmt: skip
    if all(node in {r // ranks_per_node for r in joined} for node in nodes):  # their nodes started: they did not
        fix = ("a rank that started on its node but never reached fit: what its script does before (a slow read, a "
               "wait of its own; its log)")  # fmt: skip
    else:
        fix = (f"a node that never joined: start it with the same MASTER_ADDR and MASTER_PORT and its NODE_RANK, and "
               f"check that it reaches {where} (a firewall, a partition)")  # fmt: skip
    return f"{missing_text} never joined rank 0's store at {where} in {waited:.0f} s; joined: {joined_text} -> {fix}"


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
