"""Each rank's record of its collectives: torch's Flight Recorder for what it holds, lit_ddp's marks for the rest.

    python tests/hang_scripts.py logkeys      # rank 1 logs a key rank 0 does not: the record names the call

torch's Flight Recorder (on by default in torch 2.13: ``TORCH_FR_BUFFER_SIZE`` entries, gloo and NCCL alike)
keeps every collective's sequence number, op, sizes, dtype, creation time and the Python stack that called it (the
user's line: ``lit_ddp.analysis.flight_recorder``), at no cost lit_ddp adds. It lacks the step and the phase:
they come from marks the ``CollectiveRecorder`` callback sets at the step's boundaries (a clock read and a
ring-buffer write each, a handful per step), matched to each entry's creation time. Where it holds no stack, the
collective a rank waited in gets the line of its exception's traceback. Nothing of this reads the Flight Recorder
before a failure.
"""

import time
import traceback
from bisect import bisect_right
from collections import deque
from collections.abc import Collection
from types import FrameType, TracebackType
from typing import Any, Optional

from lit_ddp import _torch
from lit_ddp.analysis.divergence import Collective, RankReport
from lit_ddp.analysis.flight_recorder import Frame, collective_of, default_group, user_frame
from lit_ddp.records import phases
from lit_ddp.records.schema import CollectiveCall

MARKS_KEPT = 256  # phase marks: some 40 steps
REPORTED = 16  # a rank's last collectives in its report


def frame_of(tb: Optional[TracebackType] = None, frame: Optional[FrameType] = None) -> str:
    """The user's line of a traceback, or of a live stack (a signal handler's ``frame``)."""
    summary = traceback.extract_tb(tb) if tb is not None else traceback.extract_stack(frame) if frame else []
    # A line of "" is read from the file by user_frame; a frame without a line number is at line 0, where there is
    # no text to read.
    return user_frame([Frame(f.filename, f.lineno or 0, f.name, f.line or "") for f in summary])


class CollectiveRecord:
    """One rank's marks: where in which step it was, at each boundary, on the clock Flight Recorder uses."""

    def __init__(self) -> None:
        self._times: deque[int] = deque(maxlen=MARKS_KEPT)
        self._marks: deque[tuple[Optional[int], str]] = deque(maxlen=MARKS_KEPT)

    def mark(self, step: Optional[int], phase: str) -> None:
        self._times.append(time.time_ns())  # Flight Recorder's time_created_ns is the system clock too
        self._marks.append((step, phase))

    def now(self) -> tuple[Optional[int], str]:
        return self._marks[-1] if self._marks else (None, "")

    def at(self, time_ns: int) -> tuple[Optional[int], str]:
        """The step and phase this rank was in at ``time_ns``."""
        i = bisect_right(list(self._times), time_ns) - 1
        return self._marks[i] if i >= 0 else (None, "before training")  # setup's collectives

    def collectives(self, entries: list[dict[str, Any]], waited: str = "") -> list[Collective]:
        """Flight Recorder's entries of the default process group, as collectives of this rank: its last
        ``REPORTED``, each with its step and phase; the all-reduces of a step's backward are DDP's gradient
        buckets, numbered as DDP launches them; the last one's line, where Flight Recorder has no stack, is
        ``waited`` (the user's line it waited at, from its traceback)."""
        out = [collective for _, collective in self._named(entries)][-REPORTED:]
        if out and waited and not out[-1].where and out[-1].bucket is None:
            out[-1].where = waited
        return out

    def _named(self, entries: list[dict[str, Any]]) -> list[tuple[dict[str, Any], Collective]]:
        """The default group's entries, each with its collective: step, phase, and bucket in a backward."""
        out = []
        buckets: dict[Optional[int], int] = {}
        for entry in default_group(entries):
            # An entry without a time is before every mark; one without a name is no all-reduce.
            step, phase = self.at(int(entry.get("time_created_ns", 0)))
            bucket = None
            if phase == phases.ALL_REDUCING and str(entry.get("profiling_name", "")).endswith("all_reduce"):
                bucket = buckets[step] = buckets.get(step, -1) + 1
            out.append((entry, collective_of(entry, step, phase, bucket)))
        return out

    def calls(self, entries: list[dict[str, Any]], steps: Collection[int], host_s: float,
              wall_ns: int) -> list[CollectiveCall]:  # fmt: skip
        """The entries called in ``steps`` (while their marks are still kept), for the record: each on the host
        clock, through ``host_s`` and ``wall_ns``, the host clock and the system clock read together."""
        if not self._times:
            return []
        oldest, out = self._times[0], []
        for entry, c in self._named(entries):
            created = int(entry.get("time_created_ns", 0))
            if c.step in steps and created >= oldest:  # an older one's step is not known any more
                out.append(CollectiveCall(c.seq, c.op, c.sizes, c.dtype, c.step, c.phase,
                                          host_s + (created - wall_ns) / 1e9, c.bucket))  # fmt: skip
        return out

    def report(self, rank: int, kind: str, error: str, where: str) -> RankReport:
        """This rank's report, now: its Flight Recorder entries read once (``[]`` where torch records none)."""
        step, phase = self.now()
        entries = _torch.flight_recorder_entries()
        waited = where if kind in ("timeout", "collective error") else ""
        return RankReport(rank, time.time(), kind, error, where, step, phase, self.collectives(entries, waited))
