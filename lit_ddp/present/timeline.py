"""Every rank on one timeline: a run's record as a Chrome Trace Event file, the format torch.profiler writes and
Perfetto's UI, chrome://tracing and speedscope open.

    python -m lit_ddp.report runs/mini_train_profile/version_0 --timeline run.json    # then open it in Perfetto's UI
    lit_ddp.write_timeline("runs/mini_train_profile/version_0", "run.json")

From the cheap record alone (``phases.json``, ``comm.json``), analyzed once (``lit_ddp.analysis.run_analysis``, for
the straggler): a process per rank, a track
of its kept steps' phases, a track (or several, where all-reduces overlap) of its buckets' all-reduces split into
their wait and their transfer, and a track of markers; the profiled steps' torch.profiler traces (``traces/``),
where the run kept them, go on the same clock. Every rank's times are put on rank 0's clock with comm.json's
offsets. What each slice is and how to open the file: docs/traces.md#the-timeline.
"""

import gzip
import json
import os
import re
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional, Union

from lit_ddp.analysis.run_analysis import RunAnalysis, analyze
from lit_ddp.derive.stragglers import MIN_LATE_MS
from lit_ddp.errors import RecordError
from lit_ddp.maths.bus_factors import allreduce_bus_factor
from lit_ddp.records import phases as step_phases
from lit_ddp.records.phases import END, REMAINDER
from lit_ddp.records.schema import (
    CommRecord,
    OutOfMemory,
    RankPhases,
    StepBuckets,
    StepRow,
    load_oom,
    load_run,
)

MARKERS, PHASES_TRACK, COMM_TRACK = 0, 1, 2  # thread ids; all-reduce lanes follow COMM_TRACK, profiler tracks at 100
COLLECTIVES = 50
PROFILER_TRACKS = 100
_RANK_IN_NAME = re.compile(r"rank[-_]?(\d+)|^fit-(\d+)-")


def parse_steps(text: str) -> tuple[int, int]:
    """``"A-B"`` (or ``"A"``) as the first and last step, inclusive.

    Raises:
        ValueError: Not two whole numbers, the first no greater than the second.
    """
    first, _, last = text.partition("-")
    try:
        found = int(first), int(last or first)
    except ValueError:
        raise ValueError(f"--timeline-steps {text!r}: give steps as A-B (e.g. 10-20) or one step") from None
    if found[0] < 0 or found[0] > found[1]:
        raise ValueError(f"--timeline-steps {text!r}: the first step must be >= 0 and <= the last")
    return found


class _Clock:
    """Each rank's host clock onto rank 0's (comm.json's offsets; none: as read), in microseconds from ``t0_s``."""

    def __init__(self, offsets: list[float], t0_s: float) -> None:
        self.offsets, self.t0_s = offsets, t0_s

    def us(self, rank: int, t_s: float) -> float:
        offset = self.offsets[rank] if rank < len(self.offsets) else 0.0
        return (t_s - offset - self.t0_s) * 1e6


def _q(us: float) -> float:
    """A time in µs on a grid of 1/8 µs: exact in binary floating point, so a viewer that adds a slice's ``ts`` and
    ``dur`` (speedscope does) finds a child's end equal to its parent's where they are equal, not a rounding
    apart (speedscope then leaves the parent open)."""
    return round(us * 8) / 8


def _ms(ms: float) -> float:
    """A figure in an event's args, to the nanosecond (the record's float digits beyond it are noise, and bytes)."""
    return round(ms, 6)


def _slice(pid: int, tid: int, name: str, start_us: float, dur_us: float, args: dict, cat: str) -> dict:
    """A complete event. Its ends are put on the grid, not its duration: a slice that ends inside another still
    does (a track's slices must nest), and its duration is within 1/8 µs of ``dur_us``."""
    ts = _q(start_us)
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "cat": cat, "ts": ts,
            "dur": max(_q(start_us + dur_us) - ts, 0.0), "args": args}  # fmt: skip


def _instant(pid: int, name: str, at_us: float, args: dict) -> dict:
    return {"ph": "i", "s": "t", "pid": pid, "tid": MARKERS, "name": name, "cat": "marker", "ts": _q(at_us),
            "args": args}  # fmt: skip


def _meta(pid: int, tid: Optional[int], name: str, value: Any) -> dict:
    event = {"ph": "M", "pid": pid, "name": name, "args": {"sort_index" if "sort" in name else "name": value}}
    return event if tid is None else {**event, "tid": tid}


def phase_slices(rank: int, row: StepRow, start_us: float) -> list[dict]:
    """The step's slice and its phases' inside it, each phase's duration the record's. With one micro-batch each
    phase sits where it ran (``other``: the gaps between the phases); with several, the phases are sums over the
    micro-batches and are laid end to end from the step's start, as the args say."""
    ms, offsets, marked = row.ms, row.offsets_ms, step_phases.marked()
    step_us = max(offsets[END], ms.step) * 1e3
    step_args = {"step": row.step, "step_ms": _ms(ms.step), "micro_batches": row.micro_batches}
    out = [_slice(rank, PHASES_TRACK, f"step {row.step}", start_us, step_us, step_args, "step")]
    placed = []
    # The remainder is the gaps: from the step's start to the first phase, and between one phase and the next.
    gaps = [(offsets[before.closes] if before else 0.0, offsets[p.opens])
            for before, p in zip((None, *marked[:-1]), marked, strict=True)]  # fmt: skip
    if row.micro_batches == 1 and all(b >= a for a, b in gaps):
        placed = [(p.name, offsets[p.opens], ms[p.name]) for p in marked]
        placed += [(REMAINDER, a, b - a) for a, b in gaps if b > a]
    else:
        at = 0.0
        for phase in step_phases.names():
            placed.append((phase, at, ms[phase]))
            at += ms[phase]
        step_args["laid_end_to_end"] = f"{row.micro_batches} micro-batches: each phase summed over them"
    end_us = start_us + step_us
    for phase, at_ms, dur_ms in placed:
        at = start_us + at_ms * 1e3
        dur = min(dur_ms * 1e3, end_us - at)  # inside the step's slice, whatever the rounding
        out.append(_slice(rank, PHASES_TRACK, phase, at, dur, {"step": row.step, "ms": _ms(dur_ms)}, "phase"))
    return out


def _bucket_ends(row: StepBuckets, serial: bool) -> list[tuple[float, float]]:
    """Each bucket's transfer start and end (s, the rank's clock): from its hand-over, or on NCCL's one stream from
    the end of the bucket before where that is later (CommMonitor's ``ms`` counts from there)."""
    found: list[tuple[float, float]] = []
    for arrival, ms in zip(row.arrival_s, row.ms, strict=True):
        start = max(arrival, found[-1][1]) if serial and found else arrival
        found.append((start, start + ms / 1e3))
    return found


def comm_slices(comm: CommRecord, rank: int, row: StepBuckets, clock: _Clock, latest: list[float]) -> list[list]:
    """The step's all-reduces on ``rank``, one group per bucket: its slice from the hand-over to the end, then inside
    it the queue behind the bucket before (NCCL), the wait for the last rank's hand-over (``latest``: per bucket, µs
    on the timeline's clock), and the transfer."""
    n, serial = len(comm.ranks), comm.meta.backend == "nccl"
    groups = []
    for i, ((begin, end), arrival) in enumerate(zip(_bucket_ends(row, serial), row.arrival_s, strict=True)):
        a, b, e = clock.us(rank, arrival), clock.us(rank, begin), clock.us(rank, end)
        waited_to = min(max(latest[i], b), e)
        transfer_ms = (e - waited_to) / 1e3
        busbw = row.bytes[i] * allreduce_bus_factor(n) / (transfer_ms / 1e3) / 1e9 if transfer_ms > 0 else None
        args = {"step": row.step, "bucket": i, "bytes": row.bytes[i], "ms": _ms(row.ms[i]),
                "wait_ms": _ms((waited_to - b) / 1e3), "transfer_ms": _ms(transfer_ms),
                "busbw_GBps": round(busbw, 3) if busbw is not None else None, "step_exposed_ms": _ms(row.exposed_ms),
                "step_busy_ms": _ms(row.busy_ms)}  # fmt: skip
        group = [_slice(rank, COMM_TRACK, f"all-reduce bucket {i}", a, e - a, args, "comm")]
        for name, start, stop in (("queued", a, b), ("wait", b, waited_to), ("transfer", waited_to, e)):
            if stop > start:
                part = {"step": row.step, "bucket": i, "ms": _ms((stop - start) / 1e3)}
                group.append(_slice(rank, COMM_TRACK, name, start, stop - start, part, "comm"))
        groups.append(group)
    return groups


def _lanes(groups: list[list[dict]]) -> int:
    """Puts each all-reduce with its parts on the first lane free at its start (gloo runs buckets side by side, and
    slices on one track must nest); returns the lanes used."""
    ends: list[float] = []
    for group in sorted(groups, key=lambda g: g[0]["ts"]):
        start = group[0]["ts"]
        lane = next((k for k, end in enumerate(ends) if end <= start), len(ends))
        ends[lane : lane + 1] = [start + group[0]["dur"]]
        for event in group:
            event["tid"] = COMM_TRACK + lane
    return max(len(ends), 1)


def collective_marks(rank: RankPhases, clock: _Clock, wanted) -> list[dict]:
    """The rank's collectives of the kept steps (Flight Recorder's, in the record), as instants on a track of their
    own: the op and its sequence number (the same call has the same number on every rank), shapes, dtype, step,
    phase, and a DDP bucket's index."""
    calls = [c for c in rank.collectives if wanted(c.step)]
    out = [_meta(rank.rank, COLLECTIVES, "thread_name", "collectives"),
           _meta(rank.rank, COLLECTIVES, "thread_sort_index", COLLECTIVES)] if calls else []  # fmt: skip
    for c in calls:
        args = {"seq": c.seq, "op": c.op, "sizes": c.sizes, "dtype": c.dtype, "step": c.step, "phase": c.phase,
                **({"bucket": c.bucket} if c.bucket is not None else {})}  # fmt: skip
        out.append({**_instant(rank.rank, f"{c.op} #{c.seq}", clock.us(rank.rank, c.at_s), args), "tid": COLLECTIVES,
                    "cat": "collective"})  # fmt: skip
    return out


def markers(analysis: RunAnalysis, rows: dict[int, dict[int, StepRow]], clock: _Clock,
            ooms: Iterable[OutOfMemory]) -> list[dict]:  # fmt: skip
    """Instants: the warm-up, the profiled and skipped steps, the late arrivals of the straggler the analysis named,
    a SIGTERM's stop, the watchdog's lines and a rank's running out of memory."""
    phases, comm, out = analysis.phases, analysis.comm, []
    for rank, kept in rows.items():
        for step, row in kept.items():
            at = clock.us(rank, row.start_s)
            if phases is not None and step == phases.first_step:
                out.append(_instant(rank, f"warm-up: step {step}", at, {"step": step, "left_out": "of every figure"}))
            if phases is not None and step in phases.profiled_steps:
                out.append(_instant(rank, f"profiled: step {step}", at, {"step": step}))
            if phases is not None and step in phases.skipped_steps:
                out.append(_instant(rank, f"update skipped: step {step}", at, {"step": step}))
        last = kept[max(kept)] if kept else None
        if phases is not None and phases.ended_by and last is not None:
            end = clock.us(rank, last.start_s) + last.offsets_ms[END] * 1e3
            out.append(_instant(rank, f"{phases.ended_by}: stopped after step {last.step}", end, {"step": last.step}))
    for r, w in ((rp.rank, w) for rp in (phases.ranks if phases else ()) for w in rp.waits):  # "waiting 12 s: ..."
        out.append(
            _instant(r, f"watchdog: {w.line.split(':')[0]}", clock.us(r, w.at_s), {"step": w.step, "line": w.line})
        )
    for oom in ooms:
        kept = rows.get(oom.rank, {})
        row = kept.get(oom.step) or (kept[max(kept)] if kept else None)
        if row is not None:
            at = clock.us(oom.rank, row.start_s) + (0.0 if row.step == oom.step else row.offsets_ms[END] * 1e3)
            out.append(_instant(oom.rank, f"out of memory: step {oom.step}, {oom.phase}", at,
                                {"step": oom.step, "phase": oom.phase, "error": oom.error}))  # fmt: skip
    straggler = analysis.named_straggler
    if comm is not None and straggler is not None:
        out += _late_arrivals(comm, straggler.rank, MIN_LATE_MS, clock)
    return out


def _late_arrivals(comm: CommRecord, late: int, threshold_ms: float, clock: _Clock) -> list[dict]:
    """The straggler's arrivals later than every other rank's by more than ``threshold_ms``, one per step."""
    by_step = [{row.step: row for row in rank.rows if row.arrival_s} for rank in comm.ranks]
    out = []
    for step, row in by_step[late].items():
        others = [(r, kept[step]) for r, kept in enumerate(by_step)
                  if r != late and step in kept and len(kept[step].bytes) == len(row.bytes)]  # fmt: skip
        if not others:
            continue
        gaps = [(clock.us(late, t) - max(clock.us(r, o.arrival_s[i]) for r, o in others), i, t)
                for i, t in enumerate(row.arrival_s)]  # fmt: skip
        late_us, bucket, t = max(gaps)
        if late_us / 1e3 > threshold_ms:
            out.append(_instant(late, f"late: {late_us / 1e3:.1f} ms after the others", clock.us(late, t),
                                {"step": step, "bucket": bucket, "late_ms": round(late_us / 1e3, 3)}))  # fmt: skip
    return out


def _profiler_events(path: Path, rank: int, step_starts: dict[int, float], span: tuple[float, float]) -> list[dict]:
    """One rank's torch.profiler trace of its profiled steps, moved onto the timeline's clock: PhaseTimer opens a
    ``lit_ddp.step#N`` range at each step's start, so the trace's clock is the timeline's shifted by the median gap
    between those ranges and the record's starts (``step_starts``, µs). Its threads become tracks of the rank's
    process (``profiler: ...``); events outside ``span`` (µs) are left out."""
    raw = path.read_bytes()
    data = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
    events = [e for e in data.get("traceEvents", []) if isinstance(e, dict)]
    marks = {int(e["name"].rpartition("#")[2]): e["ts"] for e in events
             if e.get("ph") == "X" and str(e.get("name", "")).startswith("lit_ddp.step#")}  # fmt: skip
    shifts = [step_starts[step] - ts for step, ts in marks.items() if step in step_starts]
    if not shifts:
        return []
    shift = statistics.median(shifts)
    names = {(e.get("pid"), e.get("tid")): str(e["args"].get("name")) for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name" and isinstance(e.get("args"), dict)}  # fmt: skip
    threads: dict[tuple, list[dict]] = {}
    for event in events:
        if event.get("ph") != "X" or not isinstance(event.get("ts"), (int, float)):
            continue
        ts = event["ts"] + shift
        if span[0] <= ts <= span[1]:
            end = _q(ts + float(event.get("dur", 0.0)))
            threads.setdefault((event.get("pid"), event.get("tid")), []).append({**event, "pid": rank, "ts": _q(ts),
                                                                                   "dur": end - _q(ts)})  # fmt: skip
    out, tid = [], PROFILER_TRACKS
    for (pid, thread), found in threads.items():
        label = names.get((pid, thread)) or f"{pid}/{thread}"
        for k, lane in enumerate(_nested(found)):
            out += [_meta(rank, tid, "thread_name", f"profiler: {label}" + (f" ({k + 1})" if k else "")),
                    _meta(rank, tid, "thread_sort_index", tid), *({**e, "tid": tid} for e in lane)]  # fmt: skip
            tid += 1
    return out


def _nested(events: list[dict]) -> list[list[dict]]:
    """The events split into lanes in which every slice that starts inside another ends inside it (a profiler's
    ranges opened in one hook and closed in another may overlap; viewers draw a track of nested slices)."""
    lanes: list[tuple[list[dict], list[float]]] = []  # each lane's events and the ends of its open slices
    for event in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        end = event["ts"] + event["dur"]
        for held, open_ends in lanes:
            while open_ends and open_ends[-1] <= event["ts"]:
                open_ends.pop()
            if not open_ends or end <= open_ends[-1]:
                held.append(event)
                open_ends.append(end)
                break
        else:
            lanes.append(([event], [end]))
    return [held for held, _ in lanes]


def _traces(run_dir: Path) -> dict[int, Path]:
    """PhaseTimer's traces of the profiled steps, by rank (``traces/rank<r>.pt.trace.json.gz``)."""
    found = {}
    for path in sorted((run_dir / "traces").glob("*.json*")) if (run_dir / "traces").is_dir() else []:
        match = _RANK_IN_NAME.search(path.name)
        if match:
            found[int(match.group(1) or match.group(2))] = path
    return found


def timeline(
    analysis: RunAnalysis,
    ooms: Iterable[OutOfMemory] = (),
    steps: Optional[tuple[int, int]] = None,
    traces: Optional[dict[int, Path]] = None,
) -> dict:
    """The Trace Event file's content (a dict to write as JSON) of a run's analyzed records, ``steps`` (first, last)
    only.

    Raises:
        RecordError: No record with the steps' starts (schema 3 records have none), or no kept step in ``steps``.
    """
    phases, comm = analysis.phases, analysis.comm
    if phases is None:
        raise RecordError("a timeline needs phases.json (PhaseTimer): comm.json alone has no steps to draw")
    wanted = (lambda s: steps[0] <= s <= steps[1]) if steps else (lambda s: True)
    rows = {rank.rank: {row.step: row for row in rank.rows if wanted(row.step)} for rank in phases.ranks}
    if any(row.start_s is None for kept in rows.values() for row in kept.values()):
        raise RecordError("this record has no step start times (written before schema 4): run the job again with "
                          "this lit_ddp to draw its timeline")  # fmt: skip
    if not any(rows.values()):
        raise RecordError(f"no kept step in {steps[0]}-{steps[1]}: the record keeps steps {phases.steps[0]}-"
                          f"{phases.steps[-1]} (the first 10, the profiled ones and the last 50)")  # fmt: skip
    offsets = comm.clock_offset_s if comm is not None and len(comm.clock_offset_s) == len(comm.ranks) else []
    t0 = min(row.start_s - (offsets[r] if offsets else 0.0) for r, kept in rows.items() for row in kept.values())
    clock = _Clock(offsets, t0)
    events: list[dict] = []
    for rank in phases.ranks:
        where = (
            f"node {'?' if rank.node is None else rank.node}, {rank.host or '?'}, {rank.device or phases.meta.device}"
        )
        events += [_meta(rank.rank, None, "process_name", f"rank {rank.rank} ({where})"),
                   _meta(rank.rank, None, "process_sort_index", rank.rank)]  # fmt: skip
        for tid, name in ((MARKERS, "markers"), (PHASES_TRACK, "phases")):
            events += [_meta(rank.rank, tid, "thread_name", name), _meta(rank.rank, tid, "thread_sort_index", tid)]
        for row in rows[rank.rank].values():
            events += phase_slices(rank.rank, row, clock.us(rank.rank, row.start_s))
        events += collective_marks(rank, clock, wanted)
    if comm is not None:
        events += _all_comm(comm, clock, wanted)
    events += markers(analysis, rows, clock, ooms)
    for rank, path in (traces or {}).items():
        kept = rows.get(rank, {})
        starts = {step: clock.us(rank, row.start_s) for step, row in kept.items()}
        if starts:
            last = kept[max(kept)]
            span = (min(starts.values()), starts[last.step] + last.offsets_ms[END] * 1e3)
            events += _profiler_events(path, rank, starts, span)
    events.sort(key=lambda e: (e["pid"], e.get("tid", -1), e.get("ts", -1.0), -e.get("dur", 0.0)))
    aligned = "comm.json's clock_offset_s" if offsets else "none (no comm.json): each rank's own clock"
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"tool": "lit_ddp", "world_size": phases.meta.world_size, "device": phases.meta.device_name,
                          "backend": phases.meta.backend, "clock": phases.meta.clock, "aligned_by": aligned,
                          "t0_s": t0, "steps": f"{steps[0]}-{steps[1]}" if steps else "every kept step"}}  # fmt: skip


def _all_comm(comm: CommRecord, clock: _Clock, wanted) -> list[dict]:
    """Every rank's all-reduce tracks: each bucket's wait is for the latest hand-over of the ranks that kept the
    step."""
    by_step = [{row.step: row for row in rank.rows if row.arrival_s and wanted(row.step)} for rank in comm.ranks]
    out = []
    for rank, kept in enumerate(by_step):
        groups = []
        for step, row in kept.items():
            peers = [(r, k[step]) for r, k in enumerate(by_step) if step in k and len(k[step].bytes) == len(row.bytes)]
            latest = [max(clock.us(r, p.arrival_s[i]) for r, p in peers) for i in range(len(row.bytes))]
            groups += comm_slices(comm, rank, row, clock, latest)
        for lane in range(_lanes(groups)):
            name = "all-reduce" if lane == 0 else f"all-reduce ({lane + 1})"
            out += [_meta(rank, COMM_TRACK + lane, "thread_name", name),
                    _meta(rank, COMM_TRACK + lane, "thread_sort_index", COMM_TRACK + lane)]  # fmt: skip
        out += [event for group in groups for event in group]
    return out


def write_timeline(run_dir: Union[str, os.PathLike], path: Union[str, os.PathLike],
                   steps: Optional[tuple[int, int]] = None) -> Path:  # fmt: skip
    """Writes the run's timeline (``run_dir``'s records, and its profiled steps' traces where it kept them) to
    ``path``, a Chrome Trace Event file: open it in Perfetto's UI (https://ui.perfetto.dev), chrome://tracing or
    speedscope. ``steps``: (first, last) kept steps only.

    Raises:
        RecordError: The run has no record a timeline can be drawn from.
    """
    run_dir = Path(run_dir)
    content = timeline(analyze(*load_run(run_dir)), load_oom(run_dir), steps, _traces(run_dir))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as out:
        json.dump(content, out, separators=(",", ":"))
    return path
