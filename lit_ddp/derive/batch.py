"""What a comparison reads of each run's batch (``lit_ddp.present.compare``): the samples one optimizer step of
the job processes, the samples/s row, and, where the two sides' batches differ, each time row read per sample.

    python -m lit_ddp.report RUN_BATCH_32 --compare RUN_BATCH_64      # samples/s first; the step's rows per sample

A step's samples are the job's: PhaseTimer's ``rows_per_rank`` (every micro-batch of the fit's first step) times
the rank count. Read per sample, a step twice as long for twice the samples is the same: the work per sample
did not change, and the throughput row says so too.
"""

import statistics
from collections.abc import Sequence
from typing import Optional

from lit_ddp.records.schema import CommRecord, PhaseRecord

Run = tuple[Optional[PhaseRecord], Optional[CommRecord]]
THROUGHPUT = "samples/s"  # the row's name and its unit: more is faster
PER_SAMPLE = "us"  # the time rows' unit once read per sample (printed µs)


def samples_per_step(run: Run) -> Optional[int]:
    """The samples one optimizer step of the job processes (rows per rank x ranks); None where the record does
    not say (no PhaseTimer record, or a batch whose rows PhaseTimer could not count)."""
    phases = run[0]
    if phases is None or phases.roofline is None or not phases.roofline.rows_per_rank:
        return None
    return phases.roofline.rows_per_rank * phases.meta.world_size


def _set_up(run: Run) -> str:
    phases = run[0]
    rows, ranks = phases.roofline.rows_per_rank, phases.meta.world_size
    return f"{rows * ranks} ({rows} per rank x {ranks} rank{'s' if ranks > 1 else ''})"


def per_sample(a_runs: Sequence[Run], b_runs: Sequence[Run]) -> bool:
    """Whether the time rows are read per sample: every run's samples per step are known, and not all equal."""
    found = [samples_per_step(r) for r in (*a_runs, *b_runs)]
    return None not in found and len(set(found)) > 1


def batch_notes(a_runs: Sequence[Run], b_runs: Sequence[Run]) -> list[str]:
    """The line that says the two sides process different samples per step (a batch or a rank count), and how the
    rows are read then; none where they are the same or a record does not say."""
    if not per_sample(a_runs, b_runs):
        return []
    a, b = a_runs[0], b_runs[0]
    return [f"A and B differ in samples per step: {_set_up(a)} against {_set_up(b)}: samples/s compares the "
            "throughput, and every time row is read per sample (the step's time over its samples, in µs)"]  # fmt: skip


def read(
    samples: dict[str, tuple[str, list[float]]], spreads: dict[str, float], run: Run, each_sample: bool
) -> tuple[dict[str, tuple[str, list[float]]], dict[str, float]]:
    """A run's ``run_samples`` and ``run_spreads`` with the samples/s row first (where the run's batch is known and
    it has a step row), and with ``each_sample`` every time row in µs per sample."""
    n = samples_per_step(run)
    step = samples.get("step", ("ms", []))[1]
    if n is None or not step:
        return samples, spreads
    out: dict[str, tuple[str, list[float]]] = {THROUGHPUT: (THROUGHPUT, [n / (ms / 1e3) for ms in step])}
    spread = dict(spreads)
    # The step's spread carried to the throughput (its derivative at the step's median: n / s^2 per ms)
    median = statistics.median(step)
    spread[THROUGHPUT] = n * 1e3 / median**2 * spreads.get("step", 0.0)
    for name, (unit, values) in samples.items():
        if each_sample and unit == "ms":
            out[name] = (PER_SAMPLE, [v * 1e3 / n for v in values])
            spread[name] = spreads.get(name, 0.0) * 1e3 / n
        else:
            out[name] = (unit, values)
    return out, spread
