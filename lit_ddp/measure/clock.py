"""Two clocks for step-phase timing, host ``perf_counter`` on CPU and CUDA events on GPUs, and each rank's
host clock against rank 0's.

    python -m lit_ddp.fit --config configs/mini_train_profile.yaml --devices 2

CUDA events are resolved once they have completed (``query()``, which never blocks), or all at once at the end
of training, so timing adds no ``synchronize()`` to the steps it measures. ``offsets_to_rank0`` measures each
rank's host clock against rank 0's once, at the start, as NTP does, with an error bound: docs/stragglers.md.
"""

from dataclasses import dataclass
from time import perf_counter
from typing import Any, Optional

import torch
import torch.distributed as dist


def host_now() -> float:
    """The host clock every rank's arrivals and CPU marks are read from, in seconds (a module attribute: a test moves
    one rank's clock by patching it)."""
    return perf_counter()


class HostClock:
    """Marks are ``host_now`` seconds (``perf_counter``); always resolved."""

    name = "perf_counter"

    def mark(self) -> float:
        return host_now()

    def host_seconds(self, mark: float) -> float:
        return mark

    def ready(self, mark: Any) -> bool:
        return True

    def elapsed_ms(self, start: float, end: float) -> float:
        return (end - start) * 1e3

    def wait(self, mark: Any) -> None:
        pass


class CudaClock:
    """Marks are ``torch.cuda.Event``s recorded on the current stream. ``anchor`` ties their timeline to the host
    clock once (a synchronize, before training): then ``host_seconds`` puts a mark on ``host_now``'s clock, when
    the GPU reached it (not when the host queued it), to compare across ranks."""

    name = "cuda_event"

    def __init__(self) -> None:
        self._anchor: Optional[tuple[torch.cuda.Event, float]] = None

    def anchor(self) -> float:
        """Records an event on an idle GPU and the host time it ran at; returns the error bound (seconds)."""
        torch.cuda.synchronize()
        event = torch.cuda.Event(enable_timing=True)
        before = host_now()
        event.record()
        event.synchronize()
        after = host_now()
        self._anchor = (event, (before + after) / 2)
        return (after - before) / 2

    def host_seconds(self, mark: torch.cuda.Event) -> float:
        """When the GPU reached ``mark``, on the host clock (``anchor`` first; the mark must have completed). The
        GPU's clock and the host's drift apart by some parts per million: microseconds over a fit of minutes."""
        assert self._anchor is not None, "anchor() first"
        event, at = self._anchor
        return at + event.elapsed_time(mark) / 1e3

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ready(self, mark: torch.cuda.Event) -> bool:
        return mark.query()

    def elapsed_ms(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end)

    def wait(self, mark: torch.cuda.Event) -> None:
        mark.synchronize()


def clock_for(device: torch.device) -> HostClock | CudaClock:
    return CudaClock() if device.type == "cuda" else HostClock()


@dataclass(frozen=True)
class ClockOffset:
    """A rank's host clock minus rank 0's (seconds), within ``error_s`` either way."""

    offset_s: float
    error_s: float


def offsets_to_rank0(device: torch.device, rounds: int = 8) -> list[ClockOffset]:
    """Every rank's ``ClockOffset`` on rank 0 (rank 0's own is zero); an empty list on the other ranks. Point to
    point, rank 0 with each rank in turn: ``rounds`` round trips per rank, at the start of training only.

    On CUDA (NCCL) ``recv`` returns once the receive is queued, before any data arrives: each receive is waited
    for (``arrived``) before the host reads its clock, or the timestamps would be taken early and the offset biased
    while its error read about a microsecond. Once, before training: these syncs are in no step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    buf = torch.zeros(2, dtype=torch.float64, device=device)

    def arrived() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    offsets = [ClockOffset(0.0, 0.0)]
    for peer in range(1, world):
        best = None
        for _ in range(rounds):
            if rank == 0:
                t1 = host_now()
                buf.fill_(t1)
                dist.send(buf, peer)
                dist.recv(buf, peer)
                arrived()
                t4 = host_now()
                t2, t3 = buf.tolist()
                delay = (t4 - t1) - (t3 - t2)
                if best is None or delay < best[0]:
                    best = (delay, ((t2 - t1) + (t3 - t4)) / 2)
            elif rank == peer:
                dist.recv(buf, 0)
                arrived()
                t2 = host_now()
                buf[0], buf[1] = t2, host_now()
                dist.send(buf, 0)
        if rank == 0:
            offsets.append(ClockOffset(best[1], best[0] / 2))
    return offsets if rank == 0 else []
