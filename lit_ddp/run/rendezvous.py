"""The rendezvous of a one-machine run, on loopback only (torch alone: the all-reduce probe's ranks use it too).

python -m lit_ddp.fit --devices 2        # the rank-0 store listens on 127.0.0.1:<port>, nowhere else
"""

import socket
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

# How long the ranks may take to start and meet, whatever a collective's own timeout: importing torch and Lightning
# in 16 processes at once on 2 loaded cores took over 11 s here (a 10 s `timeout_s` failed the rendezvous). A rank
# that dies before it arrives still ends the job at once: Lightning's `ddp` launcher watches its children, torch's
# multiprocessing its processes, torchrun its workers.
START_TIMEOUT = timedelta(minutes=5)
ALL_ARRIVED = "lit_ddp/rendezvous/all_arrived"


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
    # Rank 0's store waits for every client to connect, each client retries until it does: both within the start's
    # limit. Then every rank waits for rank 0's word that all have, so none begins the backend's own rendezvous
    # (whose waits have the collectives' timeout) while another is still starting.
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0, timeout=max(op_timeout, START_TIMEOUT),
                          master_listen_fd=listen_fd)  # fmt: skip
    if rank == 0:
        store.set(ALL_ARRIVED, "1")
    else:
        store.wait([ALL_ARRIVED])
    store.set_timeout(op_timeout)
    # device_id binds the NCCL communicator to this rank's GPU up front (no "using the device under current
    # context" guess in barrier()); gloo takes none.
    device_id = device if device.type == "cuda" else None
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=timeout, device_id=device_id
    )
