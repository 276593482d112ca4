"""Two clocks for step-phase timing: host ``perf_counter`` on CPU, CUDA events on GPUs.

CUDA work is asynchronous: a host clock read at a hook measures when the work was *queued*, not run. CUDA
events are recorded into the stream at the same points and timed by the device; they are resolved once
they have completed (``query()``, which never blocks), or all at once at the end of training, so timing
adds no ``synchronize()`` to the steps it measures.
"""

from time import perf_counter
from typing import Any

import torch


class HostClock:
    """Marks are ``perf_counter`` seconds; always resolved."""

    name = "perf_counter"

    def mark(self) -> float:
        return perf_counter()

    def ready(self, mark: Any) -> bool:
        return True

    def elapsed_ms(self, start: float, end: float) -> float:
        return (end - start) * 1e3

    def wait(self, mark: Any) -> None:
        pass


class CudaClock:
    """Marks are ``torch.cuda.Event``s recorded on the current stream."""

    name = "cuda_event"

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
