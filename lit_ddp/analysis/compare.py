"""Two runs side by side: per row (the step, each phase, the exposed communication, each bucket's transfer and
wait, peak memory) A, B, B - A with its interval, and one word: ``slower`` / ``faster`` only beyond the noise,
``same`` otherwise; what makes the two hard to compare comes first, a one-line summary last.

    python -m lit_ddp.report RUN_A --compare RUN_B
    python -m lit_ddp.report --trace TRACES_A --compare TRACES_B

The rows' samples are per step (``run_samples``, ``trace_samples``); the intervals are the noise model's
(``lit_ddp.analysis.noise``), at a level that holds for all rows together. How to read it: docs/noise.md.
"""

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from lit_ddp.analysis import noise, stragglers
from lit_ddp.analysis.tables import fmt_ms, table
from lit_ddp.analysis.trace import TRACE_PHASES, RankAnalysis
from lit_ddp.errors import RecordError
from lit_ddp.formatting import fmt_bytes
from lit_ddp.records.schema import PHASES, CommRecord, PhaseRecord, is_steady, load_run

CONFIDENCE = 0.95  # for the family of all the rows: the chance that any row is called by noise alone is <= 5%
# A time row that moves by less than this share of A's step is the same: it cannot move the step by more (A/A
# pairs of real runs here differed beyond the noise by 0.2 ms in a 0.5 ms update, 2% of the step).
STEP_SHARE = 0.05


@dataclass(frozen=True)
class Samples:
    """One row's per-step samples in each run, in step order; ``unit`` is ``ms`` or ``B``."""

    name: str
    unit: str
    a: list[float]
    b: list[float]


@dataclass(frozen=True)
class Row:
    name: str
    unit: str
    a: float  # median
    b: float
    difference: noise.Interval  # median(b) - median(a)
    word: str  # slower / faster / same
    steps: tuple[int, int]


def compare(samples: Sequence[Samples], confidence: float = CONFIDENCE, floor_ms: float = 0.0) -> list[Row]:
    """Each row's difference at the level that holds for the family of rows (Bonferroni), two runs made apart
    (``noise.difference_interval(between_runs=True)``); a time row that moves by ``floor_ms`` or less is ``same``.
    Rows without a sample in either run are left out."""
    kept = [s for s in samples if s.a and s.b]
    level = noise.family_confidence(confidence, max(1, len(kept)))
    rows = []
    for s in kept:
        d = noise.difference_interval(s.a, s.b, confidence=level, between_runs=True)
        word = noise.call(d, min_effect=floor_ms if s.unit == "ms" else 0.0)
        rows.append(Row(s.name, s.unit, statistics.median(s.a), statistics.median(s.b), d, word,
                        (len(s.a), len(s.b))))  # fmt: skip
    return rows


def _fmt(value: float, unit: str) -> str:
    return fmt_ms(value) if unit == "ms" else fmt_bytes(value)


def _signed(value: float, unit: str) -> str:
    return ("+" if value >= 0 else "-") + _fmt(abs(value), unit)


def _interval(row: Row) -> str:
    d = row.difference
    if math.isinf(d.low):
        return f"can't tell ({min(row.steps)} steps)"
    return f"{_signed(d.low, row.unit)} to {_signed(d.high, row.unit)}"


def summary(rows: Sequence[Row]) -> str:
    """One line: the row that changed most beyond the noise (by its share of A), and how many did."""
    called = [r for r in rows if r.word != "same"]
    if not called:
        return (f"Summary: no row differs beyond the noise ({len(rows)} rows, {CONFIDENCE:.0%} for all of them "
                "together)")  # fmt: skip
    top = max(called, key=lambda r: abs(r.difference.estimate) / r.a if r.a else math.inf)
    share = f" ({top.difference.estimate / top.a:+.0%})" if top.a else ""
    return (f"Summary: {top.name} changed most, {_signed(top.difference.estimate, top.unit)}{share}, {top.word} in B; "
            f"{len(called)} of {len(rows)} rows differ beyond the noise")  # fmt: skip


def render(title: str, notes: Sequence[str], rows: Sequence[Row]) -> str:
    """The notes (what makes the runs hard to compare) first, then the table and the summary."""
    head = [f"{note}" for note in notes]
    level = noise.family_confidence(CONFIDENCE, max(1, len(rows)))
    small = {r.name for r in rows if r.word == "same" and r.difference.excludes(0.0)}
    cells = [(r.name, _fmt(r.a, r.unit), _fmt(r.b, r.unit), _signed(r.difference.estimate, r.unit), _interval(r),
              r.word + ("*" if r.name in small else "")) for r in rows]  # fmt: skip
    text = table(("row", "A (median)", "B (median)", "B - A", f"interval ({level:.2%} each)", "word"), cells)
    note = [f"same*: beyond the noise, but under {STEP_SHARE:.0%} of A's step"] if small else []
    return "\n".join([*head, f"{title}:", text, *note, summary(rows)])


def incompatibilities(a: tuple[Optional[PhaseRecord], Optional[CommRecord]],
                      b: tuple[Optional[PhaseRecord], Optional[CommRecord]]) -> list[str]:  # fmt: skip
    """What differs between the two runs' set-ups: another model (its gradient bytes), rank count, dtype,
    backend, device, compression or bucket layout; each a line."""
    meta_a = (a[0] or a[1]).meta
    meta_b = (b[0] or b[1]).meta
    found = []

    def differ(what: str, x: object, y: object, why: str) -> None:
        if x != y:
            found.append(f"A and B differ in {what}: {x} against {y} ({why})")

    differ("rank count", meta_a.world_size, meta_b.world_size, "each rank's share of the work differs")
    differ("precision", meta_a.precision, meta_b.precision, "the dtype of the compute")
    differ("backend", meta_a.backend, meta_b.backend, "another collective library")
    differ("device", meta_a.device_name, meta_b.device_name, "another machine's speed")
    if a[1] is not None and b[1] is not None:
        differ("the model (gradient bytes)", f"{a[1].param_bytes:,}", f"{b[1].param_bytes:,}", "another model")
        differ("the dtype on the wire", a[1].wire_dtype, b[1].wire_dtype, "the bytes each all-reduce moves")
        differ("compression", a[1].compression or "none", b[1].compression or "none", "the bytes on the wire")
        if a[1].layout != b[1].layout:
            found.append(f"A and B differ in DDP's bucket layout: {_layout(a[1].layout)} against "
                         f"{_layout(b[1].layout)} (the per-bucket rows are left out)")  # fmt: skip
    return found


def _layout(layout: Sequence[int]) -> str:
    sizes = ", ".join(f"{n:,}" for n in layout[:4]) + (", ..." if len(layout) > 4 else "")
    return f"{len(layout)} bucket(s) of {sizes} bytes"


def _per_step(record: PhaseRecord, value) -> dict[int, float]:
    """Per steady step every rank kept: the mean over ranks of ``value(row)``."""
    left_out = {*record.profiled_steps, *record.skipped_steps}
    per_rank = [{r.step: value(r) for r in rank.rows if is_steady(r.step, left_out)} for rank in record.ranks]
    steps = sorted(set.intersection(*(set(d) for d in per_rank)))
    return {s: statistics.fmean(d[s] for d in per_rank) for s in steps}


def run_samples(phases: Optional[PhaseRecord], comm: Optional[CommRecord]) -> dict[str, tuple[str, list[float]]]:
    """``{row: (unit, per-step samples)}`` of one run: each phase (mean over ranks), the exposed communication
    (mean over ranks), each bucket's transfer (the shortest across ranks) and wait (last arrival minus first),
    and the peak memory of the step (the highest rank)."""
    out: dict[str, tuple[str, list[float]]] = {}
    if phases is not None:
        for p in ("step", *(p for p in PHASES if p != "step")):
            out[p] = ("ms", list(_per_step(phases, lambda r, p=p: getattr(r.ms, p)).values()))
    if comm is not None:
        kept = [{r.step: r for r in rank.rows if r.bytes == comm.layout and is_steady(r.step, comm.profiled_steps)}
                for rank in comm.ranks]  # fmt: skip
        steps = sorted(set.intersection(*(set(k) for k in kept)))
        out["exposed comm"] = ("ms", [statistics.fmean(k[s].exposed_ms for k in kept) for s in steps])
        found = stragglers.arrivals(comm)
        for b in range(len(comm.layout)):
            if found is not None:
                out[f"bucket {b} transfer"] = ("ms", found.transfer_per_bucket[b])
                out[f"bucket {b} wait"] = ("ms", found.wait_per_bucket[b])
            else:
                out[f"bucket {b} all-reduce"] = ("ms", [kept[0][s].ms[b] for s in steps])
    if phases is not None:
        per_rank = [{m.step: m.peak.get("step") for m in rank.memory if m.peak.get("step") is not None}
                    for rank in phases.ranks]  # fmt: skip
        steps = sorted(set.intersection(*(set(d) for d in per_rank))) if per_rank else []
        if steps:
            out["peak memory"] = ("B", [float(max(d[s] for d in per_rank)) for s in steps])
    return out


def compare_runs(a: tuple[Optional[PhaseRecord], Optional[CommRecord]],
                 b: tuple[Optional[PhaseRecord], Optional[CommRecord]]) -> str:  # fmt: skip
    """The comparison of two runs' records, as printed by ``python -m lit_ddp.report A --compare B``."""
    return render("Run B against run A, per step after warm-up", incompatibilities(a, b), run_rows(a, b))


def run_rows(a: tuple[Optional[PhaseRecord], Optional[CommRecord]],
             b: tuple[Optional[PhaseRecord], Optional[CommRecord]]) -> list[Row]:  # fmt: skip
    """The rows both runs have (the per-bucket ones only with one bucket layout), compared."""
    sa, sb = run_samples(*a), run_samples(*b)
    same_layout = a[1] is None or b[1] is None or a[1].layout == b[1].layout
    names = [n for n in sa if n in sb and (same_layout or not n.startswith("bucket"))]
    floor = STEP_SHARE * statistics.median(sa["step"][1]) if sa.get("step", (0, []))[1] else 0.0
    return compare([Samples(n, sa[n][0], sa[n][1], sb[n][1]) for n in names], floor_ms=floor)


def compare_dirs(run_a: Path, run_b: Path) -> str:
    """``report RUN_A --compare RUN_B``: both runs' records (``RecordError`` for a directory without one), then
    ``compare_runs``."""
    runs = []
    for run_dir in (Path(run_a), Path(run_b)):
        if not run_dir.is_dir():
            raise RecordError(f"{run_dir} is not a directory")
        found = load_run(run_dir)
        if found == (None, None):
            raise RecordError(f"{run_dir} holds neither phases.json nor comm.json: was PhaseTimer or CommMonitor on?")
        runs.append(found)
    return f"A: {run_a}\nB: {run_b}\n{compare_runs(*runs)}"


def trace_samples(analyses: Sequence[RankAnalysis]) -> dict[str, tuple[str, list[float]]]:
    """``{row: (unit, per-step samples)}`` of one job's traces: per counted step, the mean over ranks of the
    step's span, each phase's span, the GPUs' compute, communication, idle time and the exposed communication."""
    figures: dict[str, dict[int, list[float]]] = {}

    def add(name: str, step: int, us: Optional[float]) -> None:
        if us is not None:
            figures.setdefault(name, {}).setdefault(step, []).append(us / 1e3)

    for a in analyses:
        for s in a.steps:
            if not s.counted:
                continue
            b = s.breakdown
            add("step (span)", s.step, b.span_us)
            for p in TRACE_PHASES:
                if p in s.phases:
                    add(f"{p} (span)", s.step, s.phases[p].span_us)
            add("compute", s.step, b.compute_us)
            add("communication", s.step, b.communication_us)
            add("exposed comm", s.step, s.exposed_comm_us)
            add("idle", s.step, b.idle_us)
    n = len(analyses)
    return {name: ("ms", [statistics.fmean(v) for _, v in sorted(per_step.items()) if len(v) == n])
            for name, per_step in figures.items()}  # fmt: skip


def compare_traces(a: Sequence[RankAnalysis], b: Sequence[RankAnalysis]) -> str:
    """The comparison of two profiles of one job, as printed by ``report --trace A --compare B``."""
    notes = []
    if len(a) != len(b):
        notes.append(f"A and B differ in rank count: {len(a)} against {len(b)} trace(s)")
    sa, sb = trace_samples(a), trace_samples(b)
    rows = compare([Samples(n, u, sa[n][1], sb[n][1]) for n, (u, _) in sa.items() if n in sb])
    few = min((min(r.steps) for r in rows), default=0)
    if few < noise.MIN_SAMPLES:
        notes.append(f"A profile holds few steps ({few}): rows of fewer than {noise.MIN_SAMPLES} can't tell a change "
                     "from the noise (profile more steps)")  # fmt: skip
    return render("Profile B against profile A, per counted step (mean over ranks)", notes, rows)
