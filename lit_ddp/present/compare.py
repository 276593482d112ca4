"""Two runs side by side: per row (the step, each phase, the exposed communication, each bucket's transfer and
wait, peak memory) A, B, B - A with its interval, and one word: ``slower`` / ``faster`` only beyond the noise,
``same`` otherwise; what makes the two hard to compare comes first, a one-line summary last.

    python -m lit_ddp.report RUN_A --compare RUN_B
    python -m lit_ddp.report A1 A2 A3 --compare B1 B2 B3       # several runs each: the variation between runs too
    python -m lit_ddp.report --trace TRACES_A --compare TRACES_B

The rows' samples are per step (``lit_ddp.derive.row_samples``); the intervals are the noise model's
(``lit_ddp.derive.noise``), at a level that holds for all rows together. How to read it: docs/noise.md.
"""

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from lit_ddp.derive import batch, noise
from lit_ddp.derive.row_samples import run_samples, run_spreads, trace_samples
from lit_ddp.derive.trace import RankAnalysis
from lit_ddp.errors import RecordError
from lit_ddp.formatting import fmt_bytes, fmt_ms, fmt_rate, fmt_us, table
from lit_ddp.records import phases as phase_table
from lit_ddp.records.runs import no_record
from lit_ddp.records.schema import CommRecord, PhaseRecord, load_run

CONFIDENCE = 0.95  # for the family of all the rows: the chance that any row is called by noise alone is <= 5%
# A time row that moves by less than this share of the step (the mean of A's and B's, the same whichever side is
# A) is the same: it cannot move the step by more. A/A pairs of real runs here differed beyond the noise by 0.2 ms
# in a 0.5 ms update, 2% of the step; a 10 ms sleep in forward made the update 0.25 ms slower (caches cold after
# the sleep), 5.5% of A's 4.5 ms step but 1.5% of B's 16.9 ms.
STEP_SHARE = 0.05
# A row that moved by more than this share of A's and that the noise cannot call says "can't tell", not "same": a
# step 52% longer in a run whose whole machine moved is not the same step (docs/noise.md, "What 'same' means").
CANT_TELL_SHARE = 0.25
CANT_TELL = "can't tell"
TIME_UNITS = ("ms", batch.PER_SAMPLE)
# ``Row.held``: why a row beyond its noise is "same" with one run per side (``one_run_rows``)
WHOLE_RUN, WAIT = "whole run", "wait"


@dataclass(frozen=True)
class Samples:
    """One row's per-step samples in each run, in step order; ``unit`` is ``ms`` or ``B``."""

    name: str
    unit: str
    a: list[float]
    b: list[float]
    spread: float = 0.0  # how far apart two processes of one job were seen in this row (``run_spreads``)


@dataclass(frozen=True)
class RunsSamples:
    """One row's per-step samples in each of several runs of A and of B (each run's in step order)."""

    name: str
    unit: str
    a: list[list[float]]
    b: list[list[float]]


@dataclass(frozen=True)
class Row:
    name: str
    unit: str
    a: float  # median
    b: float
    difference: noise.Interval  # median(b) - median(a)
    word: str  # slower / faster / same / can't tell
    steps: tuple[int, int]
    held: str = ""  # WHOLE_RUN or WAIT where a one-run rule, not the noise, made the word "same"


def compare(
    samples: Sequence[Samples | RunsSamples], confidence: float = CONFIDENCE, floor_ms: float = 0.0
) -> list[Row]:
    """Each row's difference at the level that holds for the family of rows (Bonferroni): one run per side,
    two runs made apart (``noise.difference_interval(between_runs=True)``, allowing for the row's ``spread``);
    several (``RunsSamples``), the runs' medians (``noise.runs_difference_interval``). A time row that moves by
    ``floor_ms`` or less is ``same``. Rows without a sample in either side are left out."""
    kept = [s for s in samples if s.a and s.b]
    level = noise.family_confidence(confidence, max(1, len(kept)))
    rows = []
    for s in kept:
        if isinstance(s, RunsSamples):
            d = noise.runs_difference_interval(s.a, s.b, confidence=level)
            medians = [statistics.fmean(statistics.median(x) for x in runs if x) for runs in (s.a, s.b)]
            steps = (min(map(len, s.a)), min(map(len, s.b)))
        else:
            d = noise.difference_interval(s.a, s.b, confidence=level, between_runs=True, spread=s.spread)
            medians, steps = [statistics.median(s.a), statistics.median(s.b)], (len(s.a), len(s.b))
        if s.unit == batch.THROUGHPUT:  # more is faster; the floor is the step's share of its mean
            word = noise.call(d, min_effect=STEP_SHARE * statistics.fmean(medians))
            word = {"slower": "faster", "faster": "slower"}.get(word, word)
        else:
            word = noise.call(d, min_effect=floor_ms if s.unit in TIME_UNITS else 0.0)
        rows.append(Row(s.name, s.unit, medians[0], medians[1], d, word, steps))
    return rows


def _fmt(value: float, unit: str) -> str:
    if unit in (batch.THROUGHPUT, batch.PER_SAMPLE):
        return fmt_rate(value) if unit == batch.THROUGHPUT else fmt_us(value)
    return fmt_ms(value) if unit == "ms" else fmt_bytes(value)


def _signed(value: float, unit: str) -> str:
    return ("+" if value >= 0 else "-") + _fmt(abs(value), unit)


def _interval(row: Row) -> str:
    d = row.difference
    if math.isinf(d.low):
        return f"can't tell ({min(row.steps)} steps)"
    return f"{_signed(d.low, row.unit)} to {_signed(d.high, row.unit)}"


def unresolved(rows: Sequence[Row]) -> list[Row]:
    """The rows with ``can't tell`` for ``same`` where they moved by over ``CANT_TELL_SHARE`` of A's median (a time
    row also by over ``STEP_SHARE`` of the step: a move that could matter) and the noise (or a one-run rule,
    ``Row.held``) could not call the move; a move beyond the noise under the step's floor stays ``same*``."""
    step = next((r for r in rows if r.name == "step"), None)
    floor = STEP_SHARE * (step.a + step.b) / 2 if step is not None else 0.0

    def unsure(r: Row) -> bool:
        moved = abs(r.difference.estimate)
        big = r.a and moved > CANT_TELL_SHARE * abs(r.a) and (r.unit not in TIME_UNITS or moved > floor)
        return bool(r.word == "same" and big and (r.held or not r.difference.excludes(0.0)))

    return [replace(r, word=CANT_TELL) if unsure(r) else r for r in rows]


def summary(rows: Sequence[Row]) -> str:
    """One line: the row that changed most beyond the noise (by its share of A), and how many did."""
    called = [r for r in rows if r.word in ("slower", "faster")]
    unsure = [r for r in rows if r.word == CANT_TELL]
    held = {r.held for r in rows}
    if not called and WHOLE_RUN in held:
        return (f"Summary: can't tell: every phase moved with the whole run, so no time row is called ({len(rows)} "
                "rows); compare several runs of each")  # fmt: skip
    if not called and WAIT in held:
        return (f"Summary: can't tell: no row is called, and the ranks' waits moved beyond the noise, which one run "
                f"per side cannot tell from the machine ({len(rows)} rows); compare several runs of each")  # fmt: skip
    if unsure and not called:
        top = max(unsure, key=lambda r: abs(r.difference.estimate) / r.a)
        return (
            f"Summary: can't tell: {len(unsure)} row(s) moved by over {CANT_TELL_SHARE:.0%} where the noise "
            f"cannot call it ({top.name} {top.difference.estimate / top.a:+.0%}); compare several runs of each"
        )
    if not called:
        return (f"Summary: no row differs beyond the noise ({len(rows)} rows, {CONFIDENCE:.0%} for all of them "
                "together)")  # fmt: skip
    top = max(called, key=lambda r: abs(r.difference.estimate) / r.a if r.a else math.inf)
    share = f" ({top.difference.estimate / top.a:+.0%})" if top.a else ""
    return (
        f"Summary: {top.name} changed most, {_signed(top.difference.estimate, top.unit)}{share}, {top.word} in B; "
        f"{len(called)} of {len(rows)} rows differ beyond the noise"
        + (f", {len(unsure)} moved by over {CANT_TELL_SHARE:.0%} within it (can't tell)" if unsure else "")
    )


def render(title: str, notes: Sequence[str], rows: Sequence[Row]) -> str:
    """The notes (what makes the runs hard to compare) first, then the table and the summary."""
    head = [f"{note}" for note in notes]
    rows = unresolved(rows)
    level = noise.family_confidence(CONFIDENCE, max(1, len(rows)))
    small = {r.name for r in rows if r.word == "same" and r.difference.excludes(0.0) and not r.held}
    cells = [(r.name, _fmt(r.a, r.unit), _fmt(r.b, r.unit), _signed(r.difference.estimate, r.unit), _interval(r),
              r.word + ("*" if r.name in small else "")) for r in rows]  # fmt: skip
    text = table(("row", "A (median)", "B (median)", "B - A", f"interval ({level:.2%} each)", "word"), cells)
    note = [f"same*: beyond the noise, but under {STEP_SHARE:.0%} of the step (A's and B's mean)"] if small else []
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


Run = tuple[Optional[PhaseRecord], Optional[CommRecord]]
ONE_RUN = ("One run per side: each row allows for how far apart this job's ranks (separate processes) and each run's "
           "halves were seen, not for a machine that slowed a whole run (another job for all of it), so a change "
           "and run-to-run variation can look alike; for a firmer answer make 3 or more runs of each, in turn, and "
           "compare them: python -m lit_ddp.report A1 A2 A3 --compare B1 B2 B3")  # fmt: skip


def whole_run_shift(a: Run, b: Run) -> Optional[str]:
    """``"slower"`` (``"faster"``) when every part of B's step that A has (forward, backward, update, data,
    other) is slower (faster) than A's beyond its own steps' noise, at the level that holds for the parts
    together: the mark of a machine that slowed (or freed) one whole run, more than of a change, which moves
    some parts and leaves update and other alone. None otherwise, or with fewer than 3 such parts."""
    if a[0] is None or b[0] is None:
        return None
    return _shift(run_samples(a[0], None), run_samples(b[0], None))


def _shift(sa: dict, sb: dict) -> Optional[str]:
    """``whole_run_shift`` on the two runs' ``run_samples``, each with its phase rows."""
    parts = [p for p in phase_table.names() if sa[p][1] and sb[p][1] and statistics.median(sa[p][1]) > 0]
    if len(parts) < 3:
        return None
    level = noise.family_confidence(CONFIDENCE, len(parts))
    words = {noise.call(noise.difference_interval(sa[p][1], sb[p][1], confidence=level)) for p in parts}
    return words.pop() if len(words) == 1 and "same" not in words else None


def compare_runs(a: Run, b: Run) -> str:
    """The comparison of two runs' records, as printed by ``python -m lit_ddp.report A --compare B``."""
    return compare_many([a], [b])


def compare_many(a_runs: Sequence[Run], b_runs: Sequence[Run]) -> str:
    """Several runs of A against several of B (one of each: ``run_rows``, and the note that says what one run per
    side cannot tell), as printed by ``python -m lit_ddp.report A1 A2 --compare B1 B2``."""
    notes = batch.batch_notes(a_runs, b_runs) + incompatibilities(a_runs[0], b_runs[0])
    for side, runs in (("A", a_runs), ("B", b_runs)):
        notes += [f"{side}'s runs differ among themselves: {n.removeprefix('A and B differ in ')}"
                  for n in dict.fromkeys(n for r in runs[1:] for n in incompatibilities(runs[0], r))]  # fmt: skip
    if len(a_runs) == len(b_runs) == 1:
        rows, moved = one_run_rows(a_runs[0], b_runs[0])
        return render(f"Run B against run A, {_per(a_runs, b_runs)}", [*notes, *moved, ONE_RUN], rows)
    title = (f"{len(b_runs)} run(s) of B against {len(a_runs)} of A (each side the mean of its runs' medians), "
             f"{_per(a_runs, b_runs)}")  # fmt: skip
    return render(title, notes, many_rows(a_runs, b_runs))


def _per(a_runs: Sequence[Run], b_runs: Sequence[Run]) -> str:
    return ("per sample after warm-up (each step's time over its samples)" if batch.per_sample(a_runs, b_runs)
            else "per step after warm-up")  # fmt: skip


def _samples(run: Run, each_sample: bool) -> tuple[dict, dict]:
    """A run's ``run_samples`` and ``run_spreads``, read with its batch (``batch.read``)."""
    return batch.read(run_samples(*run), run_spreads(*run), run, each_sample)


def step_floor(a: Sequence[dict], b: Sequence[dict]) -> float:
    """``STEP_SHARE`` of the step: the mean of the two sides' step medians (each side the mean of its runs'), so
    the words are the same whichever side is A; 0 where a side has no step row."""
    sides = [[statistics.median(s["step"][1]) for s in side if s.get("step", (0, []))[1]] for side in (a, b)]
    if not all(sides):
        return 0.0
    return STEP_SHARE * statistics.fmean(statistics.fmean(side) for side in sides)


def run_rows(a: Run, b: Run) -> list[Row]:
    """The rows both runs have (the per-bucket ones only with one bucket layout), compared, each allowing for
    the larger of the two runs' ``run_spreads``; no time row called where the whole run moved, and no bucket
    wait (``one_run_rows``)."""
    return one_run_rows(a, b)[0]


def one_run_rows(a: Run, b: Run) -> tuple[list[Row], list[str]]:
    """``run_rows``, and the line that says why no time row is called, if one is: every part of the step moved
    the same way beyond its noise (``whole_run_shift``), or the parts called explain under half of the step's
    move (``unexplained_move``); else the line that says why no bucket wait is called, if one moved beyond its
    noise. Memory rows are called either way.

    A bucket's wait (the last hand-over less the first) is a property of the run's processes and the machine's
    load more than of the code: a rank late steadily is a process difference, allowed for as every row allows for
    its ranks' spread (``run_spreads``), so only a change in how the hand-overs scatter from step to step is ever
    beyond the noise, and that scatter is what load sets for a whole run (the waits of 2-rank runs of one job here:
    0.05-0.14 ms on a quiet machine, 0.94-2.1 ms with two busy processes beside them; an A/A pair 0.01 against
    0.98 ms). Whom the others wait for is each run's straggler line's to say; several runs per side compare the
    waits."""
    each_sample = batch.per_sample([a], [b])
    (sa, spread_a), (sb, spread_b) = _samples(a, each_sample), _samples(b, each_sample)
    same_layout = a[1] is None or b[1] is None or a[1].layout == b[1].layout
    names = [n for n in sa if n in sb and (same_layout or not n.startswith("bucket"))]
    # Every row of a run's run_samples has its entry in that run's run_spreads: the defaults are never read.
    spread = {n: max(spread_a.get(n, 0.0), spread_b.get(n, 0.0)) for n in names}
    rows = compare(
        [Samples(n, sa[n][0], sa[n][1], sb[n][1], spread[n]) for n in names], floor_ms=step_floor([sa], [sb])
    )
    # whole_run_shift, samples at hand; not across batches, where every part's time per sample moves by design
    shift = _shift(sa, sb) if a[0] is not None and b[0] is not None and not each_sample else None
    if shift is not None:
        why = (f"Every phase of B is {shift} than A's beyond its steps' noise, update and other too: the mark of a "
               f"machine that {'slowed' if shift == 'slower' else 'freed'} one whole run more than of a change, so "
               "no time row is called (can't tell)")  # fmt: skip
    else:
        why = unexplained_move(rows)
    if why is not None:
        return [replace(r, word="same", held=WHOLE_RUN) if r.unit != "B" else r for r in rows], [why]
    waits = [r.name for r in rows if r.word != "same" and r.name.startswith("bucket ") and r.name.endswith(" wait")]
    if not waits:
        return rows, []
    line = (f"The ranks' waits moved beyond their steps' noise ({', '.join(waits)}), which one run per side cannot "
            "tell from the runs' processes and the machine's load: how far apart the ranks hand over their gradients "
            "follows which rank shares a busy core and how loaded the machine is as much as the code, so it is not "
            "called (can't tell); each run's own straggler line names the rank the others wait for, beyond that "
            "run's noise (python -m lit_ddp.report RUN)")  # fmt: skip
    return [replace(r, word="same", held=WAIT) if r.name in waits else r for r in rows], [line]


# The parts whose sum is the step (``StepPhases``): what a change of the step is made of.
EXPLAINED = 0.5  # the parts called must make up at least this share of the step's move, else the run moved


def unexplained_move(rows: Sequence[Row]) -> Optional[str]:
    """The line for a step that moved (its estimate) the way its parts called beyond the noise did, by more
    than twice their sum: the rest of the move is spread over parts none of which is beyond its own noise, as
    when a machine slows a whole run (each part by a share, the shorter ones within their noise). A change to
    the model or a knob moves the parts it touches, and they make up the step's move (a 10 ms longer forward:
    forward +10.9 ms of the step's +12.3 ms, 89%). A step called beyond its noise while every part's interval
    holds 0 is the same mark (a change moves a part beyond its noise, if under the floor). None otherwise."""
    by_name = {r.name: r for r in rows}
    step = by_name.get("step")
    called = [by_name[p] for p in phase_table.names() if p in by_name and by_name[p].word != "same"]
    if step is None:
        return None
    moved, explained, unit = step.difference.estimate, sum(r.difference.estimate for r in called), step.unit
    machine = ("the mark of a machine that slowed or freed one run more than of a change, so no time row is called "
               "(can't tell)")  # fmt: skip
    if not called:
        parts = [by_name[p] for p in phase_table.names() if p in by_name]
        if step.word == "same" or any(r.difference.excludes(0.0) for r in parts):
            return None  # the step did not move, or a part moved beyond its noise (under the floor): a change
        return (f"The step moved by {_signed(moved, unit)} beyond its noise and no part of it did: the move is "
                f"spread over parts each within its own noise, {machine}")  # fmt: skip
    if moved * explained <= 0 or abs(explained) >= EXPLAINED * abs(moved):
        return None
    names = ", ".join(r.name for r in called)
    return (f"The step moved by {_signed(moved, unit)} and the parts called beyond their noise ({names}) make up "
            f"{_signed(explained, unit)} of it ({explained / moved:.0%}): the rest moved with the whole run, "
            f"{machine}")  # fmt: skip


def many_rows(a_runs: Sequence[Run], b_runs: Sequence[Run]) -> list[Row]:
    """The rows every run has (the per-bucket ones only with one bucket layout in all), compared over the runs
    (``noise.runs_difference_interval``: the runs' medians, their spread between runs included)."""
    each_sample = batch.per_sample(a_runs, b_runs)
    sa, sb = [_samples(r, each_sample)[0] for r in a_runs], [_samples(r, each_sample)[0] for r in b_runs]
    layouts = {tuple(c.layout) for _, c in (*a_runs, *b_runs) if c is not None}
    names = [n for n in sa[0] if all(n in s for s in (*sa, *sb)) and (len(layouts) < 2 or not n.startswith("bucket"))]
    floor = step_floor(sa, sb)
    return compare([RunsSamples(n, sa[0][n][0], [s[n][1] for s in sa], [s[n][1] for s in sb]) for n in names],
                   floor_ms=floor)  # fmt: skip


def _load(run_dir: Path) -> Run:
    if not run_dir.is_dir():
        raise RecordError(f"{run_dir} is not a directory")
    found = load_run(run_dir)
    if found == (None, None):
        raise RecordError(no_record(run_dir))
    return found


def compare_dirs(run_a: Path | Sequence[Path], run_b: Path | Sequence[Path]) -> str:
    """``report RUN_A [RUN_A2 ...] --compare RUN_B [RUN_B2 ...]``: every run's records (``RecordError`` for a
    directory without one), then ``compare_many``."""
    sides = [[Path(p) for p in ([r] if isinstance(r, (str, Path)) else r)] for r in (run_a, run_b)]
    runs = [[_load(p) for p in side] for side in sides]
    return f"A: {', '.join(map(str, sides[0]))}\nB: {', '.join(map(str, sides[1]))}\n{compare_many(*runs)}"


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
