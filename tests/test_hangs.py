"""Why it hung: each failing rank's report of its collectives, compared into one line that names the divergence
(``lit_ddp.analysis.divergence``, ``lit_ddp.run.hangs``); and the real cases, on 2 CPU ranks of a user's script
(``tests/hang_scripts.py``)."""

import json
import re
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch.distributed as dist

from lit_ddp import _torch
from lit_ddp.analysis.divergence import Collective, RankReport, divergences, first_cause, never_arrived
from lit_ddp.measure.collectives import MARKS_KEPT, REPORTED, CollectiveRecord, frame_of, user_frame
from lit_ddp.run import hangs, spawn_launcher
from tests.runner import start_module

LOG_LINE = "logkeys.py:21 training_step: self.log('rare_metric', loss, sync_dist=True)"


def grads(seq: int, step: int) -> Collective:
    return Collective(seq, "all_reduce", [[9]], "Float", step, "backward", bucket=0)


def test_a_collective_called_by_one_rank_only_is_named_with_its_line():
    rank0 = RankReport(0, 1.0, "timeout", collectives=[grads(7, 2), grads(9, 3)])
    rank1 = RankReport(
        1,
        1.0,
        "timeout",
        collectives=[grads(7, 2), Collective(9, "barrier", [[]], "", 3, "training_step", where=LOG_LINE)],
    )
    assert divergences({0: rank0, 1: rank1}, 2) == [
        "collective #9 diverged: rank 0 called all_reduce Float[9] (DDP gradient bucket 0) at step 3, backward; "
        f"rank 1 called barrier at step 3, training_step ({LOG_LINE})"
    ]


def test_a_rank_that_raised_is_named_with_its_error_where_the_others_waited():
    rank0 = RankReport(0, 2.0, "collective error", collectives=[grads(7, 2), grads(9, 3)])
    rank1 = RankReport(1, 1.0, "exception", "RuntimeError: boom", "x.py:3 training_step: raise", 3, "training_step",
                       [grads(7, 2)])  # fmt: skip
    assert divergences({0: rank0, 1: rank1}, 2) == [
        "collective #9: rank 0 called all_reduce Float[9] (DDP gradient bucket 0) at step 3, backward; rank 1 never "
        "arrived: it raised RuntimeError: boom at step 3, training_step (x.py:3 training_step: raise)"
    ]


def test_a_rank_that_sent_no_report_is_late_not_diverged():
    rank0 = RankReport(0, 1.0, "timeout", collectives=[grads(7, 2), grads(9, 3)])
    assert divergences({0: rank0}, 2) == []
    assert never_arrived({0: rank0}, 2, "the collective of step 3") == (
        "rank(s) [1] never arrived at the collective of step 3; rank(s) [0] waited there until the timeout (in "
        "collective #9, all_reduce Float[9] (DDP gradient bucket 0) at step 3, backward; rank(s) [1] sent no "
        "report: late, not diverged)"
    )
    assert never_arrived({0: rank0, 1: rank0}, 2, "x") is None


def test_with_several_nodes_each_rank_is_named_with_its_node():
    line = never_arrived({0: RankReport(0, 1.0, "timeout")}, 4, "the collective of step 9", ranks_per_node=2)
    assert line == ("rank(s) [1, 2, 3] (nodes 0, 1) never arrived at the collective of step 9; rank(s) [0] (node 0) "
                    "waited there until the timeout")  # fmt: skip


def test_a_peers_error_becomes_the_whole_message_short_with_the_rank_s_own_chained_above():
    waiting = RankReport(0, 2.0, "collective error", collectives=[grads(7, 2), grads(9, 3)])
    user = 'x.py:3 training_step: raise RuntimeError("' + "a long message " * 8 + '")'
    cause = RankReport(1, 1.0, "exception", "RuntimeError: boom", user, 3, "training_step")
    line = hangs._raised_first(cause, waiting)
    assert line == ("rank 1 raised first: RuntimeError: boom (x.py:3 training_step); rank 0 waited for it in "
                    "collective #9 (all_reduce at step 3, backward)")  # fmt: skip
    error = RuntimeError("Connection closed by peer: " + "gloo " * 200)
    hangs._conclude(error, line)
    assert str(error) == line and "Connection closed by peer" in str(error.__cause__)
    # Raised before training, where no user's line was on its stack (Lightning's zero-length loader check)
    early = RankReport(
        0, 2.0, "collective error", collectives=[Collective(13, "barrier", [[]], "", None, "before training")]
    )
    lightnings = RankReport(1, 1.0, "exception", "RuntimeError: `DataLoader` within local rank has zero length.")
    assert hangs._raised_first(lightnings, early) == (
        "rank 1 raised first: RuntimeError: `DataLoader` within local rank has zero length.; rank 0 waited for it in "
        "collective #13 (barrier before training)"
    )


def test_ranks_that_agree_give_no_line():
    same = [grads(7, 2), grads(9, 3)]
    assert divergences({0: RankReport(0, 1.0, "timeout", collectives=same),
                        1: RankReport(1, 1.0, "timeout", collectives=list(same))}, 2) == []  # fmt: skip


def test_a_report_survives_the_store():
    report = RankReport(1, 1.5, "exception", "E: x", "a.py:1 f: g()", 3, "backward", [grads(9, 3)])
    assert RankReport.from_json(report.as_json()) == report


def test_the_record_puts_each_flight_recorder_entry_in_its_step_and_phase():
    record = CollectiveRecord()
    record.mark(0, "training_step")
    record.mark(0, "backward")
    after_backward = time.time_ns()
    record.mark(0, "the end of the step")
    entries = [{"collective_seq_id": 1, "profiling_name": "gloo:all_reduce", "input_sizes": [[9]],
                "input_dtypes": ["Float"], "time_created_ns": after_backward, "pg_id": 0},
               {"collective_seq_id": 2, "profiling_name": "gloo:all_gather", "input_sizes": [[3]],
                "input_dtypes": ["Double"], "time_created_ns": time.time_ns(), "pg_id": 0}]  # fmt: skip
    first, second = record.collectives(entries, waited="u.py:9 f: g()")
    assert (first.step, first.phase, first.bucket, first.where) == (0, "backward", 0, "")
    assert (second.op, second.phase, second.bucket, second.where) == ("all_gather", "the end of the step", None,
                                                                      "u.py:9 f: g()")  # fmt: skip


def entry(seq: int, name: str, created_ns: int, pg_id: int = 0) -> dict:
    return {"collective_seq_id": seq, "profiling_name": f"gloo:{name}", "input_sizes": [[4]],
            "input_dtypes": ["Float"], "time_created_ns": created_ns, "pg_id": pg_id}  # fmt: skip


def test_the_record_numbers_each_steps_buckets_keeps_the_last_collectives_and_its_last_marks():
    record = CollectiveRecord()
    assert record.now() == (None, "") and record.at(time.time_ns()) == (None, "before training")
    before = time.time_ns() - 1
    times = {}
    for step in (0, 1):
        record.mark(step, "backward")
        times[step] = time.time_ns()
        record.mark(step, "optimizer step")
    assert record.now() == (1, "optimizer step") and record.at(before) == (None, "before training")
    entries = [entry(1, "broadcast", before)]  # DDP's broadcast of the weights, before any mark
    entries += [entry(2 + 3 * s + i, "all_reduce", times[s]) for s in (0, 1) for i in range(3)]
    entries.append(entry(99, "all_reduce", times[1], pg_id=1))  # another group's: left out
    got = record.collectives(entries, waited="u.py:9 f: g()")
    assert [(c.step, c.phase, c.bucket) for c in got] == [(None, "before training", None)] + [
        (s, "backward", i) for s in (0, 1) for i in range(3)]  # fmt: skip
    assert got[-1].where == ""  # the waited line goes to no bucket: a bucket's all-reduce is DDP's, not the user's
    many = [entry(i, "barrier", times[1] + i) for i in range(REPORTED + 4)]
    kept = record.collectives(many, waited="u.py:9 f: g()")
    assert [c.seq for c in kept] == list(range(4, REPORTED + 4)) and kept[-1].where == "u.py:9 f: g()"
    assert [c.where for c in kept[:-1]] == [""] * (REPORTED - 1)
    after_buckets = [entry(2 + i, "all_reduce", times[1]) for i in range(3)] + [entry(9, "barrier", time.time_ns())]
    last = record.collectives(after_buckets, waited="u.py:9 f: g()")
    assert [c.bucket for c in last] == [0, 1, 2, None] and last[-1].where == "u.py:9 f: g()"  # after the buckets
    undated = {k: v for k, v in entry(1, "barrier", 0).items() if k != "time_created_ns"}
    assert [(c.step, c.phase) for c in record.collectives([undated])] == [(None, "before training")]
    for i in range(MARKS_KEPT + 10):
        record.mark(i, "forward")
        times[i] = time.time_ns()
    assert record.at(times[1]) == (None, "before training")  # older than the marks kept
    # each kept time with its own mark (or the next one's, were both read in the same nanosecond)
    assert record.at(times[MARKS_KEPT]) in ((MARKS_KEPT, "forward"), (MARKS_KEPT + 1, "forward"))
    assert record.now() == (MARKS_KEPT + 9, "forward")


def test_the_user_frame_is_the_innermost_outside_the_libraries():
    import traceback

    import lightning

    lib = traceback.FrameSummary(lightning.__file__, 10, "log", line="x")
    mine = traceback.FrameSummary("/home/u/logkeys.py", 21, "training_step", line="self.log('rare_metric')")
    assert user_frame([mine, lib]) == "logkeys.py:21 training_step: self.log('rare_metric')"
    assert user_frame([lib]) == ""


def test_every_rank_that_failed_sees_every_report(monkeypatch):
    store = dist.HashStore()
    reports = {r: RankReport(r, float(r), "timeout", collectives=[grads(9, 3)]) for r in (0, 2)}
    seen = {}
    threads = [threading.Thread(target=lambda r=r: seen.setdefault(r, hangs.exchange(store, reports[r], 3, 1.0)))
               for r in reports]  # fmt: skip
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert seen[0] == seen[2] == reports  # rank 1 never wrote one: left out after the wait


class SilentStore:
    """A store behind a cut link: every call waits for a reply that never comes (TCPStore's ``check`` and ``set``
    have no timeout of their own)."""

    def __init__(self) -> None:
        self.released = threading.Event()

    def set(self, key, value) -> None:
        self.released.wait()

    def check(self, keys) -> bool:
        self.released.wait()
        return True


def test_a_rank_cut_off_from_the_store_returns(monkeypatch):
    """The call is left blocked in a daemon thread instead of waiting on the store for ever."""
    store = SilentStore()
    monkeypatch.setattr(hangs, "ANSWER_S", 0.2)
    try:
        start = time.monotonic()
        assert hangs.exchange_unless_cut_off(store, RankReport(3, 0.0, "timeout"), 4) is None
        assert time.monotonic() - start < 5
    finally:
        store.released.set()


def test_the_first_cause_is_the_earliest_own_error_not_the_first_report(tmp_path):
    for rank, failed_at, consequence in [(0, 1.0, True), (1, 2.0, False)]:  # rank 0: "Connection closed by peer"
        path = tmp_path / f"rank{rank}.json"
        path.write_text(json.dumps({"pid": 100 + rank, "failed_at": failed_at, "message": "Traceback: ...",
                                    "consequence": consequence}))  # fmt: skip
    first = spawn_launcher.first_failure(tmp_path)
    assert (first.rank, first.pid) == (1, 101)
    (tmp_path / "rank1.json").unlink()
    assert spawn_launcher.first_failure(tmp_path).rank == 0  # only consequences: the earliest


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (
            RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234"),
            "collective error",
        ),
        (RuntimeError("[unbound_buffer.cc:78] Timed out waiting 10000ms for recv operation to complete"), "timeout"),
        (RuntimeError("injected failure on rank 1"), "exception"),
    ],
)
def test_what_a_failure_is(error, kind):
    assert hangs.failure_kind(error) == kind


# The real cases: a user's script, 2 CPU ranks, LitDDPStrategy(timeout_s=TIMEOUT_S), all at once.
TIMEOUT_S = 10
SCRIPT = str(Path(__file__).with_name("hang_scripts.py"))
# Each run: the command after ``python -m`` (ddp_fork, the CPU's default, unless the name says otherwise).
RUNS = {
    **{case: ("tests.hang_scripts", case) for case in ("logkeys", "log_dict", "gather_rank0", "raise", "sleep")},
    "sleep_rank0": ("tests.hang_scripts", "sleep_rank0"),  # rank 0, the store's host, is the one that never arrives
    "raise_popen": ("tests.hang_scripts", "raise", "--start-method", "popen"),  # Lightning's `ddp` launcher
    "raise_ddp": ("tests.hang_scripts", "raise", "--strategy", "ddp"),  # the callbacks under Lightning's own strategy
    "raise_torchrun": ("torch.distributed.run", "--nproc-per-node", "2", SCRIPT, "raise"),
}
# The watchdog's cases, with timeouts it must not need (under `ddp`, the callbacks alone: Lightning's 30 minutes).
WATCHDOG_RUNS = {
    "sleep_named": ("tests.hang_scripts", "sleep", "--timeout-s", "40"),
    "stuck_worker": ("tests.hang_scripts", "stuck_worker", "--timeout-s", "40"),
    "setup_barrier": ("tests.hang_scripts", "setup_barrier", "--timeout-s", "600"),
    "logkeys_ddp": ("tests.hang_scripts", "logkeys", "--strategy", "ddp"),
    "log_dir_after_fit": ("tests.hang_scripts", "log_dir_after_fit", "--strategy", "ddp"),
    "rank0_work": ("tests.hang_scripts", "rank0_work", "--timeout-s", "40", "--epochs", "1"),
    "head_rank1": ("tests.hang_scripts", "head_rank1", "--strategy", "ddp"),
    "stop_rank1": ("tests.hang_scripts", "stop_rank1", "--strategy", "ddp"),
    "epoch_end_log": ("tests.hang_scripts", "epoch_end_log", "--strategy", "ddp"),
}


def run_all(tmp_path_factory, commands: dict[str, tuple[str, ...]]) -> dict[str, tuple[int, float, str]]:
    """Each run's exit code, seconds from start to exit, and stderr."""
    with ExitStack() as stack:
        start = time.monotonic()
        runs = {name: stack.enter_context(start_module(*command, cwd=tmp_path_factory.mktemp(name)))
                for name, command in commands.items()}  # fmt: skip
        ended = {}
        for name, run in runs.items():
            code = run.wait(timeout=180)
            ended[name] = (code, time.monotonic() - start, run.stderr)
    return ended


@pytest.fixture(scope="module")
def hung_runs(tmp_path_factory) -> dict[str, tuple[int, float, str]]:
    return run_all(tmp_path_factory, {name: (*c, "--timeout-s", str(TIMEOUT_S)) for name, c in RUNS.items()})


@pytest.fixture(scope="module")
def watchdog_runs(tmp_path_factory) -> dict[str, tuple[int, float, str]]:
    return run_all(tmp_path_factory, WATCHDOG_RUNS)


def last_line(stderr: str) -> str:
    return [line for line in stderr.strip().splitlines() if line.strip()][-1]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("case", "pattern"),
    [
        ("logkeys", r"collective #\d+ diverged: rank 0 called all_reduce Float\[9\] \(DDP gradient bucket 0\) at "
                    r"step 3, backward; rank 1 called barrier at step 3, training_step \(hang_scripts.py:\d+ "
                    r"training_step: self.log\(\"rare_metric\", loss, sync_dist=True\)\)"),
        ("log_dict", r"collective #\d+ diverged: .*rank 1 called .* at step 3, training_step \(hang_scripts.py:\d+ "
                     r"training_step: self.log_dict\(metrics, sync_dist=True\)\)"),
        ("gather_rank0", r"collective #\d+ diverged: rank 0 called all_gather Float\[\] at step 3, training_step "
                         r"\(hang_scripts.py:\d+ training_step: self.all_gather\(loss\)\); rank 1 called all_reduce "
                         r"Float\[9\] \(DDP gradient bucket 0\) at step 3, backward"),
        ("sleep", r"rank\(s\) \[1\] never arrived at the collective of step 3; rank\(s\) \[0\] waited there until the "
                  r"timeout \(in collective #\d+, all_reduce Float\[9\] \(DDP gradient bucket 0\) at step 3, backward; "
                  r"(rank\(s\) \[1\] sent no report: late, not diverged|rank 1 has been at hang_scripts.py:\d+ "
                  r"training_step: time.sleep\(3600\) for \d+ s \(step 3, training_step\), outside any collective)\)"),
    ],
)  # fmt: skip
def test_a_hang_ends_naming_the_divergence(hung_runs, case, pattern):
    code, seconds, stderr = hung_runs[case]
    assert code == 1
    assert re.search(pattern, last_line(stderr)), stderr[-3000:]
    assert seconds < TIMEOUT_S + 60


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_hung_rank_says_where_it_hangs(hung_runs):
    _, _, stderr = hung_runs["sleep"]
    line = (
        r"^lit_ddp: rank 1: SIGTERM after \d+ s without a step boundary \(hung at hang_scripts.py:\d+ "
        r"training_step: time.sleep\(3600\)\): exiting at once$"
    )
    assert re.search(line, stderr, re.M), stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_rank_that_raises_between_two_collectives_ends_the_job_with_its_own_error(hung_runs):
    code, seconds, stderr = hung_runs["raise"]
    assert code == 1
    assert last_line(stderr) == "RuntimeError: injected failure on rank 1 between two collectives", stderr[-3000:]
    assert "lit-ddp-fit" not in stderr  # a user's script: messages name lit_ddp


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_hang_in_which_rank_0_never_arrives_names_rank_0(hung_runs):
    """Rank 0 hosts the store, whose server keeps answering while rank 0's training thread sleeps: rank 1's report
    is there, rank 0's never comes, and rank 1's line names rank 0 as the one that never arrived."""
    code, seconds, stderr = hung_runs["sleep_rank0"]
    assert code == 1
    assert re.search(
        r"^RuntimeError: rank\(s\) \[0\] never arrived at the collective of step 3; rank\(s\) \[1\] waited there "
        r"until the timeout \(in collective #\d+, all_reduce Float\[9\] \(DDP gradient bucket 0\) at step 3, "
        r"backward; (rank\(s\) \[0\] sent no report: late, not diverged|rank 0 has been at .* outside any "
        r"collective)\)",
        last_line(stderr),
    ), stderr[-3000:]
    assert seconds < TIMEOUT_S + 60


RAISED = r"rank 1 raised first: RuntimeError: injected failure on rank 1 between two collectives \(hang_scripts.py:"


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("run", ["raise_popen", "raise_ddp"])
def test_under_the_ddp_launcher_the_job_ends_with_the_rank_that_raised(hung_runs, run):
    """Rank 0 trains in the launching process: its own error (a closed connection) ends the job, and its message is
    rank 1's, the first cause, from rank 1's report in the store: one short line, last, the closed connection's
    page of gloo text chained above the traceback (issue 52: the cause last, short)."""
    code, seconds, stderr = hung_runs[run]
    assert code == 1
    line = last_line(stderr)
    assert re.fullmatch(r"\[rank0\]: RuntimeError: " + RAISED + r"\d+ training_step\); rank 0 waited for it in "
                        r"collective #\d+ \(all_reduce at step 3, backward\)", line), stderr[-3000:]  # fmt: skip
    assert len(line.partition("RuntimeError: ")[2]) <= hangs.LINE_CHARS  # the prefixes are the launcher's
    assert "Connection closed by peer" in stderr.partition("The above exception was the direct cause")[0]
    assert seconds < TIMEOUT_S + 60


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_under_torchrun_the_root_cause_is_the_rank_that_raised(hung_runs):
    """torchrun's summary names the earliest error file's rank as the root cause: rank 1 leaves one (its own error),
    rank 0 (a consequence) none; its traceback is shown there, not "To enable traceback see ..."."""
    code, _, stderr = hung_runs["raise_torchrun"]
    assert code == 1
    root = stderr.partition("Root Cause (first observed failure):")[2]
    assert "rank      : 1 (local_rank: 1)" in root, stderr[-3000:]
    assert "RuntimeError: injected failure on rank 1 between two collectives" in root, stderr[-3000:]


WAITS_IN_BUCKET = r"rank 0 waits in all_reduce #\d+ Float\[9\] \(DDP gradient bucket 0\) at step 3, backward"


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("case", "pattern"),
    [
        ("sleep_named", r"^lit_ddp: waiting 1\d s: rank 1 has been at hang_scripts.py:\d+ training_step: "
                        r"time.sleep\(3600\) for \d+ s \(step 3, training_step\), outside any collective; "
                        + WAITS_IN_BUCKET + " -> .*raise timeout_s"),
        ("stuck_worker", r"^lit_ddp: waiting 1\d s: rank 1 waits for its DataLoader worker 1 \(pid \d+\) at "
                         r"hang_scripts.py:\d+ __getitem__: time.sleep\(3600\), \d+ s .*; " + WAITS_IN_BUCKET),
    ],
)  # fmt: skip
def test_the_watchdog_names_the_rank_its_line_and_what_the_others_wait_in_long_before_the_timeout(
    watchdog_runs, case, pattern
):
    code, _, stderr = watchdog_runs[case]
    assert code == 1  # at the timeout: a wait is never ended for its length
    assert re.search(pattern, stderr, re.M), stderr[-3000:]
    assert "hung" not in stderr.partition("lit_ddp: waiting")[2].splitlines()[0]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_at_the_timeout_a_rank_outside_any_collective_is_named_at_its_line_not_as_silent(watchdog_runs):
    """Its watchdog's state (published from 10 s on, the timeout at 40 s) says where it is, in the job's last line."""
    _, _, stderr = watchdog_runs["sleep_named"]
    named = (r"rank\(s\) \[1\] never arrived at the collective of step 3; rank\(s\) \[0\] waited there until the "
             r"timeout \(in collective #\d+, .*; rank 1 has been at hang_scripts.py:\d+ training_step: "
             r"time.sleep\(3600\) for \d+ s \(step 3, training_step\), outside any collective\) -> work longer than "
             r"the process group's timeout: raise timeout_s")  # fmt: skip
    assert re.search(named, last_line(stderr)), stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_parameters_unused_on_a_rank_are_named_with_the_rank_under_lightnings_own_strategy(watchdog_runs):
    """A head (``b``) that only rank 1 uses, from step 4: after the first backward the callbacks name it."""
    code, _, stderr = watchdog_runs["head_rank1"]
    assert code == 1
    assert "got no gradient in step 0 on rank 0: b.weight, b.bias; " in stderr, stderr[-3000:]
    assert "DDPStrategy(find_unused_parameters=True)" in stderr


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_healthy_long_work_is_said_to_wait_and_goes_on(watchdog_runs):
    """Rank 0 works 14 s in its step, past the watchdog's 10 s: a waiting line, then it moves on; never ended."""
    code, _, stderr = watchdog_runs["rank0_work"]
    assert code == 0, stderr[-3000:]
    assert re.search(
        r"^lit_ddp: waiting 1\d s: rank 0 has been at hang_scripts.py:\d+ training_step: time.sleep\(14\) "
        r"for \d+ s \(step 3, training_step\), outside any collective; rank 1 waits in ",
        stderr,
        re.M,
    )
    assert re.search(r"^lit_ddp: moved on after 1\d s$", stderr, re.M), stderr[-3000:]
    assert "hung" not in stderr and "diverged" not in stderr


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("case", "pattern"),
    [
        ("setup_barrier", r"collective #\d+ diverged: rank 0 called barrier before training .*; out of step since "
                          r"#\d+, barrier: rank 0 at hang_scripts.py:\d+ setup: torch.distributed.barrier\(\), "
                          r"rank 1 at "),
        ("logkeys_ddp", r"collective #\d+ diverged: rank 0 called all_reduce Float\[9\] \(DDP gradient bucket 0\) at "
                        r"step 3, backward; rank 1 called barrier at step 3, training_step \(hang_scripts.py:\d+ "
                        r"training_step: self.log\(\"rare_metric\", loss, sync_dist=True\)\) -> .*rank_zero_only"),
        ("log_dir_after_fit", r"^lit_ddp: rank 0 waits in broadcast #\d+ .*\(hang_scripts.py:\d+ main: "
                              r"print\(trainer.log_dir\)\); rank 1 left \(past the end of the script\) and will "
                              r"never call it -> .*rank_zero_only"),
        # Lightning reduces an epoch's value from its loop, after the hook: the hook's self.log line is named
        ("epoch_end_log", r"^lit_ddp: collective #\d+ diverged: rank 0 called barrier at step \d+, the end of epoch 0 "
                          r"\(hang_scripts.py:\d+ on_train_epoch_end: self.log\(\"epoch_metric\", .*sync_dist=True\)\);"
                          r" rank 1 called .* -> a sync_dist key logged on some ranks only \('epoch_metric'\)"),
        ("stop_rank1", r"^lit_ddp: rank 0 waits in all_reduce #\d+ .* at step 4, backward; rank 1 left: it stopped "
                       r"training after step 3 \(trainer.should_stop set at hang_scripts.py:\d+ training_step: "
                       r"self.trainer.should_stop = True\) and will never call it -> .*reduce_boolean_decision"),
    ],
)  # fmt: skip
def test_a_certain_divergence_ends_the_job_whatever_the_timeout(watchdog_runs, case, pattern):
    """Lightning's 30 minutes (the callbacks leave the user's timeout), 600 s: the job ends in seconds, named."""
    code, _, stderr = watchdog_runs[case]
    assert code == 1
    assert re.search(pattern, stderr, re.M), stderr[-3000:]
    # The line is the job's last: the speaking rank leaves once its peers saw it, before their collectives fail
    assert re.search(pattern, last_line(stderr)), stderr[-3000:]
    assert "timeout is now" not in stderr  # the callbacks leave the user's timeout as it is
    assert "Timed out" not in stderr


def _raises():
    raise RuntimeError("here")  # the user's line


def _live():
    return frame_of(frame=sys._getframe())


def test_frame_of_names_the_users_line_of_a_traceback_or_of_a_live_stack():
    try:
        _raises()
    except RuntimeError as error:
        tb = error.__traceback__
    line = _raises.__code__.co_firstlineno + 1
    assert frame_of(tb) == f'test_hangs.py:{line} _raises: raise RuntimeError("here")'
    line = _live.__code__.co_firstlineno + 1
    assert _live() == f"test_hangs.py:{line} _live: return frame_of(frame=sys._getframe())"
    assert frame_of() == ""
    ghost: dict = {}  # code whose file is nowhere: no line to read, and a frame kept after its call returned
    exec(compile("import sys\ndef held():\n    return sys._getframe()\ndef f():\n    raise ValueError()\n",
                 "/nowhere/ghost.py", "exec"), ghost)  # fmt: skip
    try:
        ghost["f"]()
    except ValueError as error:
        assert frame_of(error.__traceback__) == "ghost.py:5 f: "  # no text made up for the missing line
    assert frame_of(frame=ghost["held"]()) == "ghost.py:3 held: "  # that frame's stack, not the caller's


def test_a_records_report_holds_its_last_collectives_its_place_and_the_line_it_waited_at(monkeypatch):
    record = CollectiveRecord()
    assert record.now() == (None, "") and record.at(time.time_ns()) == (None, "before training")
    record.mark(3, "training_step")
    record.mark(3, "backward")
    entries = [{"collective_seq_id": i, "profiling_name": "gloo:all_gather", "input_sizes": [[i]],
                "input_dtypes": ["Float"], "time_created_ns": time.time_ns(), "pg_id": 0}
               for i in range(1, 21)]  # fmt: skip
    monkeypatch.setattr(_torch, "flight_recorder_entries", lambda: entries)
    report = record.report(1, "timeout", "RuntimeError: timed out", "u.py:9 f: g()")
    assert (report.rank, report.kind, report.error, report.where) == (1, "timeout", "RuntimeError: timed out",
                                                                      "u.py:9 f: g()")  # fmt: skip
    assert (report.step, report.phase) == (3, "backward") and report.failed_at > 0
    assert [c.seq for c in report.collectives] == list(range(5, 21))  # the last REPORTED = 16
    assert report.collectives[-1].where == "u.py:9 f: g()"  # no stack in Flight Recorder's entry: where it waited
    raised = record.report(1, "exception", "ValueError: x", "u.py:3 h: k()")
    assert raised.collectives[-1].where == ""  # it raised, waiting in no collective
    monkeypatch.setattr(_torch, "flight_recorder_entries", lambda: [])
    assert record.report(0, "hung", "", "").collectives == []


def test_on_nccl_the_record_reads_nccls_own_flight_recorder_and_nothing_elsewhere(monkeypatch):
    # A CUDA build keeps NCCL's collectives in its own dump, not in _dump_fr_trace's; a CPU build has no NCCL, so
    # its dump and backend are stood in for here (what they return is the same pickle).
    import pickle

    import torch

    c10d, asked = torch._C._distributed_c10d, []
    record = CollectiveRecord()
    record.mark(2, "backward")
    entry = {"collective_seq_id": 7, "profiling_name": "nccl:all_reduce", "input_sizes": [[4]],
             "input_dtypes": ["Float"], "time_created_ns": time.time_ns(), "pg_id": 0}  # fmt: skip

    def dump(*flags):
        asked.append(flags)
        return pickle.dumps({"version": "2.4", "entries": [entry]})

    monkeypatch.setattr(c10d, "_dump_fr_trace", lambda *flags: pickle.dumps({"version": "2.4", "entries": []}))
    monkeypatch.setattr(c10d, "_dump_nccl_trace", dump, raising=False)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    assert _torch.flight_recorder_entries() == [entry]
    assert asked == [(True, True, False)]  # collectives and stacks, every entry (not only those in flight)
    assert [(c.seq, c.step, c.phase, c.bucket) for c in record.report(0, "hung", "", "").collectives] == [
        (7, 2, "backward", 0)
    ]
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert _torch.flight_recorder_entries() == [] and len(asked) == 2  # gloo's are in _dump_fr_trace: not asked
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    assert _torch.flight_recorder_entries() == [] and len(asked) == 2  # no process group
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    for error in (RuntimeError("NCCL is not initialized"), ValueError("bad dump"), pickle.UnpicklingError("x")):

        def failing(*flags, error=error):
            raise error

        monkeypatch.setattr(c10d, "_dump_nccl_trace", failing)
        assert _torch.flight_recorder_entries() == []
    monkeypatch.setattr(c10d, "_dump_nccl_trace", lambda *flags: b"not a pickle")
    assert _torch.flight_recorder_entries() == []
    monkeypatch.setattr(c10d, "_dump_nccl_trace", lambda *flags: pickle.dumps({"version": "2.4"}))
    assert _torch.flight_recorder_entries() == []  # a dump without entries
    monkeypatch.delattr(c10d, "_dump_nccl_trace")
    assert _torch.flight_recorder_entries() == []  # a build without NCCL
    monkeypatch.setattr(c10d, "_dump_fr_trace", lambda *flags: pickle.dumps({"version": "2.4", "entries": [entry]}))
    assert _torch.flight_recorder_entries() == [entry]  # torch's own recorder first


def test_only_the_last_collective_without_a_line_gets_the_line_a_rank_waited_at(monkeypatch):
    record = CollectiveRecord()
    record.mark(4, "training_step")
    now = time.time_ns()

    def entry(seq: int, frames=None) -> dict:
        return {"collective_seq_id": seq, "profiling_name": "gloo:all_gather", "input_sizes": [[1]],
                "input_dtypes": ["Float"], "time_created_ns": now, "pg_id": 0, "frames": frames or []}  # fmt: skip

    user = [{"filename": "/home/u/train.py", "line": 7, "name": "training_step"}]
    held = [entry(1), entry(2, user), entry(3)]  # the one before the last holds its line; the last, none
    got = record.collectives(held, "train.py:9 f: g()")
    assert [c.where for c in got] == ["", "train.py:7 training_step: ", "train.py:9 f: g()"]
    assert record.collectives(held)[-1].where == ""  # no line waited at: nothing put there
    monkeypatch.setattr(_torch, "flight_recorder_entries", lambda: held)
    for kind in ("timeout", "collective error"):  # waiting in a collective: its line is the last one's
        assert record.report(1, kind, "E", "train.py:9 f: g()").collectives[-1].where == "train.py:9 f: g()"
    assert record.report(1, "hung", "", "train.py:9 f: g()").collectives[-1].where == ""


def test_what_each_rank_that_never_arrived_did_instead_and_two_ranks_named_together():
    """Three ranks call #9 (two alike), the others stop short: one hung, one waited in its #7, two sent nothing;
    and one that failed in no collective."""
    called = {r: RankReport(r, 1.0, "timeout", collectives=[grads(7, 2), grads(9, 3)]) for r in (0, 2)}
    called[1] = RankReport(1, 1.0, "timeout", collectives=[grads(7, 2), Collective(9, "barrier", [[]], "", 3, "x")])
    hung = RankReport(3, 1.0, "hung", where="u.py:1 f: sleep()", step=3, phase="training_step",
                      collectives=[grads(7, 2)])  # fmt: skip
    waited = RankReport(4, 1.0, "timeout", collectives=[grads(7, 2)])
    (line,) = divergences({**called, 3: hung, 4: waited}, 7)
    assert line == (
        "collective #9 diverged: ranks 0, 2 called all_reduce Float[9] (DDP gradient bucket 0) at step 3, backward; "
        "rank 1 called barrier at step 3, x; "
        "rank 3 never arrived: it was hung outside any collective at step 3, training_step (u.py:1 f: sleep()); "
        "rank 4 never arrived: it waited in its #7, all_reduce Float[9] (DDP gradient bucket 0) at step 2, backward; "
        "rank 5 never arrived: it sent no report (hung outside any collective, or dead); "
        "rank 6 never arrived: it sent no report (hung outside any collective, or dead)"
    )
    failed = RankReport(1, 1.0, "collective error", "RuntimeError: closed", step=2, phase="backward")
    assert divergences({0: called[0], 1: failed}, 2) == [
        "collective #7: rank 0 called all_reduce Float[9] (DDP gradient bucket 0) at step 2, backward; rank 1 never "
        "arrived: it failed at step 2, backward: RuntimeError: closed"
    ]


def test_the_first_cause_is_the_earliest_exception_before_any_earlier_timeout():
    timeout = RankReport(0, 1.0, "timeout")
    late, early = RankReport(1, 3.0, "exception", "E: late"), RankReport(2, 2.0, "exception", "E: early")
    assert first_cause({0: timeout, 1: late, 2: early}) is early
    assert first_cause({0: timeout, 3: RankReport(3, 0.5, "collective error")}).rank == 3
    assert first_cause({}) is None


def test_a_rank_that_failed_before_its_first_collective_never_arrived_at_the_others_first():
    """An empty record is a rank that reached no collective (torch numbers a group's collectives from 1); a
    report without a step says no step; and no reports at all are nothing to compare."""
    rank0 = RankReport(0, 1.0, "timeout", collectives=[grads(1, 0)])
    rank1 = RankReport(1, 0.5, "exception", "ValueError: bad batch")
    assert divergences({0: rank0, 1: rank1}, 2) == [
        "collective #1: rank 0 called all_reduce Float[9] (DDP gradient bucket 0) at step 0, backward; rank 1 never "
        "arrived: it raised ValueError: bad batch"
    ]
    assert divergences({}, 2) == [] and never_arrived({}, 2, "x") is None


def test_records_are_compared_from_the_first_collective_every_record_still_holds():
    """Ranks 1 and 2 waited in #6, rank 1's record forgot #4, rank 0 stopped after #3: the line is at #5, the first
    number both waiting ranks still hold, and names them both; a number missing inside a record is not a rank that
    never got there."""
    rank0 = RankReport(0, 1.0, "exception", "E: x", collectives=[grads(2, 0), grads(3, 1)])
    rank1 = RankReport(1, 2.0, "timeout", collectives=[grads(5, 2), grads(6, 3)])
    rank2 = RankReport(2, 2.0, "timeout", collectives=[grads(4, 1), grads(5, 2), grads(6, 3)])
    assert divergences({0: rank0, 1: rank1, 2: rank2}, 3) == [
        "collective #5: ranks 1, 2 called all_reduce Float[9] (DDP gradient bucket 0) at step 2, backward; rank 0 "
        "never arrived: it raised E: x"
    ]
    gap = RankReport(1, 1.0, "timeout", collectives=[grads(7, 2), grads(9, 3)])
    full = RankReport(0, 1.0, "timeout", collectives=[grads(7, 2), grads(8, 2), grads(9, 3)])
    assert divergences({0: full, 1: gap}, 2) == []


def test_the_late_ranks_collective_is_named_only_where_every_report_ends_in_the_same_one():
    three = [grads(7, 2), grads(8, 2), grads(9, 3)]
    reports = {r: RankReport(r, 1.0, "timeout", collectives=list(three)) for r in (0, 1)}
    assert never_arrived(reports, 3, "x") == (
        "rank(s) [2] never arrived at x; rank(s) [0, 1] waited there until the timeout (in collective #9, all_reduce "
        "Float[9] (DDP gradient bucket 0) at step 3, backward; rank(s) [2] sent no report: late, not diverged)"
    )
    bare = "rank(s) [2] never arrived at x; rank(s) [0, 1] waited there until the timeout"
    assert never_arrived({0: reports[0], 1: RankReport(1, 1.0, "hung")}, 3, "x") == bare  # one holds none
    other = RankReport(1, 1.0, "timeout", collectives=[grads(8, 2), Collective(9, "barrier", [], "", 3, "x")])
    assert never_arrived({0: reports[0], 1: other}, 3, "x") == bare  # the same number, another call


def test_a_calls_text_lists_every_inputs_shape_and_a_report_without_collectives_reads_back():
    assert Collective(3, "all_gather", [[2], [3, 4]], "Float").call() == "all_gather Float[2], [3, 4]"
    assert Collective(3, "all_reduce", [], "Float").call() == "all_reduce Float[]"  # an entry without sizes
    data = {"rank": 1, "failed_at": 1.0, "kind": "hung"}  # JSON without the field: no collectives
    assert RankReport.from_json(data) == RankReport(1, 1.0, "hung")


@pytest.mark.skipif(sys.version_info < (3, 11), reason="the location table of Python 3.11 on")
def test_a_frame_without_a_line_number_is_at_line_0_with_no_text():
    """Code whose location table holds no line (an entry of "no location", code 15, for every 8 code units): its
    frame is at line 0, and no line of its file, which is there to read, is put to it."""
    held: dict = {}
    exec(compile("def f():\n    raise ValueError()\n", SCRIPT, "exec"), held)
    code = held["f"].__code__
    units = len(code.co_code) // 2
    held["f"].__code__ = code.replace(co_linetable=bytes(0xF8 + min(8, units - i) - 1 for i in range(0, units, 8)))
    with pytest.raises(ValueError) as raised:
        held["f"]()
    assert frame_of(raised.tb) == "hang_scripts.py:0 f: "
