"""``report A --compare B`` knows the batch (``lit_ddp.derive.batch``): samples/s from the records' rows per
rank, a batch or rank-count difference said first with the time rows then read per sample, and a change beyond a
quarter that the noise cannot call is "can't tell", not "same"."""

import dataclasses
import random
import re

import pytest

from lit_ddp import report
from lit_ddp.derive import batch
from lit_ddp.present import compare
from lit_ddp.records.schema import Roofline, save
from tests import records
from tests.test_compare import a_run


def words(text: str) -> dict[str, str]:
    """``{row: word}`` of a printed comparison, per step or per sample (``same*`` reads as ``same``)."""
    table = re.split(r"after warm-up( \(.*\))?:\n", text)[-1].split("\nSummary: ")[0].splitlines()[1:]
    return {re.split(r"\s{2,}", line)[0]: re.split(r"\s{2,}", line)[-1].rstrip("*") for line in table
            if not line.startswith("same*: ")}  # fmt: skip


pytestmark = pytest.mark.timeout(120)


def batched(run, rows_per_rank: int):
    """``run`` with PhaseTimer's count of each rank's rows per step."""
    phases, comm = run
    return dataclasses.replace(phases, roofline=Roofline(rows_per_rank, 0.0, 0.0, 0.0)), comm


def scaled_run(seed: int, scale: float, ranks: int = 2, steps: int = 40):
    """Phases (2, 6, 1, 0.5) ms, each times ``scale``, with seeded noise; no communication record."""
    rng = random.Random(seed)
    per_rank = [[tuple(rng.gauss(m * scale, 0.05 * scale) for m in (2.0, 6.0, 1.0, 0.5)) for _ in range(steps)]
                for _ in range(ranks)]  # fmt: skip
    return records.phase_record(per_rank), None


def test_samples_per_step_are_rows_per_rank_times_ranks_and_unknown_without_a_count():
    assert batch.samples_per_step(batched(a_run(1), 16)) == 32
    assert batch.samples_per_step(a_run(1)) is None  # no roofline: not counted
    assert batch.samples_per_step(batched(a_run(1), 0)) is None  # a batch PhaseTimer could not count
    assert batch.samples_per_step((None, a_run(1)[1])) is None


def test_one_batch_gets_a_samples_per_s_row_first_and_its_time_rows_per_step():
    text = compare.compare_runs(batched(a_run(1), 16), batched(a_run(2, forward=12.0), 16))
    assert "differ in samples per step" not in text and "per step after warm-up:" in text, text
    found = words(text)
    assert list(found)[:2] == ["samples/s", "step"], text
    assert found["samples/s"] == "slower" and found["forward"] == "slower", text  # 10 ms more forward: fewer samples/s
    a_step = 2.0 + 6.0 + 1.0 + 0.5
    (line,) = [x for x in text.splitlines() if x.startswith("samples/s")]
    assert f"{32 / (a_step / 1e3):,.0f}/s"[:2] in line.split()[1], line  # about 3,368 samples/s in A


def test_a_doubled_batch_is_said_first_and_read_per_sample():
    """Batch 16 against 32 per rank, every phase twice as long: per sample nothing changed, and samples/s says so;
    per step the whole run would have "slowed"."""
    a, b = batched(scaled_run(1, 1.0), 16), batched(scaled_run(2, 2.0), 32)
    text = compare.compare_runs(a, b)
    assert text.splitlines()[0] == (
        "A and B differ in samples per step: 32 (16 per rank x 2 ranks) against 64 (32 per rank x 2 ranks): "
        "samples/s compares the throughput, and every time row is read per sample (the step's time over its "
        "samples, in µs)"
    )
    assert "per sample after warm-up (each step's time over its samples):" in text, text
    found = words(text)
    assert set(found.values()) == {"same"}, text
    step = next(x for x in text.splitlines() if x.startswith("step "))
    assert step.split()[2] == "µs" and 290 < float(step.split()[1]) < 305, step  # 9.5 ms / 32 samples: 297 µs
    # Twice the batch in 1.5 times the step: faster per sample and in samples/s, by a third
    faster = compare.compare_runs(a, batched(scaled_run(3, 1.5), 32))
    found = words(faster)
    assert found["samples/s"] == "faster" and found["step"] == "faster", faster
    assert faster.splitlines()[-1].startswith("Summary: samples/s changed most, +"), faster


def test_a_rank_count_difference_is_read_per_sample_too():
    a, b = batched(scaled_run(1, 1.0, ranks=2), 16), batched(scaled_run(2, 1.0, ranks=4), 16)
    text = compare.compare_runs(a, b)
    assert text.splitlines()[0].startswith("A and B differ in samples per step: 32 (16 per rank x 2 ranks) against "
                                           "64 (16 per rank x 4 ranks)")  # fmt: skip
    assert text.splitlines()[1].startswith("A and B differ in rank count: 2 against 4")
    found = words(text)
    assert found["samples/s"] == "faster" and found["step"] == "faster", text  # the same step, twice the samples


def test_a_change_beyond_a_quarter_that_the_noise_cannot_call_is_cant_tell():
    """Every phase 1.25 ms longer (a step 52% longer): the whole run moved, so no time row is called, and those
    that moved by over 25% say so."""
    text = compare.compare_runs(a_run(1), a_run(2, moved=1.25))
    found = words(text)
    assert found["step"] == found["forward"] == found["update"] == "can't tell", text
    assert found["backward"] == "same", text  # +21%: within a quarter
    assert text.splitlines()[-1].startswith("Summary: can't tell: every phase moved with the whole run")
    (step,) = [r for r in compare.unresolved(compare.run_rows(a_run(1), a_run(2, moved=1.25))) if r.name == "step"]
    assert step.word == "can't tell" and step.difference.estimate / step.a > 0.4


def test_the_report_prints_samples_per_s_for_two_saved_runs(tmp_path, capsys):
    for name, run in (("a", batched(scaled_run(1, 1.0), 16)), ("b", batched(scaled_run(2, 2.0), 32))):
        (tmp_path / name).mkdir()
        save(run[0], tmp_path / name / "phases.json")
    assert report.main([str(tmp_path / "a"), "--compare", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "A and B differ in samples per step: 32" in out and "\nsamples/s " in out, out
