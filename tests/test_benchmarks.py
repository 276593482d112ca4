"""The benchmarks' bookkeeping, deterministically (hand-made marks and records, a mock trainer); one real run of
the bare Lightning loop. No timing is asserted: the benchmarks print measured tables, they are not tests."""

import gzip
import json
import math
import os
import subprocess
import sys
from itertools import count
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks import clean_exit, common, gpu_busy, gpu_events, gpu_fits, gpu_scaling, gpu_syncs, step_time
from lit_ddp.maths.intervals import union_length
from lit_ddp.records.schema import PhaseRecord, RankPhases, RunMeta, StepPhases, StepRow
from tests.runner import ROOT, pythonpath


def test_children_find_the_repository_first_and_keep_the_inherited_pythonpath():
    env = common.child_env({"PYTHONPATH": "/tmp/site", "HOME": "/h"}, OMP_NUM_THREADS="1")
    assert env["PYTHONPATH"].split(os.pathsep) == [str(ROOT), "/tmp/site"]
    assert env["HOME"] == "/h" and env["OMP_NUM_THREADS"] == "1"
    assert common.child_env({})["PYTHONPATH"] == str(ROOT)  # no empty entry (which would mean the cwd)


def test_steady_step_ms_is_the_median_over_ranks_and_steps_after_the_warmup():
    starts = [[0.0, 1.0, 1.010, 1.020, 1.030], [0.0, 2.0, 2.030, 2.060, 2.090]]  # s; step 0 is slow
    assert common.steady_step_ms(starts, warmup=1) == pytest.approx(20.0)  # median of 10,10,10,30,30,30 ms
    assert common.steady_step_ms(starts, warmup=0) == pytest.approx(30.0)
    assert math.isnan(common.steady_step_ms([[0.0, 1.0]], warmup=1))  # a 1-step run has no steady step


def test_rank_files_are_read_in_rank_order(tmp_path):
    for rank in (10, 2, 0):
        (tmp_path / f"rank{rank}.json").write_text(json.dumps({"step_starts": [rank], "max_rss_mb": 1.0}))
    assert [r["step_starts"] for r in common.read_rank_files(tmp_path)] == [[0], [2], [10]]
    with pytest.raises(RuntimeError, match="no rank\\*.json in"):
        common.read_rank_files(tmp_path / "empty")


def test_step_clock_marks_every_step_start_and_the_end(tmp_path):
    clock = common.StepClock(str(tmp_path))
    trainer = SimpleNamespace(global_rank=1, strategy=SimpleNamespace(root_device=torch.device("cpu")))
    with mock.patch.object(common.time, "time", side_effect=count(100.0)):
        for step in range(3):
            clock.on_train_batch_start(trainer, None, None, step)
        clock.on_train_end(trainer, None)
    written = json.loads((tmp_path / "rank1.json").read_text())
    assert written["step_starts"] == [100.0, 101.0, 102.0, 103.0]
    assert written["max_rss_mb"] > 0
    assert common.clock_args(tmp_path)[-2:] == [f"--trainer.callbacks+={common.STEP_CLOCK}",
                                                f"--trainer.callbacks.out_dir={tmp_path}"]  # fmt: skip
    assert common.STEP_CLOCK == "benchmarks.common.StepClock"


def test_formatters_print_a_dash_for_what_was_not_measured():
    assert [common.fmt_num(1.23456), common.fmt_num(2.5, 1), common.fmt_num(math.nan)] == ["1.235", "2.5", "-"]
    assert [common.fmt_pct(0.042), common.fmt_pct(-0.1), common.fmt_share(0.871)] == ["+4.2%", "-10.0%", "87%"]
    assert math.isnan(common.ratio(1.0, 0.0)) and math.isnan(common.ratio(math.nan, 1.0))
    assert math.isnan(common.median([]))


def test_variants_run_interleaved_and_each_is_the_median_of_its_runs(monkeypatch):
    order = []
    step_s = {"a": iter([0.010, 0.030, 0.020]), "b": iter([0.005, 0.005, 0.005])}

    def fake_run(cmd, out_dir):
        order.append(cmd[0])
        dt = next(step_s[cmd[0]])
        return step_time.Run([[0.0, dt, 2 * dt]], first_s=1.0, wall_s=2.0 + dt, rss_mb=len(order))

    monkeypatch.setattr(step_time, "run", fake_run)
    results = step_time.measure_interleaved({"a": lambda tmp: ["a"], "b": lambda tmp: ["b"]}, repeats=3, warmup=0)
    assert order == ["a", "b", "a", "b", "a", "b"]
    assert results["a"].step_ms == pytest.approx(20.0)
    assert (results["a"].low_ms, results["a"].high_ms) == pytest.approx((10.0, 30.0))
    assert results["a"].wall_s == pytest.approx(2.02) and results["a"].rss_mb == 5
    assert all(run == pytest.approx([ms, ms]) for run, ms in zip(results["a"].samples, (10.0, 30.0, 20.0), strict=True))
    assert results["b"].walls == pytest.approx([2.005] * 3)


def test_step_samples_are_each_steps_mean_over_ranks_in_time_order():
    starts = [[0.0, 0.010, 0.030, 0.040], [0.0, 0.012, 0.030, 0.046]]  # seconds, two ranks
    assert common.step_samples_ms(starts, 1) == pytest.approx([19.0, 13.0])


def runs_of(ms: float, spread: float, runs: int = 5) -> step_time.Measured:
    """Runs of 20 steps each, whose medians differ by ``spread`` (a fraction) about ``ms``."""
    run_ms = [ms * (1 + spread * (i - (runs - 1) / 2)) for i in range(runs)]
    samples = [[m * (1 + 0.001 * (j % 3)) for j in range(20)] for m in run_ms]
    return step_time.Measured(ms, min(run_ms), max(run_ms), 1.0, 2.0, 100.0, samples, [2.0] * runs)


@pytest.mark.parametrize(("other_ms", "spread", "word"), [(2.06, 0.001, "MISSED"), (2.02, 0.001, "met"),
                                                         (2.06, 0.05, "can't tell at this noise")])  # fmt: skip
def test_a_target_is_met_or_missed_only_beyond_the_runs_noise(other_ms, spread, word):
    """The ratio's interval is the noise model's on the runs (``noise.runs_difference_interval`` on log times):
    steady runs 3% apart miss a 1.02x target, 1% apart meet it; runs 5% apart among themselves cannot tell the
    same 3%."""
    ratio = step_time.ratio_interval(runs_of(2.0, spread), runs_of(other_ms, spread))
    assert ratio.estimate == pytest.approx(other_ms / 2.0, rel=1e-3)
    assert ratio.low <= ratio.estimate <= ratio.high
    assert step_time.verdict(ratio, 1.02).endswith(f"target <= 1.02x: {word})")


def test_each_row_is_divided_by_the_baselines_of_the_same_invocation():
    m = {name: step_time.Measured(ms, ms, ms, 1.0, 3.0, 100.0, [], [])
         for name, ms in ((step_time.PLAIN, 2.0), (step_time.LIGHTNING, 3.0), (step_time.DEFAULT, 4.5))}  # fmt: skip
    rows = step_time.block_rows(64, m, (step_time.PLAIN, step_time.LIGHTNING))
    assert rows[2][0] == f"{step_time.DEFAULT}, dim 64"
    assert rows[2][3:5] == ("2.25", "1.50")  # x plain loop, x bare Lightning
    assert [len(row) for row in rows] == [len(step_time.HEADER) + 1] * 3


@pytest.mark.parametrize(("default_ms", "exit_code"), [(2.19, 0), (2.21, 1)])
def test_check_fails_when_the_default_config_is_over_its_limit_against_bare_lightning(monkeypatch, default_ms,
                                                                                     exit_code):  # fmt: skip
    """``--check``: the default config against bare Lightning (2 ms here) at dim 64; over 1.10x exits 1."""
    ms = {step_time.LIGHTNING: 2.0, step_time.DEFAULT: default_ms}
    measured = {}

    def fake_measure(cmds, repeats, warmup):
        measured.update(cmds)
        return {name: runs_of(ms[name], 0.001) for name in cmds}

    monkeypatch.setattr(step_time, "measure_interleaved", fake_measure)
    assert step_time.check(step_time.parse_args(["--check"])) == exit_code
    assert set(measured) == {step_time.LIGHTNING, step_time.DEFAULT}


def test_step_time_refuses_runs_with_no_steady_step():
    with pytest.raises(SystemExit):
        step_time.parse_args(["--host-steps", "4", "--warmup", "3"])


def test_port_commands_put_a_config_first_and_the_clock_last(tmp_path):
    cmd = step_time.port_cmd(2, 64, 10, "--config", "fast.yaml")(tmp_path)
    assert cmd[1:5] == ["-m", "lit_ddp.fit", "--config", "fast.yaml"]
    assert cmd[-1] == f"--trainer.callbacks.out_dir={tmp_path}"


def _record(rows: list[StepRow], busy: list[StepRow], profiled: list[int]) -> PhaseRecord:
    meta = RunMeta(1, "cuda", "a GPU", "nccl", "cuda_event", "32-true", "2", "2")
    return PhaseRecord(meta, [RankPhases(0, rows, {}, busy)], profiled)


def _row(step: int, forward: float, backward: float = 2.0, update: float = 3.0) -> StepRow:
    ms = StepPhases(
        forward=forward, backward=backward, update=update, other=0.5, step=forward + backward + update + 0.5
    )
    return StepRow(step, ms, {})


def test_the_gpu_sections_read_the_record_by_field():
    busy = [_row(2, 0.1), _row(3, 0.3), _row(6, 0.2)]
    record = _record([_row(s, float(s)) for s in range(9)], busy, profiled=[2, 3, 6])
    total, steps = gpu_busy.timer_busy(record)
    assert steps == 3 and total == pytest.approx(sum(r.ms.step for r in busy))
    steady = gpu_events.event_rows(record, first=5)
    assert [r.step for r in steady] == [5, 7, 8]  # from step 5 on, the profiled ones left out
    assert gpu_events.phase_medians(steady) == [7.0, 2.0, 3.0]
    assert gpu_events.phase_medians(busy) == [pytest.approx(0.2), 2.0, 3.0]


def test_the_busy_section_reads_a_chrome_trace_through_lit_ddp_trace():
    raw = json.loads(gzip.decompress((ROOT / "tests" / "data" / "a100_nccl_2rank_rank0.json.gz").read_bytes()))
    ops = [(e["ts"], e["ts"] + e["dur"]) for e in raw["traceEvents"]
           if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e.get("ph") == "X"]  # fmt: skip
    assert gpu_busy.file_busy_ms(ROOT / "tests" / "data" / "a100_nccl_2rank_rank0.json.gz") == pytest.approx(
        union_length(ops) / 1e3
    )
    with profile(activities=[ProfilerActivity.CPU]) as cpu_only:  # exported, read back: no GPU op in it
        torch.ones(4) @ torch.ones(4)
    assert math.isnan(gpu_busy.trace_busy_ms(cpu_only))


def test_a_step_window_begins_counts_and_ends_once():
    calls = []

    class Recording(gpu_fits.StepWindow):
        def begin(self):
            calls.append("begin")

        def step_done(self):
            calls.append("step")

        def end(self):
            calls.append("end")

    window = Recording(first=2, steps=2)
    for step in range(6):
        window.on_train_batch_start(SimpleNamespace(global_step=step), None, None, step)
    window.on_train_end(None, None)
    assert calls == ["begin", "step", "step", "end"]
    with pytest.raises(ValueError, match=r"`Recording\(first=0, steps=0\)`"):
        Recording(first=0, steps=0)


def test_sync_verdicts():
    site = gpu_syncs.SyncSite("lit_ddp/callbacks/step_sync.py", 80, "flags.cpu()")
    other = gpu_syncs.SyncSite("lit_ddp/callbacks/phase_timer.py", 10, "x.item()")
    ok = gpu_syncs.sync_verdicts([[], []], [[site], [site]])
    assert ok[0].startswith("syncs: OK, 0 host syncs") and ok[1].startswith("counter: OK")
    missed = gpu_syncs.sync_verdicts([[other], [other]], [[other, site], [other, site]])
    assert missed[0].startswith("syncs: MISSED, 1 host syncs") and "phase_timer.py:10" in missed[0]
    assert gpu_syncs.sync_verdicts([[], []], [[], []])[1].startswith("counter: BROKEN")


def test_the_overhead_falls_under_the_limit_from_the_first_row_after_the_last_miss():
    rows = [gpu_scaling.ScalingRow(d, 32, 1.0, 1.0, p, 1.0) for d, p in ((1, 1.2), (2, 1.01), (3, 1.3), (4, 1.02))]
    assert gpu_scaling.under_limit_from(rows, lambda r: r.overhead).dim == 4
    assert gpu_scaling.under_limit_from(rows[:3], lambda r: r.overhead) is None


def test_the_synchronized_loop_runs_on_cpu():
    phases = gpu_events.synchronized_phases(steps=3, warmup=1, device=torch.device("cpu"))
    assert len(phases) == 3 and all(ms > 0 for ms in phases)


def test_the_bare_lightning_loop_imports_no_tool_code():
    code = "import sys, benchmarks.bare_lightning; print(sorted(m for m in sys.modules if m.startswith('lit_ddp')))"
    result = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": pythonpath()},
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.slow
def test_the_bare_lightning_loop_marks_every_step_on_every_rank(tmp_path):
    cmd = step_time.lightning_cmd(2, 8, 4)(tmp_path)
    result = subprocess.run(cmd, cwd=tmp_path, env=common.child_env(), capture_output=True, text=True, timeout=110)
    assert result.returncode == 0, result.stderr[-2000:]
    ranks = common.read_rank_files(tmp_path)
    assert len(ranks) == 2 and all(len(r["step_starts"]) == 5 for r in ranks)


def test_clean_exit_counts_non_zero_exits_and_aborts_that_leave_exit_0(capsys):
    # Four runs: clean; rank 1 of `ddp` aborted after rank 0 exited (the command's code stays 0); a rank died with
    # SIGABRT; a run that hung past the timeout.
    ends = [(0, ""), (0, "terminate called without an active exception"), (-6, "terminate called ..."), None]

    def run(*args, **kwargs):
        end = ends.pop(0)
        if end is None:
            raise subprocess.TimeoutExpired(args[0], kwargs["timeout"])
        return subprocess.CompletedProcess(args[0], end[0], "", end[1])

    with mock.patch.object(clean_exit.subprocess, "run", side_effect=run):
        row = clean_exit.run_case("manual", runs=4, timeout=1.0)
    assert row[:5] == ("manual", "4", "2", "-6: 1, timeout: 1", "2")
    assert capsys.readouterr().err.count("manual: exit") == 3  # each unclean run's stderr is shown


def test_a_target_without_an_interval_says_so_and_judges_nothing():
    """Runs of fewer than ``noise.MIN_SAMPLES`` steps give no interval: no met or MISSED from a bare estimate."""
    few = step_time.Measured(2.0, 2.0, 2.0, 1.0, 2.0, 100.0, [[2.0, 2.0, 2.0]], [2.0])
    ratio = step_time.ratio_interval(few, few._replace(samples=[[3.0, 3.0, 3.0]]))
    assert step_time.verdict(ratio, 1.05) == (
        "1.50x over the runs (too few runs for an interval; target <= 1.05x: can't tell at this noise)"
    )
