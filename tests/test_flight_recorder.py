"""``python -m lit_ddp.report --flight-recorder DIR`` on dumps that real torch code writes here: a 2-rank gloo DDP
job whose rank 1 calls one collective more (``tests/flight_dumps.py``)."""

import json
import os
import pickle
import re

import pytest
import torch

from lit_ddp import report
from lit_ddp.analysis import flight_recorder
from tests.runner import run_module


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fr")
    result = run_module("tests.flight_dumps", str(directory), cwd=directory, timeout=90)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in directory.iterdir()) == ["fr_trace_rank0", "fr_trace_rank1"]
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
        f"collective #{last + 1}: rank 1 called all_reduce Float[1] at step 2, after the backward (flight_dumps.py:26 "
        "rank_main: dist.all_reduce(torch.ones(1), async_op=True)); rank 0 never arrived: it had called only up to "
        f"#{last}, all_reduce Float[9] (DDP gradient bucket 0) at step 2, backward"
    )


def test_a_folder_without_dumps_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        report.main(["--flight-recorder", str(tmp_path)])
    assert exit_.value.code == 2
    assert f"--flight-recorder: {tmp_path}: no Flight Recorder dump" in capsys.readouterr().err


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
