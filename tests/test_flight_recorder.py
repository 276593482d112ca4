"""``python -m lit_ddp.report --flight-recorder DIR`` on dumps that real torch code writes here: a 2-rank gloo DDP
job whose rank 1 calls one collective more (``tests/flight_dumps.py``)."""

import json
import os
import pickle
import re
from pathlib import Path

import pytest
import torch
from torch.multiprocessing import ProcessExitedException

from lit_ddp import report
from lit_ddp.analysis import flight_recorder
from lit_ddp.analysis.stopped import FIX_DEAD
from lit_ddp.run import hangs, launchers, lifecycle
from tests import flight_dumps
from tests.runner import run_module

# The line of tests/flight_dumps.py that calls the collective rank 0 never calls.
LINE = next(i for i, text in enumerate(Path(flight_dumps.__file__).read_text().splitlines(), 1)
            if "dist.all_reduce(torch.ones(1), async_op=True)" in text)  # fmt: skip


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fr")
    result = run_module("tests.flight_dumps", str(directory), cwd=directory, timeout=90)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in directory.iterdir()) == ["fr_trace_rank0", "fr_trace_rank1", "json"]
    return directory


@pytest.mark.timeout(120)
def test_the_dumps_are_read_ddp_aware_and_compared(dumps, capsys):
    assert report.main(["--flight-recorder", str(dumps)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"Flight Recorder dumps of 2 rank(s) in {dumps}:"
    rank0 = (
        r"rank 0: \d+ collectives \(3 DDP gradient bucket all-reduces in 3 backward pass\(es\)\); the last, "
        r"#(\d+): all_reduce Float\[9\] \(DDP gradient bucket 0\) \(scheduled\)$"
    )
    assert re.match(rank0, lines[1]), lines
    last = int(re.search(r"#(\d+)", lines[1]).group(1))
    assert lines[3] == (
        f"collective #{last + 1}: rank 1 called all_reduce Float[1] at step 2, after the backward "
        f"(flight_dumps.py:{LINE} rank_main: dist.all_reduce(torch.ones(1), async_op=True)); rank 0 never arrived: "
        f"it had called only up to #{last}, all_reduce Float[9] (DDP gradient bucket 0) at step 2, backward"
    )


def test_a_folder_without_dumps_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        report.main(["--flight-recorder", str(tmp_path)])
    assert exit_.value.code == 2
    assert f"--flight-recorder: {tmp_path}: no Flight Recorder dump" in capsys.readouterr().err


def as_nccl_writes_it(dump: dict) -> dict:
    """A real dump in the form NCCL's watchdog pickles it on a timeout: the same Flight Recorder entries (torch's
    FlightRecorder is one for both backends) named ``nccl:<op>``, the default group keyed ``"0"``, the ops that
    completed with their ``duration_ms``, the last one ``started``, and NCCL's ``nccl_comm_state`` (as torch's own
    tests build theirs: test/distributed/flight_recorder/test_fr_analysis.py's ``create_one_entry``)."""
    entries = [dict(e) for e in dump["entries"]]
    for entry in entries:
        entry["profiling_name"] = "nccl:" + entry["profiling_name"].partition(":")[2]
        entry["state"], entry["duration_ms"] = "completed", 0.1
    entries[-1]["state"], entries[-1]["duration_ms"] = "started", None
    config = {"0" if name == "" else name: group for name, group in dump["pg_config"].items()}
    return {**dump, "pg_config": config, "entries": entries, "nccl_comm_state": {}}


@pytest.mark.timeout(120)
def test_nccl_pickles_and_torchs_json_are_read_too(dumps, tmp_path, capsys):
    assert report.main(["--flight-recorder", str(dumps)]) == 0
    gloo = capsys.readouterr().out.splitlines()
    nccl = tmp_path / "nccl"
    nccl.mkdir()
    for rank in (0, 1):
        dump = pickle.loads((dumps / f"fr_trace_rank{rank}").read_bytes())
        (nccl / f"nccl_trace_rank_{rank}").write_bytes(pickle.dumps(as_nccl_writes_it(dump)))
    assert report.main(["--flight-recorder", str(nccl)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].replace("(started)", "(scheduled)") == gloo[1] and lines[3] == gloo[3]
    assert flight_recorder.dumps_divergence(nccl) == gloo[3]

    assert report.main(["--flight-recorder", str(dumps / "json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "(JSON dumps hold no Python stacks: DDP's buckets, the steps and the user's lines are not named)"
    assert re.match(r"collective #(\d+): rank 1 called all_reduce Float\[1\]; rank 0 never arrived: it had called "
                    r"only up to #\d+, all_reduce Float\[9\]$", lines[-1]), lines  # fmt: skip


def test_only_the_dumps_of_this_job_are_read(dumps, tmp_path):
    """The launcher reads the dumps written since its ranks started: an older job's in the folder are not its."""
    for rank in (0, 1):
        path = tmp_path / f"nccl_trace_rank_{rank}"
        path.write_bytes((dumps / f"fr_trace_rank{rank}").read_bytes())
        os.utime(path, (1000.0, 1000.0))
    assert hangs.dumps_diagnosis(tmp_path, since=2000.0) is None
    line = hangs.dumps_diagnosis(tmp_path, since=0.0)
    assert line.startswith("collective #") and line.endswith(f"(NCCL's Flight Recorder dumps in {tmp_path})")


def test_a_killed_rank_is_explained_by_the_dumps(dumps, tmp_path, capsys):
    """A ddp_spawn rank that NCCL's watchdog aborted: the launcher's exception, and lit_ddp.fit's line, carry what
    the dumps show."""
    launcher = object.__new__(launchers.MultiProcessingLauncher)
    launcher.dumps, launcher.started = dumps, 0.0
    why = launcher.why_exited()
    assert why == hangs.dumps_diagnosis(dumps, 0.0) and why.startswith("collective #")

    def run():
        err = ProcessExitedException("process 1 terminated with signal SIGABRT", 1, 99, -6, "SIGABRT")
        err.lit_ddp_diagnosis = why
        raise err

    assert lifecycle.exit_code(run, prog="lit_ddp") == 1
    assert capsys.readouterr().err == f"lit_ddp: rank 1 exited with signal SIGABRT: {why}\n"


def test_a_rank_killed_with_nothing_to_explain_it_ends_with_where_to_look(capsys):
    def run():
        raise ProcessExitedException("process 1 terminated with signal SIGKILL", 1, 99, -9, "SIGKILL")

    assert lifecycle.exit_code(run, prog="lit_ddp") == 1
    assert capsys.readouterr().err == f"lit_ddp: rank 1 exited with signal SIGKILL -> {FIX_DEAD}\n"
    assert "out-of-memory killer (dmesg)" in FIX_DEAD


def test_nccl_is_told_to_dump_into_the_run_folder_where_the_user_said_nothing(tmp_path):
    environ: dict[str, str] = {}
    assert hangs.prepare_nccl_dumps("gloo", str(tmp_path), environ) is None and environ == {}
    folder = hangs.prepare_nccl_dumps("nccl", str(tmp_path), environ)
    assert folder == (tmp_path / "flight_recorder").resolve() and folder.is_dir()
    assert environ == {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
                       "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_FR_DUMP_TEMP_FILE": f"{folder}/nccl_trace_rank_",
                       "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": f"{folder}/nccl_trace_rank_"}  # fmt: skip
    mine = {"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(tmp_path / "mine" / "trace_"), "TORCH_NCCL_TRACE_BUFFER_SIZE": "50"}
    environ = dict(mine)
    assert hangs.prepare_nccl_dumps("cpu:gloo,cuda:nccl", str(tmp_path), environ) == tmp_path / "mine"
    assert {k: environ[k] for k in mine} == mine and "TORCH_FR_BUFFER_SIZE" not in environ
    assert environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert hangs.prepare_nccl_dumps("nccl", str(tmp_path), {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="NCCL needs a GPU")
@pytest.mark.timeout(120)
def test_a_real_nccl_dump_on_one_gpu_is_read_ddp_aware(tmp_path, capsys):
    """NCCL's own pickle (world 1: a dump, not a hang): its Python stacks name DDP's buckets and the steps."""
    result = run_module("tests.flight_dumps", str(tmp_path), "--nccl", cwd=tmp_path, timeout=90)
    assert result.returncode == 0, result.stderr
    assert report.main(["--flight-recorder", str(tmp_path)]) == 0
    line = capsys.readouterr().out.splitlines()[1]
    assert re.match(r"rank 0: \d+ collectives \(3 DDP gradient bucket all-reduces in 3 backward pass\(es\)\)", line)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a hang under NCCL needs 2 GPUs")
@pytest.mark.timeout(240)
def test_a_hang_under_nccl_is_named_from_the_dumps_on_timeout(tmp_path):
    """Rank 1 sleeps in its step; rank 0's bucket all-reduce times out in NCCL's watchdog, which dumps (both ranks:
    it signals the other through the store) and aborts the rank before any Python handler runs. The ddp_spawn
    launcher survives and names what the dumps in the run's folder show."""
    result = run_module("tests.hang_scripts", "sleep", "--timeout-s", "20", "--accelerator", "gpu",
                        "--start-method", "spawn", cwd=tmp_path, timeout=200)  # fmt: skip
    assert result.returncode != 0
    assert (tmp_path / "flight_recorder").is_dir(), result.stderr[-3000:]
    # Both ranks' dumps: "collective #N: rank 0 called ...; rank 1 never arrived: it had called only up to ...";
    # rank 0's only (no coordinated dump): "rank(s) [1] never arrived at the last collective; ...".
    line = next((x for x in result.stderr.splitlines() if "(NCCL's Flight Recorder dumps in " in x), "")
    assert "never arrived" in line, result.stderr[-3000:]
    assert re.search(r"(rank 0 called|in collective #\d+,) all_reduce Float\[9\] \(DDP gradient bucket 0\) at step 3, "
                     r"backward", line), line  # fmt: skip


def fr_entry(seq, op, sizes, frames, pg_id=0, state="completed", **more):
    """One Flight Recorder entry as torch's dump holds it (its stack innermost first)."""
    return {"collective_seq_id": seq, "profiling_name": f"nccl:{op}", "input_sizes": sizes, "input_dtypes": ["Float"],
            "frames": frames, "pg_id": pg_id, "state": state, **more}  # fmt: skip


USER = [
    {"name": "_call", "filename": os.path.join(os.path.dirname(torch.__file__), "nn", "module.py"), "line": 3},
    {"name": "<module>", "filename": "<string>", "line": 1},
    {"name": "training_step", "filename": "/home/u/train.py", "line": 7},
]
AUTOGRAD = [{"name": "run_backward", "filename": "/x/graph.py", "line": 1}]  # fmt: skip


def hand_made_dump(last_op):
    return {"entries": [
        fr_entry(1, "broadcast", [[4]], USER),
        fr_entry(2, "all_reduce", [[9]], AUTOGRAD), fr_entry(3, "all_reduce", [[3]], AUTOGRAD),
        fr_entry(1, "send", [[1]], USER, is_p2p=True), fr_entry(1, "all_reduce", [[2]], USER, pg_id=1),
        fr_entry(4, "all_reduce", [[9]], AUTOGRAD), fr_entry(5, "all_reduce", [[9]], AUTOGRAD),
        fr_entry(6, last_op, [[2, 2]], USER, state="scheduled"),
    ]}  # fmt: skip


def test_hand_made_dumps_are_read_ddp_aware_and_compared(tmp_path):
    """Each backward pass a step (a new one where its first bucket's size comes round again, or after another
    collective), a bucket's line autograd's, the user's the innermost outside the libraries, other groups and
    point-to-point sends left out; JSON or pickle, files named by their rank."""
    (tmp_path / "fr_trace_rank0.json").write_text(json.dumps(hand_made_dump("all_gather")))
    (tmp_path / "fr_trace_rank1").write_bytes(pickle.dumps(hand_made_dump("all_reduce")))
    (tmp_path / "notes").write_text("not a dump")
    report0 = flight_recorder.dump_report(0, flight_recorder.read_dump(tmp_path / "fr_trace_rank0.json"))
    assert [(c.seq, c.op, c.step, c.phase, c.bucket) for c in report0.collectives] == [
        (1, "broadcast", None, "before the first backward", None), (2, "all_reduce", 0, "backward", 0),
        (3, "all_reduce", 0, "backward", 1), (4, "all_reduce", 1, "backward", 0), (5, "all_reduce", 2, "backward", 0),
        (6, "all_gather", 2, "after the backward", None),
    ]  # fmt: skip
    assert report0.collectives[0].where == "train.py:7 training_step: " and report0.collectives[1].where == ""
    assert (report0.rank, report0.kind, report0.step, report0.phase) == (0, "dump", 2, "after the backward")
    assert report0.where == "train.py:7 training_step: " and report0.collectives[0].sizes == [[4]]
    assert flight_recorder.flight_recorder_text(tmp_path).splitlines() == [
        f"Flight Recorder dumps of 2 rank(s) in {tmp_path}:",
        "rank 0: 6 collectives (4 DDP gradient bucket all-reduces in 3 backward pass(es)); the last, #6: "
        "all_gather Float[2, 2] (scheduled)",
        "rank 1: 6 collectives (4 DDP gradient bucket all-reduces in 3 backward pass(es)); the last, #6: "
        "all_reduce Float[2, 2] (scheduled)",
        "collective #6 diverged: rank 0 called all_gather Float[2, 2] at step 2, after the backward (train.py:7 "
        "training_step: ); rank 1 called all_reduce Float[2, 2] at step 2, after the backward (train.py:7 "
        "training_step: )",
    ]


def test_dumps_that_agree_say_so_and_an_empty_dump_reports_nothing(tmp_path):
    for rank in (0, 1):
        (tmp_path / f"dump{rank}").write_text(json.dumps(hand_made_dump("all_gather")))
    assert flight_recorder.flight_recorder_text(tmp_path).splitlines()[-1] == "every rank's record agrees"
    empty = flight_recorder.dump_report(3, {})
    assert (empty.rank, empty.where, empty.step, empty.phase, empty.collectives) == (3, "", None, "", [])


def test_the_world_size_is_the_default_groups_ranks_as_any_backend_keys_it():
    size = flight_recorder._world_size
    assert size({0: {"pg_config": {"0": {"ranks": "[0, 1, 2]"}}}}) == 3  # NCCL's key, its ranks a JSON string
    assert size({0: {"pg_config": {"": {"ranks": [0, 1]}}}}) == 2  # gloo's key, a list
    assert size({0: {"pg_config": {"7": {"desc": "default_pg", "ranks": [0, 1, 2, 3]}}}}) == 4  # named by its desc
    assert size({0: {"pg_config": {"7": {"desc": "a subgroup", "ranks": [0, 1]}}}}) == 0
    assert size({0: {"pg_config": {"0": {"ranks": "not json"}}}, 1: {"pg_config": {"0": {"ranks": [0]}}}}) == 0
    assert size({0: {"pg_config": {"0": {}}}}) == 0 and size({0: {}}) == 0 and size({}) == 0
    assert size({0: {"pg_config": {"0": "ranks"}}, 1: {"pg_config": {"0": {"ranks": [0, 1]}}}}) == 2  # not a dict


def test_an_entrys_frames_read_outermost_first_and_backward_is_autograds_engine():
    entry = {"frames": [{"filename": "/x/torch/autograd/graph.py", "line": 9, "name": "_engine_run_backward"},
                        {"filename": "/u/train.py", "line": 21, "name": "training_step"}, {}]}  # fmt: skip
    assert flight_recorder._frames(entry) == [flight_recorder.Frame("", 0, ""),
                                              flight_recorder.Frame("/u/train.py", 21, "training_step"),
                                              flight_recorder.Frame("/x/torch/autograd/graph.py", 9,
                                                                    "_engine_run_backward")]  # fmt: skip
    assert flight_recorder._frames({}) == [] and flight_recorder._frames({"frames": None}) == []
    assert flight_recorder.in_backward(entry)
    assert flight_recorder.in_backward({"frames": [{"filename": "/x/run_backward.py", "name": "f"}]})  # by its file
    assert not flight_recorder.in_backward({"frames": [{"filename": "/u/train.py", "name": "training_step"}]})
    assert not flight_recorder.in_backward({"frames": [{}]}) and not flight_recorder.in_backward({})


def test_dumps_without_a_group_size_count_up_to_the_highest_rank_and_name_the_one_missing(tmp_path):
    for rank in (0, 2):
        (tmp_path / f"dump{rank}").write_text(json.dumps(hand_made_dump("all_gather")))
    late = (
        "rank(s) [1] never arrived at the last collective; rank(s) [0, 2] waited there until the timeout (in "
        "collective #6, all_gather Float[2, 2] at step 2, after the backward (train.py:7 training_step: ); rank(s) "
        "[1] sent no report: late, not diverged)"
    )
    assert flight_recorder.flight_recorder_text(tmp_path).splitlines()[-1] == late
    assert flight_recorder.dumps_divergence(tmp_path) == late


def test_a_dump_without_entries_is_a_rank_with_no_collective():
    # a dump tells no time and no error
    assert flight_recorder.dump_report(3, {}) == flight_recorder.RankReport(3, 0.0, "dump")


def test_a_ranks_line_for_an_empty_dump(tmp_path):
    (tmp_path / "dump0").write_bytes(pickle.dumps({"version": "2.4"}))
    assert flight_recorder.flight_recorder_text(tmp_path).splitlines()[1:] == [  # no note on JSON's stacks
        "rank 0: 0 collectives (0 DDP gradient bucket all-reduces in 0 backward pass(es)); the last, #-: - ()",
        "every rank's record agrees",
    ]


def test_a_rank_whose_dump_is_empty_never_arrived_and_its_line_says_its_dump_holds_none(tmp_path):
    (tmp_path / "dump0").write_text(json.dumps(hand_made_dump("all_gather")))
    (tmp_path / "dump1").write_text(json.dumps({"version": "2.4"}))
    assert flight_recorder.flight_recorder_text(tmp_path).splitlines()[-1] == (
        "collective #1: rank 0 called broadcast Float[4] before the first backward (train.py:7 training_step: ); "
        "rank 1 never arrived: it left a Flight Recorder dump that holds no collective")  # fmt: skip


def test_a_dump_that_starts_in_a_backward_pass_counts_it_as_step_0():
    """The ring buffer forgot what came before: the oldest entry, a bucket's all-reduce, starts step 0, and a
    collective of the user's after it is after that step's backward."""
    dump = {"entries": [fr_entry(5, "all_reduce", [[9]], AUTOGRAD), fr_entry(6, "all_gather", [[1]], USER),
                        fr_entry(7, "all_reduce", [[9]], AUTOGRAD)]}  # fmt: skip
    got = flight_recorder.dump_report(0, dump).collectives
    assert [(c.seq, c.step, c.phase, c.bucket) for c in got] == [
        (5, 0, "backward", 0), (6, 0, "after the backward", None), (7, 1, "backward", 0)]  # fmt: skip


def test_the_users_line_is_read_from_its_file_past_other_libraries_frames():
    """A dump's frames hold no text: the line comes from the file, its comment cut; a frame of any installed
    package (site-packages) is a library's, however deep."""
    other = flight_recorder.Frame("/venv/lib/python3.11/site-packages/other/hooks.py", 3, "hook", "call()")
    frames = [flight_recorder.Frame(flight_dumps.__file__, LINE, "rank_main"), other]
    assert flight_recorder.user_frame(frames) == (
        f"flight_dumps.py:{LINE} rank_main: dist.all_reduce(torch.ones(1), async_op=True)"
    )


def test_a_dump_is_read_from_the_time_given_on_and_by_default_whenever_it_was_written(tmp_path):
    path = tmp_path / "dump0"
    path.write_text(json.dumps({**hand_made_dump("all_gather"), "pg_config": {"0": {"ranks": "[0, 1]"}}}))
    os.utime(path, (0.0, 0.0))  # a copy that kept no time: the epoch
    assert list(flight_recorder.read_dumps(tmp_path)) == [0]
    assert flight_recorder.dumps_divergence(tmp_path).startswith("rank(s) [1] never arrived at the last collective")
    os.utime(path, (1000.0, 1000.0))
    assert list(flight_recorder.read_dumps(tmp_path, since=1000.0)) == [0]
    assert flight_recorder.read_dumps(tmp_path, since=1000.5) == {}


def test_an_entry_with_only_its_number_and_the_groups_an_entry_without_one_belongs_to():
    """What an entry leaves out is left empty: no op, sizes, dtype, step, phase, bucket or line; a name without a
    backend's prefix is the op itself. An entry that names no group is the default group's; another group's and a
    point-to-point send are not."""
    assert flight_recorder.collective_of({"collective_seq_id": 4}) == flight_recorder.Collective(4, "", [], "")
    assert flight_recorder.collective_of({"collective_seq_id": 5, "profiling_name": "all_reduce"}).op == "all_reduce"
    entries = [{"collective_seq_id": 1}, {"collective_seq_id": 1, "pg_id": 1},
               {"collective_seq_id": 1, "pg_id": "0", "is_p2p": True}]  # fmt: skip
    assert flight_recorder.default_group(entries) == entries[:1]
