"""Every rank on one timeline (``lit_ddp.present.timeline``): the Trace Event file written from a real 4-rank run with
a slow rank, checked against the format and against the record it was drawn from, and read for the straggler."""

import json
import shutil
import socket
import statistics
from collections import defaultdict

import pytest

import lit_ddp
from lit_ddp import report
from lit_ddp.present import timeline
from lit_ddp.records import phases as step_phases
from lit_ddp.records.schema import load_run
from lit_ddp.records.steps import is_steady
from tests.conftest import SLOW_MS, SLOW_RANK
from tests.runner import PROFILE_RUN, ROOT, run_fit, run_module

# Who waits for whom, by how much: alone on the machine (tests/conftest.py), another worker's run would be the
# straggler.
pytestmark = pytest.mark.timing

US = 1.0  # "to the microsecond": a slice's duration against the record's figure


@pytest.fixture(scope="module")
def drawn(straggler_run, tmp_path_factory):
    """The run's record and its timeline, written by the command a user types."""
    assert straggler_run.result.returncode == 0, straggler_run.result.stderr[-3000:]
    run_dir = straggler_run.cwd / "runs" / "mini_train_profile" / "version_0"
    out = tmp_path_factory.mktemp("timeline") / "run.json"
    result = run_module("lit_ddp.report", str(run_dir), "--timeline", str(out), cwd=straggler_run.cwd)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"wrote {out} ("), result.stdout
    phases, comm = load_run(run_dir)
    return run_dir, phases, comm, json.loads(out.read_text())


def slices(content, cat=None, pid=None) -> list[dict]:
    return [e for e in content["traceEvents"] if e["ph"] == "X" and (cat is None or e.get("cat") == cat)
            and (pid is None or e["pid"] == pid)]  # fmt: skip


def test_the_end_of_fit_points_at_the_timeline(straggler_run):
    command = "python -m lit_ddp.report runs/mini_train_profile/version_0"
    line = f"timeline: {command} --timeline run.json, open in Perfetto's UI"
    assert line in straggler_run.result.stdout.splitlines()


def test_the_file_is_trace_event_format_and_every_tracks_slices_nest(drawn):
    _, phases, _, content = drawn
    assert set(content) == {"traceEvents", "displayTimeUnit", "otherData"}
    assert content["otherData"]["aligned_by"] == "comm.json's clock_offset_s"
    tracks = defaultdict(list)
    for event in content["traceEvents"]:
        assert event["ph"] in ("X", "i", "M"), event
        assert isinstance(event["pid"], int) and isinstance(event["name"], str), event
        if event["ph"] == "M":
            assert event["name"] in ("process_name", "process_sort_index", "thread_name", "thread_sort_index")
            assert set(event["args"]) <= {"name", "sort_index"}, event
            continue
        assert isinstance(event["tid"], int) and isinstance(event["ts"], (int, float)) and event["ts"] >= 0, event
        if event["ph"] == "i":
            assert event["s"] == "t", event
        else:
            assert isinstance(event["dur"], (int, float)) and event["dur"] >= 0, event
            tracks[event["pid"], event["tid"]].append(event)
    for track, events in tracks.items():  # a slice that starts inside another ends inside it: viewers need that
        open_ends: list[float] = []
        for event in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
            while open_ends and open_ends[-1] <= event["ts"]:
                open_ends.pop()
            assert not open_ends or event["ts"] + event["dur"] <= open_ends[-1], (track, event)
            open_ends.append(event["ts"] + event["dur"])
    names = {e["pid"]: e["args"]["name"] for e in content["traceEvents"] if e["name"] == "process_name"}
    host = socket.gethostname()
    assert names == {r: f"rank {r} (node 0, {host}, cpu)" for r in range(4)}
    assert len(phases.ranks) == 4


def test_each_phase_slice_is_the_records_phase_to_the_microsecond_and_each_buckets_bytes_exact(drawn):
    _, phases, comm, content = drawn
    found = defaultdict(float)
    steps = {}
    for event in slices(content, "phase"):
        found[event["pid"], event["args"]["step"], event["name"]] += event["dur"]
    for event in slices(content, "step"):
        steps[event["pid"], event["args"]["step"]] = event
    checked = 0
    for rank in phases.ranks:
        for row in rank.rows:
            for phase in step_phases.names():  # "other": the gaps between the phases, summed
                assert found[rank.rank, row.step, phase] == pytest.approx(getattr(row.ms, phase) * 1e3, abs=US)
                checked += 1
            step = steps[rank.rank, row.step]
            assert step["args"]["step_ms"] == pytest.approx(row.ms.step, abs=1e-6)
            assert step["ts"] == pytest.approx((row.start_s - comm.clock_offset_s[rank.rank]
                                                - content["otherData"]["t0_s"]) * 1e6, abs=US)  # fmt: skip
    assert checked == 4 * 16 * 5
    buckets = {(e["pid"], e["args"]["step"], e["args"]["bucket"]): e for e in slices(content, "comm")
               if e["name"].startswith("all-reduce bucket")}  # fmt: skip
    for rank in comm.ranks:
        for row in rank.rows:
            for i, nbytes in enumerate(row.bytes):
                bucket = buckets[rank.rank, row.step, i]
                assert bucket["args"]["bytes"] == nbytes  # exact: an int from the record
                assert bucket["dur"] == pytest.approx(row.ms[i] * 1e3, abs=US)  # gloo: from the hand-over


def test_the_slow_ranks_phase_and_the_others_waits_in_the_same_steps(drawn):
    """Rank 2 sleeps 25 ms inside its backward: in each steady step its hand-over comes at least that long after its
    backward's start, it waits for nobody, and the others wait for it: their wait slices end at its hand-over."""
    _, phases, _, content = drawn
    steady = [s for s in range(16) if is_steady(s, phases.profiled_steps, phases.first_step)]
    backward = {(e["pid"], e["args"]["step"]): e for e in slices(content, "phase") if e["name"] == "backward"}
    handover = {(e["pid"], e["args"]["step"]): e for e in slices(content, "comm") if e["name"] == "all-reduce bucket 0"}
    waits = {(e["pid"], e["args"]["step"]): e for e in slices(content, "comm") if e["name"] == "wait"}
    last = 0
    for step in steady:
        slow = handover[SLOW_RANK, step]
        assert slow["ts"] - backward[SLOW_RANK, step]["ts"] >= SLOW_MS * 1e3, step  # the sleep is in the slice
        if (SLOW_RANK, step) in waits:  # another rank was later still (the machine's noise): rank 2 waited
            continue
        last += 1
        for rank in set(range(4)) - {SLOW_RANK}:
            wait = waits[rank, step]
            assert wait["ts"] + wait["dur"] == pytest.approx(slow["ts"], abs=US), (rank, step)
    assert last >= 0.75 * len(steady), (last, steady)  # the straggler's bar: last at 75% of all-reduces
    for rank in set(range(4)) - {SLOW_RANK}:
        waited = statistics.median(waits[rank, s]["dur"] if (rank, s) in waits else 0.0 for s in steady)
        assert waited >= 0.8 * SLOW_MS * 1e3, (rank, waited)  # the delay, less 20% for the clocks
    late = [e for e in content["traceEvents"] if e["ph"] == "i" and e["name"].startswith("late: ")]
    assert {e["pid"] for e in late} == {SLOW_RANK} and len(late) >= 0.75 * len(steady)


def test_markers_and_the_profiled_steps_kernels_on_the_same_clock(drawn):
    _, phases, _, content = drawn
    marks = {(e["pid"], e["name"]) for e in content["traceEvents"] if e["ph"] == "i"}
    assert phases.profiled_steps == [2, 3, 4]
    for rank in range(4):
        assert (rank, "warm-up: step 0") in marks
        assert {(rank, f"profiled: step {s}") for s in (2, 3, 4)} <= marks
    # PhaseTimer's own ranges in each rank's trace, moved onto the timeline, fall on the record's phases.
    forward = {(e["pid"], e["args"]["step"]): e for e in slices(content, "phase") if e["name"] == "forward"}
    for rank in range(4):
        ranges = [e for e in slices(content, pid=rank) if e["tid"] >= timeline.PROFILER_TRACKS]
        assert ranges, rank
        own = [e for e in ranges if e["name"] == "lit_ddp.forward"]
        assert len(own) == 3, own
        apart = [event["ts"] - forward[rank, step]["ts"]
                 for event, step in zip(sorted(own, key=lambda e: e["ts"]), (2, 3, 4), strict=True)]  # fmt: skip
        # Within 0.5 ms at the median, and 10 ms each (a range and the record's mark are two reads of the clock,
        # and a loaded CI machine once put 3.2 ms between them in one step, on torch 2.11; clocks left apart would
        # be seconds off)
        assert abs(statistics.median(apart)) <= 500.0 and max(map(abs, apart)) < 10_000.0, apart


def test_the_collectives_of_the_record_each_with_its_op_size_and_sequence_number(drawn):
    """Flight Recorder's collectives of the kept steps, in the record and on each rank's collectives track: every
    step's bucket all-reduce, of the bucket's bytes, numbered alike on every rank, called inside the bucket's
    all-reduce slice (from its hand-over, less 1 ms for the two clocks, to its end)."""
    _, phases, comm, content = drawn
    calls = [e for e in content["traceEvents"] if e.get("cat") == "collective"]
    assert len(calls) == sum(len(rank.collectives) for rank in phases.ranks) > 0
    handover = {(e["pid"], e["args"]["step"]): e for e in slices(content, "comm") if e["name"] == "all-reduce bucket 0"}
    seqs = defaultdict(set)
    for rank in phases.ranks:
        buckets = [c for c in rank.collectives if c.bucket is not None]
        assert sorted(c.step for c in buckets) == list(range(16)), rank.rank
        for c in buckets:
            assert (c.op, c.phase, c.dtype) == ("all_reduce", "backward", "Float")
            assert c.sizes[0][0] * 4 == comm.layout[c.bucket]  # fp32 gradients: the bucket's bytes
            seqs[c.step].add(c.seq)
            call = next(e for e in calls if e["pid"] == rank.rank and e["args"]["seq"] == c.seq)
            assert call["name"] == f"all_reduce #{c.seq}" and call["args"]["bucket"] == 0
            bucket = handover[rank.rank, c.step]  # called after the hook took the hand-over, before the end
            assert bucket["ts"] - 1e3 <= call["ts"] <= bucket["ts"] + bucket["dur"], (rank.rank, c.step)
    assert all(len(seq) == 1 for seq in seqs.values()), seqs  # one call, one number, on every rank


def test_steps_pick_a_part_and_bad_input_is_one_line(drawn, tmp_path, capsys):
    run_dir = drawn[0]
    path = lit_ddp.write_timeline(run_dir, tmp_path / "part.json", steps=(5, 8))
    part = json.loads(path.read_text())
    assert {e["args"]["step"] for e in slices(part, "step")} == {5, 6, 7, 8}
    assert not [e for e in slices(part) if e["tid"] >= timeline.PROFILER_TRACKS]  # the profiled steps are 2-4
    for argv, message in (
        ([str(run_dir), "--timeline", str(tmp_path / "x.json"), "--timeline-steps", "8-5"],
         "--timeline-steps '8-5': the first step must be >= 0 and <= the last"),
        ([str(run_dir), "--timeline", str(tmp_path / "x.json"), "--timeline-steps", "100-200"],
         "no kept step in 100-200: the record keeps steps 0-15"),
        ([str(run_dir), "--timeline-steps", "1-2"], "--timeline-steps goes with --timeline FILE.json"),
        ([str(ROOT / "tests" / "data" / "two_nodes_100mbit"), "--timeline", str(tmp_path / "x.json")],
         "this record has no step start times (written before schema 4)"),
    ):  # fmt: skip
        with pytest.raises(SystemExit) as exited:
            report.main(argv)
        err = capsys.readouterr().err
        assert exited.value.code == 2 and err.startswith(f"python -m lit_ddp.report: error: {message}"), err
        assert err.count("\n") == 1, err
    assert not (tmp_path / "x.json").exists()


def test_the_size_benchmark_gives_the_record_to_more_ranks(drawn, tmp_path):
    """``benchmarks/timeline_size.py``'s simulation, on this run: every simulated rank is a process of the file."""
    from benchmarks.timeline_size import simulate

    found = simulate(drawn[0], 8, tmp_path)
    content = json.loads((tmp_path / "timeline8.json").read_text())
    assert found["size"] == (tmp_path / "timeline8.json").stat().st_size
    assert len([e for e in content["traceEvents"] if e["name"] == "process_name"]) == 8
    assert (found["steps"], found["buckets"]) == (16, 1) and found["traces_per_rank"] > 0


@pytest.mark.slow
def test_a_sigterm_is_in_the_record_and_marked_where_every_rank_stopped(tmp_path):
    """Rank 1 alone gets SIGTERM at step 6 (tests.test_faults.SigtermOnRank): every rank stops after the same step,
    the record says why, and the timeline marks that step's end on every rank."""
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    result = run_fit(*PROFILE_RUN[:2], "--devices", "2", "--model.dim", "64", "--trainer.max_steps", "40",
                     "--loss_monitor.every_n_steps", "0", "--trainer.callbacks+=tests.test_faults.SigtermOnRank",
                     "--trainer.callbacks.step=6", cwd=tmp_path, timeout=120)  # fmt: skip
    assert result.returncode == 143, result.stderr[-2000:]
    run_dir = tmp_path / "runs" / "mini_train_profile" / "version_0"
    phases, _ = load_run(run_dir)
    assert phases.ended_by == "SIGTERM"
    last = phases.steps[-1]
    assert 6 <= last < 39
    content = json.loads(lit_ddp.write_timeline(run_dir, tmp_path / "run.json").read_text())
    marked = [e for e in content["traceEvents"] if e["ph"] == "i" and e["name"].startswith("SIGTERM")]
    assert sorted((e["pid"], e["name"]) for e in marked) == [(r, f"SIGTERM: stopped after step {last}") for r in (0, 1)]
