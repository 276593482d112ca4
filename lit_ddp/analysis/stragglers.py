"""Who is slow, and who waits: the rank every other rank waits for at the gradient all-reduce, the phase in which
it loses the time, how long each rank waits, and what the all-reduce itself costs.

    python -m lit_ddp.fit --config configs/mini_train_profile.yaml --devices 2   # the verdict names it, if any

From CommMonitor's record (``comm.json``) alone, with PhaseTimer's (``phases.json``) for the cause. The
definitions (arrival, lateness, wait, transfer) and the bar a straggler must pass (``STRAGGLER_SHARE``,
``MIN_LATE_MS``, the run's noise): docs/stragglers.md.
"""

import itertools
import statistics
from dataclasses import dataclass, field
from typing import Optional

from lit_ddp.records.schema import PHASES, CommRecord, PhaseRecord, is_steady

STRAGGLER_SHARE = 0.75
# Below this a rank is not called a straggler whatever its lateness: two undelayed CPU ranks sharing two cores
# were seen 2 ms apart at 87% of all-reduces (one core busier than the other), which is no straggler to fix.
MIN_LATE_MS = 5.0
# ... nor below this share of the step (the time between one all-reduce and the next step's): a property of the
# workload, so the bar stays put from run to run (it was 3 x the lateness's spread, which moved 5 -> 227 ms). Two
# identical CPU ranks sharing two cores were seen one always 12 ms late in a 117 ms step (10%): a fifth of the step
# is what a straggler worth fixing costs the others.
STEP_SHARE = 0.2


@dataclass
class Straggler:
    """What the arrivals say. ``rank`` is None when no rank is late beyond ``threshold_ms``."""

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


def _common_steps(comm: CommRecord) -> list[int]:
    kept = [{r.step for r in rank.rows if r.bytes == comm.layout and r.arrival_s} for rank in comm.ranks]
    return sorted(s for s in set.intersection(*kept) if is_steady(s, comm.profiled_steps))


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def find_straggler(comm: CommRecord, phases: Optional[PhaseRecord] = None) -> Optional[Straggler]:
    """The straggler verdict of a run of two or more ranks; None with one rank or no common steady step."""
    n = len(comm.ranks)
    steps = _common_steps(comm) if n > 1 else []
    if not steps:
        return None
    rows = [{r.step: r for r in rank.rows} for rank in comm.ranks]
    offsets = comm.clock_offset_s if len(comm.clock_offset_s) == n else [0.0] * n
    lateness, caused = [[] for _ in range(n)], [0.0] * n
    waits = [[] for _ in range(n)]  # per step
    transfer_steps, transfer_b, wait_b, spreads = [], [[] for _ in comm.layout], [[] for _ in comm.layout], []
    for step in steps:
        step_wait, step_transfer = [0.0] * n, 0.0
        for b in range(len(comm.layout)):
            arrival = [(rows[r][step].arrival_s[b] - offsets[r]) * 1e3 for r in range(n)]
            last = max(range(n), key=arrival.__getitem__)
            for r in range(n):
                lateness[r].append(arrival[r] - max(a for other, a in enumerate(arrival) if other != r))
            spreads.append(arrival[last] - min(arrival))
            for r in range(n):
                step_wait[r] = max(step_wait[r], arrival[last] - arrival[r])
                caused[last] += arrival[last] - arrival[r]
            transfer = min(rows[r][step].ms[b] for r in range(n))
            transfer_b[b].append(transfer)
            wait_b[b].append(arrival[last] - min(arrival))
            step_transfer += transfer
        transfer_steps.append(step_transfer)
        for r in range(n):
            waits[r].append(step_wait[r])
    worst = max(range(n), key=caused.__getitem__)
    late = _median(lateness[worst])
    share = sum(d > 0 for d in lateness[worst]) / len(lateness[worst])
    transfer_ms, wait_ms = _median(transfer_steps), [_median(w) for w in waits]
    error_ms = 1e3 * max(comm.clock_error_s or [0.0])
    threshold = max(MIN_LATE_MS, 3 * error_ms, STEP_SHARE * _step_ms(rows, steps, offsets))
    named = share >= STRAGGLER_SHARE and late > threshold
    verdict = Straggler(
        rank=worst if named else None, late_ms=late, share=share, wait_ms=wait_ms, transfer_ms=transfer_ms,
        transfer_per_bucket_ms=[_median(t) for t in transfer_b], wait_per_bucket_ms=[_median(w) for w in wait_b],
        threshold_ms=threshold, spread_ms=_median(spreads), steps=len(steps),
    )  # fmt: skip
    if named and phases is not None and len(phases.ranks) == n:
        verdict.extra_ms = _excess(phases, worst, {step: [w[i] for w in waits] for i, step in enumerate(steps)})
        if verdict.extra_ms:
            verdict.cause = max(verdict.extra_ms, key=verdict.extra_ms.get)
            verdict.cause_extra_ms = verdict.extra_ms[verdict.cause]
    return verdict


def _step_ms(rows: list[dict], steps: list[int], offsets: list[float]) -> float:
    """The median time from one step's first all-reduce to the next step's, on rank 0: the step's length."""
    gaps = [(rows[0][b].arrival_s[0] - rows[0][a].arrival_s[0]) * 1e3 / (b - a) for a, b in itertools.pairwise(steps)]
    return _median([g for g in gaps if g > 0])


def _excess(phases: PhaseRecord, rank: int, waits: dict[int, list[float]]) -> dict[str, float]:
    """Per phase (not ``step``): ``rank``'s median minus the median of the other ranks' medians, over the steps
    both records kept; backward without each rank's wait in that step."""
    medians = []
    for r, kept in enumerate(phases.ranks):
        rows = [row for row in kept.rows if row.step in waits]
        if not rows:
            return {}
        per_phase = {p: _median([getattr(row.ms, p) for row in rows]) for p in PHASES if p != "step"}
        per_phase["backward"] = _median([row.ms.backward - waits[row.step][r] for row in rows])
        medians.append(per_phase)
    others = [m for r, m in enumerate(medians) if r != rank]
    return {p: medians[rank][p] - _median([m[p] for m in others]) for p in medians[rank]}


def verdict_line(found: Straggler) -> str:
    """One line: the straggler, where it loses the time and who waits, or that there is none."""
    if found.rank is None:
        return (f"no straggler (the last rank to arrive at an all-reduce is {found.spread_ms:.1f} ms behind the "
                f"first, median; a straggler must be {found.threshold_ms:.1f} ms late at "
                f"{STRAGGLER_SHARE:.0%} of them)")  # fmt: skip
    waiting = [r for r in range(len(found.wait_ms)) if r != found.rank]
    waits = ", ".join(f"{found.wait_ms[r]:.1f}" for r in waiting)
    cause = f"; its {found.cause} phase is {found.cause_extra_ms:+.1f} ms over the other ranks' median" \
        if found.cause else ""  # fmt: skip
    return (f"straggler: rank {found.rank} arrives {found.late_ms:.1f} ms late at {found.share:.0%} of all-reduces"
            f"{cause}; rank(s) {', '.join(map(str, waiting))} wait {waits} ms per step; the all-reduce itself takes "
            f"{found.transfer_ms:.1f} ms")  # fmt: skip
