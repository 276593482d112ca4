"""``python -m lit_ddp.report RUN_DIR``: the tables again from a run's timing JSON, and the picture."""

import pytest

from lit_ddp import report
from tests.trainers import profile


def test_report_reprints_the_tables_and_draws_the_picture(make_trainer, tmp_path, capsys):
    _, _, _, log_dir = profile(make_trainer, tmp_path, dim=64, steps=3)
    assert report.main([str(log_dir)]) == 0
    out = capsys.readouterr().out
    assert "Phase times (perf_counter: host time), 2 rank(s)" in out and "Gradient all-reduce per step" in out
    png = log_dir / "phases.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_report_refuses_a_directory_without_timings(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        report.main([str(tmp_path)])
    assert exit_info.value.code == 2
    assert "neither phases.json nor comm.json" in capsys.readouterr().err
