"""``python -m lit_ddp.report --flight-recorder DIR`` on dumps that real torch code writes here: a 2-rank gloo DDP
job whose rank 1 calls one collective more (``tests/flight_dumps.py``)."""

import re

import pytest

from lit_ddp import report
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
