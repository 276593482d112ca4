"""Both ends of a timed TCP transfer between two nodes (``tests.nodes.measure_rate`` runs one on each), the standard
library only, so that each end starts in a moment.

    python -m tests.link_rate receive 198.18.0.2 4000000 5    # on node 1: prints the transfers as JSON
    python -m tests.link_rate send 198.18.0.2 4000000 5       # on node 0
"""

import json
import socket
import sys
import time

RATE_PORT = 5201


def _receive(address: str, nbytes: int, repeat: int, timeout: float = 20) -> None:
    transfers = []
    with socket.create_server((address, RATE_PORT)) as server:
        server.settimeout(timeout)
        for _ in range(repeat):
            conn, _ = server.accept()
            with conn:
                conn.settimeout(timeout)
                buf, got, first, start = bytearray(1 << 20), 0, 0, 0.0
                while got < nbytes:
                    n = conn.recv_into(buf)
                    if not n:
                        break
                    if not got:
                        first, start = n, time.perf_counter()
                    got += n
                elapsed = time.perf_counter() - start
            # The first read's bytes arrived before the clock started.
            transfers.append({"bytes": got, "bits_per_s": (got - first) * 8 / elapsed if elapsed > 0 else 0.0})
    print(json.dumps(transfers))


def _send(address: str, nbytes: int, repeat: int, timeout: float = 20) -> None:
    chunk = bytes(1 << 20)
    for _ in range(repeat):
        deadline = time.monotonic() + timeout
        while True:  # until the receiver listens
            try:
                conn = socket.create_connection((address, RATE_PORT), timeout=timeout)
                break
            except ConnectionRefusedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        with conn:
            sent = 0
            while sent < nbytes:
                part = chunk[: min(len(chunk), nbytes - sent)]
                conn.sendall(part)
                sent += len(part)
            conn.shutdown(socket.SHUT_WR)
            conn.recv(1)  # the receiver's close: the next transfer starts once this one is done


if __name__ == "__main__":
    role, address, count, times = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    (_receive if role == "receive" else _send)(address, count, times)
