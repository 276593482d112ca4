"""Who is slow, and who waits: the rank every other rank waits for at the gradient all-reduce, the phase in which
it loses the time, how long each rank waits, and what the all-reduce itself costs.

    python -m lit_ddp.fit --config configs/mini_train_profile.yaml --devices 2   # the verdict names it, if any

From CommMonitor's record (``comm.json``) alone, with PhaseTimer's (``phases.json``) for the cause. The
definitions (arrival, lateness, wait, transfer) and the bar a straggler must pass (``STRAGGLER_SHARE``, the
floor, and the noise model's interval, ``lit_ddp.derive.noise``): docs/stragglers.md.
"""

import itertools
import math
import statistics
from dataclasses import dataclass, field
from typing import Optional

from lit_ddp.derive import noise
from lit_ddp.records import phases as phase_table
from lit_ddp.records.schema import CommRecord, PhaseRecord
from lit_ddp.records.steps import is_steady

STRAGGLER_SHARE = 0.75
# Below this a rank is not called a straggler whatever its lateness: two undelayed CPU ranks sharing two cores
# were seen 2 ms apart at 87% of all-reduces (one core busier than the other), which is no straggler to fix.
MIN_LATE_MS = 5.0
# ... nor below this share of the step (the time between one all-reduce and the next step's): a property of the
# workload, so the bar stays put from run to run (it was 3 x the lateness's spread, which moved 5 -> 227 ms). Two
# identical CPU ranks sharing two cores were seen one always 12 ms late in a 117 ms step (10%): a fifth of the step
# is what a straggler worth fixing costs the others.
STEP_SHARE = 0.2
CONFIDENCE = 0.95  # for the family of every rank's lateness (lit_ddp.derive.noise.family_confidence)


@dataclass
class Arrivals:
    """Who arrived when at each all-reduce of the steady steps every rank kept, on rank 0's clock (ms)."""

    steps: list[int]
    lateness: list[list[float]]  # per rank, per all-reduce in time order: its arrival minus the others' latest
    waits: list[list[float]]  # per rank, per step: the last arrival minus its own, the longest over the buckets
    caused: list[float]  # per rank: the waits it caused, summed
    transfer: list[float]  # per step: the all-reduces' transfer (shortest duration across ranks), summed
    transfer_per_bucket: list[list[float]]  # per bucket, per step
    wait_per_bucket: list[list[float]]  # per bucket, per step: the last arrival minus the first
    step_ms: float  # the median time from one step's first all-reduce to the next step's, on rank 0


@dataclass
class Straggler:
    """What the arrivals say. ``rank`` is None when no rank is late beyond the bar."""

    rank: Optional[int]
    late_ms: float  # the straggler's (or the rank others wait for most's) median lateness
    share: float  # of the all-reduces at which it arrived last
    wait_ms: list[float]  # each rank's median wait per step
    transfer_ms: float  # median per step of the all-reduces' transfer time, summed over buckets
    transfer_per_bucket_ms: list[float]  # median per bucket
    wait_per_bucket_ms: list[float]  # median per bucket of the longest wait across ranks
    threshold_ms: float
    spread_ms: float  # median over all-reduces of last arrival minus first
    cause: Optional[str] = None
    cause_extra_ms: float = 0.0
    steps: int = 0
    extra_ms: dict[str, float] = field(default_factory=dict)  # the straggler's excess per phase
    late_low_ms: float = -math.inf  # the median lateness's interval (CONFIDENCE over the ranks)
    late_high_ms: float = math.inf


def _common_steps(comm: CommRecord) -> list[int]:
    kept = [{r.step for r in rank.rows if r.bytes == comm.layout and r.arrival_s} for rank in comm.ranks]
    return sorted(s for s in set.intersection(*kept) if is_steady(s, comm.profiled_steps))


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def arrivals(comm: CommRecord) -> Optional[Arrivals]:
    """The arrivals of a run of two or more ranks; None with one rank or no common steady step."""
    n = len(comm.ranks)
    steps = _common_steps(comm) if n > 1 else []
    if not steps:
        return None
    rows = [{r.step: r for r in rank.rows} for rank in comm.ranks]
    # Without offsets any common one alike: only differences between ranks' arrivals are taken (step_ms below reads
    # rank 0's clock as it is).
    offsets = comm.clock_offset_s if len(comm.clock_offset_s) == n else [0.0] * n
    buckets = range(len(comm.layout))
    # caused starts alike for every rank (any common start keeps which rank caused most); step_ms is set below.
    found = Arrivals(steps, [[] for _ in range(n)], [[] for _ in range(n)], [0.0] * n, [],
                     [[] for _ in buckets], [[] for _ in buckets], 0.0)  # fmt: skip
    for step in steps:
        step_wait, step_transfer = [0.0] * n, 0.0
        for b in buckets:
            arrival = [(rows[r][step].arrival_s[b] - offsets[r]) * 1e3 for r in range(n)]
            last = max(range(n), key=arrival.__getitem__)
            for r in range(n):
                found.lateness[r].append(arrival[r] - max(a for other, a in enumerate(arrival) if other != r))
                step_wait[r] = max(step_wait[r], arrival[last] - arrival[r])
                found.caused[last] += arrival[last] - arrival[r]
            transfer = min(rows[r][step].ms[b] for r in range(n))
            found.transfer_per_bucket[b].append(transfer)
            found.wait_per_bucket[b].append(arrival[last] - min(arrival))
            step_transfer += transfer
        found.transfer.append(step_transfer)
        for r in range(n):
            found.waits[r].append(step_wait[r])
    gaps = [(rows[0][b].arrival_s[0] - rows[0][a].arrival_s[0]) * 1e3 / (b - a) for a, b in itertools.pairwise(steps)]
    found.step_ms = _median([g for g in gaps if g > 0])
    return found


def find_straggler(comm: CommRecord, phases: Optional[PhaseRecord] = None) -> Optional[Straggler]:
    """The straggler verdict of a run of two or more ranks; None with one rank or no common steady step.

    The rank the others wait for most is named when it arrives last at ``STRAGGLER_SHARE`` of the all-reduces,
    its median lateness is beyond the noise (the whole interval of the median, per all-reduce in time order, so
    that lateness coming and going in spells widens it, lies above the floor the clocks can tell, ``MIN_LATE_MS``
    or 3 clock errors) and the median is above ``threshold_ms`` (``STEP_SHARE`` of the step, or that floor)."""
    return straggler_of(arrivals(comm), comm, phases)


def straggler_of(found: Optional[Arrivals], comm: CommRecord, phases: Optional[PhaseRecord]) -> Optional[Straggler]:
    """``find_straggler`` from the run's arrivals, computed once (``lit_ddp.analysis.run_analysis.analyze``)."""
    if found is None:
        return None
    n = len(comm.ranks)
    worst = max(range(n), key=found.caused.__getitem__)
    lateness = found.lateness[worst]
    late = noise.median_interval(lateness, confidence=noise.family_confidence(CONFIDENCE, n))
    if len(found.steps) < noise.MIN_SAMPLES:  # a step's buckets move together: too few steps, however many buckets
        late = noise.Interval(late.estimate, -math.inf, math.inf)
    share = sum(d > 0 for d in lateness) / len(lateness)
    # Late beyond the noise: the whole interval above the floor the clocks can tell; worth naming: its median
    # lateness above a share of the step (a property of the workload, so the bar stays put).
    floor = max(MIN_LATE_MS, 3e3 * max(comm.clock_error_s or [0.0]))
    threshold = max(floor, STEP_SHARE * found.step_ms)
    named = share >= STRAGGLER_SHARE and noise.call(late, null=floor, min_effect=threshold - floor) == "slower"
    verdict = Straggler(
        rank=worst if named else None, late_ms=late.estimate, share=share, wait_ms=[_median(w) for w in found.waits],
        transfer_ms=_median(found.transfer), transfer_per_bucket_ms=[_median(t) for t in found.transfer_per_bucket],
        wait_per_bucket_ms=[_median(w) for w in found.wait_per_bucket], threshold_ms=threshold,
        spread_ms=_median([w for per_bucket in found.wait_per_bucket for w in per_bucket]),
        steps=len(found.steps), late_low_ms=late.low, late_high_ms=late.high,
    )  # fmt: skip
    if named and phases is not None and len(phases.ranks) == n:
        waits = {step: [w[i] for w in found.waits] for i, step in enumerate(found.steps)}
        verdict.extra_ms, cause = _excess(phases, worst, waits)
        if cause is not None:
            verdict.cause, verdict.cause_extra_ms = cause, verdict.extra_ms[cause]
    return verdict


def _excess(phases: PhaseRecord, rank: int, waits: dict[int, list[float]]) -> tuple[dict[str, float], Optional[str]]:
    """Per phase (not ``step``): ``rank``'s median minus the median of the other ranks' medians, over the steps
    both records kept, backward without each rank's wait in that step; and the phase of the largest excess when
    it is beyond the noise (``rank``'s per-step samples against the others' per-step median), else None."""
    samples = []  # per rank, per phase: the per-step samples
    for r, kept in enumerate(phases.ranks):
        rows = [row for row in kept.rows if row.step in waits]
        if not rows:
            return {}, None
        per_phase = {p: [row.ms[p] for row in rows] for p in phase_table.names()}
        waiting = phase_table.ALL_REDUCING  # the phase the wait for the last arrival falls in
        per_phase[waiting] = [row.ms[waiting] - waits[row.step][r] for row in rows]
        samples.append(per_phase)
    others = [s for r, s in enumerate(samples) if r != rank]
    extra = {p: _median(samples[rank][p]) - _median([_median(s[p]) for s in others]) for p in samples[rank]}
    top = max(extra, key=extra.get)
    # The others' per-step median: one sample per step, as many as the straggler's (zip's strict= alike: every
    # rank's PhaseTimer keeps the same global steps, one Window rule, so the lists are as long).
    theirs = [statistics.median(values) for values in zip(*(s[top] for s in others), strict=True)]
    # confidence= alike while CONFIDENCE is noise's default, 0.95.
    beyond = noise.call(noise.difference_interval(theirs, samples[rank][top], confidence=CONFIDENCE)) == "slower"
    return extra, top if beyond else None


def verdict_line(found: Straggler) -> str:
    """One line: the straggler, where it loses the time and who waits, or that there is none and why."""
    shown = round(found.late_ms, 1) + 0.0  # -0.04 ms is "0.0", not "-0.0"
    late = f"{shown:.1f} ms late at {found.share:.0%} of all-reduces"
    if found.rank is None:
        bar = (f"a straggler is last at {STRAGGLER_SHARE:.0%} of them, late beyond the noise, by a median above "
               f"{found.threshold_ms:.1f} ms")  # fmt: skip
        if math.isinf(found.late_low_ms):
            return f"no straggler: can't tell, {found.steps} step(s) are too few ({bar})"
        within = f"{found.late_low_ms:.1f} to {found.late_high_ms:.1f} ms"
        why = f"{late}, median within {within}"
        if shown < 0:  # last at some all-reduces, ahead of the latest of the others at most
            why = (f"last at {found.share:.0%} of all-reduces and {-shown:.1f} ms early at the median (its "
                   f"lateness within {within})")  # fmt: skip
        return f"no straggler (the rank the others wait for most is {why}; {bar})"
    waiting = [r for r in range(len(found.wait_ms)) if r != found.rank]
    waits = ", ".join(f"{found.wait_ms[r]:.1f}" for r in waiting)
    cause = ""
    if found.cause:
        cause = f"; its {found.cause} phase is {found.cause_extra_ms:+.1f} ms over the other ranks' median"
    elif found.extra_ms:
        cause = "; none of its phases is slower than the other ranks' beyond the noise"
    return (f"straggler: rank {found.rank} arrives {late} (median within {found.late_low_ms:.1f} to "
            f"{found.late_high_ms:.1f} ms){cause}; rank(s) {', '.join(map(str, waiting))} wait {waits} ms per step; "
            f"the all-reduce itself takes {found.transfer_ms:.1f} ms")  # fmt: skip
