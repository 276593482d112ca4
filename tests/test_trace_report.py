"""``python -m lit_ddp.trace_report DIR``: tables, verdict, picture and ``--json`` from per-rank traces; one line
and exit 2 for nothing to analyse, Lightning PyTorchProfiler's CPU traces of a real 2-rank run included."""

import json
import random
import shutil
import sys
from pathlib import Path

import pytest

from lit_ddp import trace_report
from lit_ddp.analysis import trace_tables
from lit_ddp.analysis.trace import GRADIENT, Breakdown, RankAnalysis, StepAnalysis, analyze_rank, combine, load
from tests.runner import run_module
from tests.test_trace import A100, event, synthetic

pytestmark = pytest.mark.timeout(60)

RANK_KEYS = {"rank", "span_us", "idle_us", "compute_us", "non_compute_us", "comm_comp_overlap_pct"}
COLLECTIVE_KEYS = {"step", "name", "bytes", "duration_us", "algbw_gbps", "busbw_gbps", "kind"}


def report_main(capsys, *args: str) -> tuple[int, str, str]:
    code = trace_report.main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_the_command_reports_the_a100_trace_and_writes_the_json(tmp_path):
    traces = tmp_path / "traces"
    traces.mkdir()
    shutil.copy(A100, traces)
    done = run_module("lit_ddp.trace_report", str(traces), "--json", str(tmp_path / "out.json"), "--no-plot",
                      cwd=tmp_path, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "GPU time per rank" in done.stdout and "last step (6) left out" in done.stdout
    assert "1 of 2 ranks' traces found" in done.stdout  # distributedInfo says 2 ranks; one file here
    assert "Per phase, rank 0" in done.stdout and "Exposed communication" in done.stdout
    assert (
        done.stdout.count("gradient all-reduce  ") == 15
        and "Verdict: can't tell what bounds the GPUs: the profile holds 2 counted step(s)" in done.stdout
    )
    assert not (traces / trace_report.PICTURE).exists()
    data = json.loads((tmp_path / "out.json").read_text())
    assert set(data) == {"ranks"} and len(data["ranks"]) == 1
    rank = data["ranks"][0]
    assert RANK_KEYS <= set(rank) and rank["rank"] == 0 and rank["counted_steps"] == [4, 5]
    assert rank["span_us"] == pytest.approx(435_586, rel=0.01)  # microseconds (HTA's kernel_time)
    assert len(rank["collectives"]) == 21 and all(COLLECTIVE_KEYS <= set(c) for c in rank["collectives"])
    assert [c["kind"] for c in rank["collectives"][:7]] == ["other"] * 2 + [GRADIENT] * 5
    assert rank["collectives"][2]["bytes"] == 8_196_000 and rank["collectives"][2]["step"] == 4
    assert [s["step"] for s in rank["steps"]] == [4, 5, 6] and set(rank["phases"]) == {"forward", "backward", "update"}


def test_the_picture_and_its_absence(tmp_path, capsys, monkeypatch):
    shutil.copy(A100, tmp_path)
    code, out, _ = report_main(capsys, tmp_path)
    png = tmp_path / trace_report.PICTURE
    assert code == 0 and f"wrote {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    png.unlink()
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails as if matplotlib were missing
    code, out, err = report_main(capsys, tmp_path)
    assert code == 0 and "Verdict:" in out
    assert (
        err.strip() == "no trace.png: matplotlib is missing (pip install 'lit_ddp[plot]'); the text above is complete"
    )
    assert not png.exists()


def test_several_ranks_in_rank_order(tmp_path, capsys):
    for name in ("a_rank1.json", "b_rank0.json"):  # file names in the other order
        synthetic(tmp_path, name=name, info=False)
    code, out, _ = report_main(capsys, tmp_path, "--no-plot", "--json", tmp_path / "out.json")
    assert code == 0
    rows = [line.split()[0] for line in out.split("GPU time per rank")[1].splitlines()[2:4]]
    assert rows == ["0", "1"]
    assert [r["rank"] for r in json.loads((tmp_path / "out.json").read_text())["ranks"]] == [0, 1]
    code, _, err = report_main(capsys, tmp_path, "--no-plot", "--json", tmp_path / "out.json")
    assert code == 0, err  # its own JSON from the first run is not taken for a trace


def one_line(err: str) -> str:
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith(f"{trace_report.TRACE_REPORT_PROG}: ")
    return err


def test_nothing_to_analyse_is_one_line_and_exit_2(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    code, out, err = report_main(capsys, empty)
    assert (code, out) == (2, "") and "empty: no trace files in it" in one_line(err)
    code, out, err = report_main(capsys, tmp_path / "missing")
    assert (code, out) == (2, "") and "missing: no such file or directory" in one_line(err)

    not_trace = tmp_path / "not_trace"
    not_trace.mkdir()
    (not_trace / "phases.json").write_text('{"ms": []}')
    code, out, err = report_main(capsys, not_trace)
    assert (code, out) == (2, "") and "phases.json: not a trace file (JSON without 'traceEvents')" in one_line(err)

    twice = tmp_path / "twice"
    twice.mkdir()
    synthetic(twice, name="a.json")
    synthetic(twice, name="b.json")  # distributedInfo: rank 3 in both
    code, out, err = report_main(capsys, twice)
    assert (code, out) == (2, "") and "rank 3 has 2 traces (a.json, b.json): keep one file per rank" in one_line(err)


def test_a_cpu_only_trace_says_so_and_shows_no_zeros(tmp_path, capsys):
    synthetic(tmp_path, name="rank0.json")
    cpu = tmp_path / "rank1.json"
    cpu.write_text(json.dumps({"traceEvents": [event("cpu_op", "aten::mm", 0, 5)], "distributedInfo": {"rank": 1}}))
    code, out, err = report_main(capsys, tmp_path)
    assert (code, out) == (2, "")
    assert "no GPU events (kernels, memcpy, memset) in 1 of 2 trace(s), CPU-only profiles: rank 1 rank1.json" in (
        one_line(err))  # fmt: skip


@pytest.mark.timeout(150)
def test_lightning_pytorch_profiler_traces_of_a_real_2_rank_run(pytorch_profiler_run, capsys):
    """Lightning's PyTorchProfiler writes one ``fit-<rank>-...pt.trace.json`` per rank somewhere under the run
    directory; on CPUs they hold no GPU events, and the report finds both and says so."""
    done, cwd = pytorch_profiler_run
    assert done.returncode == 0, done.stderr[-3000:]
    traces = sorted(p.name for p in (cwd / "runs").rglob("*.pt.trace.json"))
    assert [name[:6] for name in traces] == ["fit-0-", "fit-1-"]
    code, out, err = report_main(capsys, cwd / "runs")
    assert (code, out) == (2, "")
    assert f"no GPU events (kernels, memcpy, memset) in 2 of 2 trace(s), CPU-only profiles: rank 0 {traces[0]}, " \
           f"rank 1 {traces[1]}" in one_line(err)  # fmt: skip


def breakdown(span: float, compute: float, comm: float, overlap: float, host: float, kernel: float,
              other: float) -> Breakdown:  # fmt: skip
    idle = host + kernel + other
    return Breakdown(span, span - idle, idle, compute, span - idle - compute, comm, overlap, None, host, kernel, other)


def ranks_of(figures: tuple, steps: int = 8, jitter: float = 1.0) -> list[RankAnalysis]:
    """Two ranks whose every counted step has ``figures`` (``breakdown``'s), each part with seeded noise of
    ``jitter`` us; the totals their sum."""
    rng = random.Random(0)
    ranks = []
    for r in (0, 1):
        per_step = [breakdown(*(f + rng.gauss(0, jitter) if f else 0.0 for f in figures)) for _ in range(steps)]
        steps_of = tuple(StepAnalysis(s, True, b, {}, None) for s, b in enumerate(per_step))
        ranks.append(RankAnalysis(Path(f"rank{r}.json"), r, 2, combine(per_step), {}, steps_of, ()))
    return ranks


@pytest.mark.parametrize(
    "figures, says",
    [
        ((100, 20, 5, 5, 70, 5, 0), "Verdict: host-bound: the GPUs were idle 75% of their span (host wait 9"),
        ((100, 80, 10, 10, 5, 5, 0), "Verdict: GPU-bound: compute kernels ran 80%"),
        ((100, 30, 60, 10, 5, 5, 0), "Verdict: communication-bound: 50% of the span only communication ran"),
        ((100, 20, 5, 5, 10, 0, 60), "Verdict: stalled: the GPUs were idle 70% of their span with work queued"),
    ],
)
def test_the_verdict_names_what_bounds_the_gpus_beyond_the_noise(figures, says):
    ranks = ranks_of(figures)
    assert trace_tables.trace_verdict(ranks).startswith(says), trace_tables.trace_verdict(ranks)
    assert trace_tables.trace_verdict(ranks) == trace_tables.trace_verdict(ranks_of(figures))  # seeded


def test_two_level_parts_or_a_short_profile_can_t_tell_and_say_why():
    level = ranks_of((100, 45, 0, 0, 45, 10, 0), jitter=5.0)  # compute and idle both 45 us per step
    said = trace_tables.trace_verdict(level)
    assert said.startswith("Verdict: can't tell what bounds the GPUs, because "), said
    assert "within the noise" in said or "above 10% of the span" in said, said
    short = trace_tables.trace_verdict(ranks_of((100, 80, 10, 10, 5, 5, 0), steps=3))
    assert short.startswith("Verdict: can't tell what bounds the GPUs: the profile holds 3 counted step(s)"), short


def test_the_real_a100_profile_of_two_counted_steps_can_t_tell_and_says_how_to_profile():
    said = trace_tables.trace_verdict([analyze_rank(load(A100))])
    assert said.startswith("Verdict: can't tell what bounds the GPUs: the profile holds 2 counted step(s)"), said
    assert "idle time 77%, compute 18%" in said and "torch.profiler.schedule(active=5)" in said, said


def test_the_a100_traces_tables_and_json_hold_every_figure_where_it_belongs():
    """The report's whole text and its JSON for the real A100 trace, character for character (golden files in
    tests/golden; tests/test_trace.py holds their figures against HTA's): the rank, phase and collective tables, the
    exposed communication, the verdict."""
    analyses, golden = [analyze_rank(load(A100))], A100.parents[1] / "golden"
    assert trace_tables.trace_report(analyses) + "\n" == (golden / "a100_trace_report.txt").read_text()
    written = trace_tables.to_json(analyses)
    for rank in written["ranks"]:
        rank["file"] = Path(rank["file"]).name  # the checkout's own path
    assert written == json.loads((golden / "a100_trace_report.json").read_text())
