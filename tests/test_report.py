"""``python -m lit_ddp.report RUN_DIR``: the tables again from a run's timing JSON, and the picture."""

import sys

import pytest
from matplotlib.collections import LineCollection

from lit_ddp import report
from lit_ddp.analysis.run_analysis import analyze
from lit_ddp.present import plots
from lit_ddp.records import phases as step_phases
from lit_ddp.records.phases import StepPhases
from lit_ddp.records.schema import PhaseRecord, StepRow, load_run, save
from tests.records import phase_record
from tests.trainers import profile


def test_report_reprints_the_tables_and_draws_the_picture(make_trainer, tmp_path, capsys):
    _, _, _, log_dir = profile(make_trainer, tmp_path, dim=64, steps=3)
    assert report.main([str(log_dir)]) == 0
    out = capsys.readouterr().out
    assert "Phase times (perf_counter: host time), 2 rank(s)" in out and "Gradient all-reduce per step" in out
    png = log_dir / "phases.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    # Every line and segment of the timeline has its legend entry: "other", the all-reduces, backward's end.
    phases, comm = load_run(log_dir)
    timeline = plots.phases_figure(analyze(phases, comm)).axes[1]
    lines = [c for c in timeline.collections if isinstance(c, LineCollection)]
    assert len(lines) == 2 and [line.get_label() for line in lines[:1]] == ["last gradient ready"]
    legend = [t.get_text() for t in timeline.get_legend().get_texts()]
    assert legend == [
        "other",
        *step_phases.names()[:4],
        "all-reduce (one per bucket)",
        "exposed",
        "last gradient ready",
    ], legend
    # The dashed line is where the last bucket was handed over (the exposed part starts there), not the backward
    # phase's end, which comes after DDP's wait for that bucket's all-reduce.
    step = int(timeline.get_title().split()[3])
    for rank, line in enumerate(lines):
        marks = phases.ranks[rank].row(step).offsets_ms
        buckets = next(b for b in comm.ranks[rank].rows if b.step == step)
        backward_start = marks["backward_start"]
        assert line.get_segments()[0][0, 0] == pytest.approx(backward_start + max(buckets.ready_ms))
        assert line.get_segments()[0][0, 0] < marks["backward_end"]


def test_report_refuses_a_directory_without_timings(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        report.main([str(tmp_path)])
    assert exit_info.value.code == 2
    assert "neither phases.json nor comm.json" in capsys.readouterr().err


def test_a_loggers_folder_names_its_runs_versions(tmp_path, capsys):
    """``report runs/mini_train_profile`` (the logger's folder): the versions under it, numbered in order."""
    record = phase_record([[(1.0, 2.0, 0.5, 0.25)] * 4])
    for version in (0, 2, 10):
        save(record, tmp_path / f"version_{version}" / "phases.json")
    (tmp_path / "version_1").mkdir()  # a run without a record: not one to give
    with pytest.raises(SystemExit) as exit_info:
        report.main([str(tmp_path)])
    assert exit_info.value.code == 2
    runs = ", ".join(str(tmp_path / f"version_{v}") for v in (0, 2, 10))
    assert capsys.readouterr().err.strip().endswith(f"{tmp_path} is a folder of runs: give one of {runs}")


def steps_with_boundaries(per_step: list[tuple[float, float, float, float]]) -> list[StepRow]:
    """Steps whose phases follow each other from the start, with every boundary PhaseTimer marks."""
    rows = []
    for step, (forward, backward, update, other) in enumerate(per_step):
        total = forward + backward + update + other
        ends = [0.0, forward, forward, forward + backward, forward + backward, forward + backward + update,
                forward + backward + update, total]  # fmt: skip
        marks = dict(zip(step_phases.boundaries(), ends, strict=True))
        rows.append(StepRow(step, StepPhases(forward=forward, backward=backward, update=update, other=other,
                                             step=total), marks))  # fmt: skip
    return rows


def warm_record() -> PhaseRecord:
    """Two ranks, a warm-up 50x the steady 40 ms step, steps 2-4 profiled."""
    per_step = [(500.0, 1000.0, 400.0, 100.0)] + [(10.0, 20.0, 8.0, 2.0)] * 7
    record = phase_record([per_step, per_step], profiled=[2, 3, 4])
    for rank in record.ranks:
        rank.rows = steps_with_boundaries(per_step)
    return record


def test_the_picture_keeps_the_steady_steps_readable_and_marks_the_profiled_ones():
    bars, timeline = plots.phases_figure(analyze(warm_record(), None)).axes
    assert 40.0 < bars.get_ylim()[1] < 100.0  # the steady 40 ms steps fill the axis; step 0's 2 s does not
    assert [t.get_text() for t in bars.texts] == ["2.00 s ↑"] and "clipped" in bars.get_title()
    assert "0: warm-up" in bars.get_xlabel()
    legend = [t.get_text() for t in bars.get_legend().get_texts()]
    assert legend == ["profiled: steps 2-4", *step_phases.with_step()[:-1]], legend
    assert "other" in [t.get_text() for t in timeline.get_legend().get_texts()]


def test_without_matplotlib_report_prints_its_tables_says_how_to_get_the_picture_and_exits_0(
    tmp_path, capsys, monkeypatch
):
    save(warm_record(), tmp_path / "phases.json")
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails as if matplotlib were missing
    assert report.main([str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "Phase times (perf_counter: host time), 2 rank(s)" in out
    assert err.splitlines() == [
        "no phases.png: matplotlib is missing (pip install 'lit_ddp[plot]'); the text above is complete"
    ]
    assert not (tmp_path / "phases.png").exists()


def test_without_a_logger_the_record_goes_to_the_trainer_s_root_directory(tmp_path, monkeypatch, caplog):
    from lightning.pytorch import Trainer

    from lit_ddp import FixedBatchDataModule, LinearRegression, PhaseTimer

    elsewhere, root = tmp_path / "cwd", tmp_path / "root"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                      callbacks=[PhaseTimer(print_steps=0)])  # fmt: skip
    with caplog.at_level("INFO"):
        trainer.fit(LinearRegression(dim=8), FixedBatchDataModule(dim=8, batch_size=4))
    assert (root / "phases.json").is_file() and list(elsewhere.iterdir()) == []
    assert f"Record in {root} (phases.json); the tables again: python -m lit_ddp.report {root}" in caplog.text
