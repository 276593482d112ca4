"""``python -m lit_ddp.trace_report DIR``: tables, verdict, picture and ``--json`` from per-rank traces; one line
and exit 2 for nothing to analyse, Lightning PyTorchProfiler's CPU traces of a real 2-rank run included."""

import json
import random
import shutil
import sys
from pathlib import Path
from typing import Optional

import pytest

from lit_ddp import report
from lit_ddp.derive.trace import (
    GRADIENT,
    Breakdown,
    Collective,
    RankAnalysis,
    StepAnalysis,
    analyze_rank,
    combine,
    load,
)
from lit_ddp.present import trace_tables
from lit_ddp.present import traces as trace_command
from tests.runner import run_module
from tests.test_trace import A100, event, gpu, synthetic

pytestmark = pytest.mark.timeout(60)

RANK_KEYS = {"rank", "span_us", "idle_us", "compute_us", "non_compute_us", "comm_comp_overlap_pct"}
COLLECTIVE_KEYS = {"step", "name", "bytes", "duration_us", "algbw_gbps", "busbw_gbps", "kind"}


def report_main(capsys, *args: str) -> tuple[int, str, str]:
    code = report.trace_alias([str(a) for a in args])
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
    assert not (traces / trace_command.PICTURE).exists()
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
    png = tmp_path / trace_command.PICTURE
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
    assert err.startswith("python -m lit_ddp.trace_report: ")
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


def test_fmt_us_writes_microseconds_below_1000_and_milliseconds_from_1000_on():
    assert [trace_tables.fmt_us(us) for us in (999.9, 999.96, 1000.0, 1000.5, 250.0)] == [
        "999.9 us", "1.00 ms", "1.00 ms", "1.00 ms", "250.0 us"]  # fmt: skip


def test_a_trace_of_zero_length_work_shows_no_share_rather_than_dividing_by_zero(tmp_path):
    """One memset of no duration: a span of 0, no step; every share of it is '-'."""
    path = tmp_path / "rank0.json"
    path.write_text(json.dumps({"traceEvents": gpu("memset", 100, 0, 90, cat="gpu_memset"),
                                "distributedInfo": {"rank": 0, "world_size": 1}}))  # fmt: skip
    assert trace_tables.trace_report([analyze_rank(load(path))]).splitlines() == [
        ("GPU time per rank (union over every stream; overlap = share of communication under compute; idle split by "
         "what ended each gap):"),
        ("rank  steps     span     busy  compute  communication  overlap"
         "         idle  host wait  kernel wait  other wait"),
        ("0         -  0.00 ms  0.00 ms  0.00 ms        0.00 ms        -"
         "  0.00 ms (-)    0.00 ms      0.00 ms     0.00 ms"),
        ("Verdict: can't tell what bounds the GPUs: the profile holds 0 counted step(s) on every rank, fewer than the "
         "5 the noise model needs to tell one part's lead from the steps' noise (over them: idle time -, compute -, "
         "communication no compute hid - of the span); profile 5 or more steps (torch.profiler.schedule(active=5) or "
         "more)"),
    ]  # fmt: skip


def counted(step: int, b: Breakdown, exposed_us: Optional[float] = None) -> StepAnalysis:
    return StepAnalysis(step, True, b, {}, exposed_us)


def test_hand_made_ranks_tables_print_every_cell_and_the_first_ranks_phases_only():
    """Three ranks of a 3-rank job (no "of 3 ranks found" line), every step counted (no "left out" note): rank 0
    counted steps 0-2, rank 1 step 1 only, rank 2 none ("-"); a step of 2 ms with 0.3 ms of compute and 1.2 ms of
    communication, 0.1 ms of it under compute; a collective without a step, a size or a bandwidth; and the shares
    in the verdict by size (communication no compute hid 55%, idle 25%, compute 15%), not by name."""
    step = combine([breakdown(2000, 300, 1200, 100, 300, 100, 100)])
    forward = breakdown(800, 300, 0, 0, 400, 100, 0)
    collectives = (Collective(1, "all_reduce", 4_000_000, 1500.0, 2.67, 2.67, GRADIENT, 3, "backward", 0, 100.0),
                   Collective(None, "broadcast", None, 1000.0, None, None, "other", None, None, None, 0.0))  # fmt: skip
    ranks = [
        RankAnalysis(Path("rank0.json"), 0, 3, combine([step] * 3), {"forward": combine([forward] * 3)},
                     (counted(0, step), counted(1, step, 250.0), counted(2, step)), collectives),
        RankAnalysis(Path("rank1.json"), 1, 3, step, {"forward": forward}, (counted(1, step),), ()),
        RankAnalysis(Path("rank2.json"), 2, 3, step, {}, (), ()),
    ]  # fmt: skip
    assert trace_tables.trace_report(ranks).splitlines() == [
        ("GPU time per rank (union over every stream; overlap = share of communication under compute; idle split by "
         "what ended each gap):"),
        ("rank  steps     span     busy  compute  communication  overlap"
         "             idle  host wait  kernel wait  other wait"),
        ("0       0-2  6.00 ms  4.50 ms  0.90 ms        3.60 ms     8.3%"
         "  1.50 ms (25.0%)    0.90 ms      0.30 ms     0.30 ms"),
        ("1         1  2.00 ms  1.50 ms  0.30 ms        1.20 ms     8.3%"
         "  0.50 ms (25.0%)    0.30 ms      0.10 ms     0.10 ms"),
        ("2         -  2.00 ms  1.50 ms  0.30 ms        1.20 ms     8.3%"
         "  0.50 ms (25.0%)    0.30 ms      0.10 ms     0.10 ms"),
        "",
        "Per phase, rank 0 (the GPU ops each phase's CPU range queued, steps 0-2):",
        ("phase       span     busy  compute  communication  overlap"
         "             idle  host wait  kernel wait  other wait"),
        ("forward  2.40 ms  0.90 ms  0.90 ms        0.00 ms        -"
         "  1.50 ms (62.5%)    1.20 ms      0.30 ms     0.00 ms"),
        "",
        "Collectives of rank 0 (2 NCCL kernels; busbw by nccl-tests' factors for the group size):",
        "step  collective                 kind      bytes     time      algbw      busbw",
        "1     all_reduce  gradient all-reduce  4,000,000  1.50 ms  2.67 GB/s  2.67 GB/s",
        "-      broadcast                other          ?  1.00 ms          -          -",
        "Exposed communication (gradient all-reduce time after backward's last compute kernel): step 1 250.0 us",
        ("Verdict: can't tell what bounds the GPUs: the profile holds 0 counted step(s) on every rank, fewer than the "
         "5 the noise model needs to tell one part's lead from the steps' noise (over them: communication no compute "
         "hid 55%, idle time 25%, compute 15% of the span); profile 5 or more steps (torch.profiler.schedule(active=5) "
         "or more)"),
    ]  # fmt: skip


def identical_ranks(per_step: list[Breakdown]) -> list[RankAnalysis]:
    """Two ranks of a 2-rank job whose counted steps are ``per_step``, all of them counted."""
    steps = tuple(counted(s, b) for s, b in enumerate(per_step))
    return [RankAnalysis(Path(f"rank{r}.json"), r, 2, combine(per_step), {}, steps, ()) for r in (0, 1)]


# Every verdict in full, on 5 identical steps (the fewest the noise model takes; the lead's interval is then the
# lead itself) of a 10 ms span, breakdown's figures in us: (span, compute, communication, overlap, host wait,
# kernel wait, other wait).
@pytest.mark.parametrize(
    "figures, says",
    [
        ((10000, 2000, 500, 500, 2000, 1750, 3750),  # other wait exactly host + kernel wait: not stalled
         "Verdict: host-bound: the GPUs were idle 75% of their span (host wait 26.7%, kernel wait 23.3% of it), 5.50 "
         "ms per step (5.50 ms to 5.50 ms, 95%, 5 steps) over compute, the next; larger batches per rank, fewer kernel "
         "launches (CUDA graphs, torch.compile, a fused optimizer) or less per-step Python would help"),
        ((10000, 2000, 500, 500, 1000, 1000, 5500),
         "Verdict: stalled: the GPUs were idle 75% of their span with work queued (other wait 73.3% of it), 5.50 ms "
         "per step (5.50 ms to 5.50 ms, 95%, 5 steps) over compute, the next: a slower rank or a host sync holds them "
         "back; compare the ranks' rows"),
        ((10000, 8000, 1000, 1000, 500, 500, 0),
         "Verdict: GPU-bound: compute kernels ran 80% of the GPUs' span, 7.00 ms per step (7.00 ms to 7.00 ms, 95%, 5 "
         "steps) over idle time, the next; lower precision (bf16), fewer FLOPs or faster kernels would help"),
        ((10000, 3000, 6000, 1000, 500, 500, 0),  # 5 ms of communication no compute hid, not the 6 ms it ran
         "Verdict: communication-bound: 50% of the span only communication ran, which no compute hid, 2.00 ms per step "
         "(2.00 ms to 2.00 ms, 95%, 5 steps) over compute, the next; what a bucket size or compression would change "
         "depends on the bytes and the link: python -m lit_ddp.tune measures it on the model"),
        ((10000, 500, 5000, 200, 4500, 0, 0),  # a lead of 0.3 ms, 3% of the span
         "Verdict: can't tell what bounds the GPUs, because communication no compute hid (4.80 ms per step) and idle "
         "time (4.50 ms), the largest, differ by 0.30 ms per step (0.30 ms to 0.30 ms, 95%, 5 steps): not beyond the "
         "noise above 10% of the span (communication no compute hid 48%, idle time 45%, compute 5% of the span); "
         "profile more steps, or python -m lit_ddp.tune measures what DDP's knobs change"),
    ],
)  # fmt: skip
def test_every_verdict_in_full_at_the_fewest_counted_steps_the_noise_model_takes(figures, says):
    assert trace_tables.trace_verdict(identical_ranks([breakdown(*figures)] * 5)) == says


def test_a_lead_of_a_fraction_of_a_microsecond_is_within_the_noise():
    """Idle time 0.3 us above compute's 4.5 ms in one step, 0.2 us below in another: the lead's interval holds 0
    (and lies within 1 us of it)."""
    steps = [breakdown(10000, 4500, 0, 0, 4500 + d, 0, 0) for d in (0.3, -0.1, 0.1, 0.2, -0.2)]
    assert trace_tables.trace_verdict(identical_ranks(steps)) == (
        "Verdict: can't tell what bounds the GPUs, because idle time (4.50 ms per step) and compute (4.50 ms), the "
        "largest, differ by 0.00 ms per step (-0.00 ms to 0.00 ms, 95%, 5 steps): within the noise (idle time 45%, "
        "compute 45%, communication no compute hid 0% of the span); profile more steps, or python -m lit_ddp.tune "
        "measures what DDP's knobs change"
    )
