"""The answer first (``lit_ddp.present.headline``): the end-of-fit block and ``report`` open with one line that says
what bounds the step, its share and the change the numbers back, or "can't tell" and why; then only the lines that
apply, and ``--detail`` brings back every one."""

import dataclasses
import random
import re

from lit_ddp import report
from lit_ddp.analysis.run_analysis import analyze
from lit_ddp.present import end_of_fit
from lit_ddp.present.headline import headline
from lit_ddp.records.schema import DDPMemory, Roofline, save
from tests.records import phase_record
from tests.test_analysis import comm_bound_case, noisy_steps

HELD = DDPMemory(4_198_400, 4_198_400, [4_198_400], False, 8_396_800, 25 * 2**20)  # DDP's own, one bucket
DETAIL_ONLY = ("each rank sends 2(n-1)/n x S", "bucket_cap_mb (", "of peak")


def test_a_profiled_fit_opens_its_end_of_fit_block_with_the_headline_in_at_most_25_lines(profile_run):
    out = profile_run.result.stdout
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Phase times")) - 1
    end = next(i for i, line in enumerate(lines) if line.startswith("Record in "))
    block = lines[start : end + 1]
    assert re.match(r"(Bound by .+ \(\d+%\): |Can't tell what bounds the step: )", block[0]), block[0]
    assert len(block) <= 25, "\n".join(block)
    assert not any(text in out for text in DETAIL_ONLY), out  # no peak known on CPU, no ring formula, no cap note
    assert "CPUAllocator" not in profile_run.result.stderr  # torch's line per rank for a block freed while profiled


def test_a_communication_bound_step_heads_with_the_all_reduce_and_the_forecast_change():
    phases, comm = comm_bound_case()
    comm.ddp_memory = HELD
    analysis = analyze(phases, comm)
    line = headline(analysis)
    assert re.fullmatch(r"Bound by the all-reduce \(95%\): fp16 compression \(CommMonitor\(compression=fp16\): half "
                        r"the bytes\), forecast 35\d\.\d\d ms -> 1[89]\d\.\d\d ms", line), line  # fmt: skip
    none = dataclasses.replace(analysis, savings={})
    assert headline(none).endswith("fp16 compression halves its bytes (python -m lit_ddp.report RUN --forecast N "
                                   "forecasts it)")  # fmt: skip
    # ... and the compression what-if line of the table is there, since it changes the answer
    assert "fp16/bf16 compression (CommMonitor(compression)) would halve" in "\n".join(end_of_fit.tables(analysis))


def test_a_bound_without_a_figure_names_the_change_to_try_and_says_no_figure_backs_it():
    rng = random.Random(0)
    update_bound = analyze(phase_record([noisy_steps(rng, 40, (1.0, 2.0, 8.0, 0.5))]), None)
    assert headline(update_bound) == (
        "Bound by the optimizer's step (70%): try a fused or foreach optimizer step (fused=True for torch's Adam, "
        "AdamW, SGD); no figure here backs one change"
    )


def test_can_t_tell_says_why():
    rng = random.Random(0)
    level = analyze(phase_record([noisy_steps(rng, 40, (4.0, 4.1, 1.0, 0.5), sd=1.0)]), None)
    assert re.fullmatch(r"Can't tell what bounds the step: (forward|backward)'s compute \(4\d%\) and "
                        r"(forward|backward)'s compute \(4\d%\) are level within the noise \(.* apart, 39 steps\)",
                        headline(level))  # fmt: skip
    close = analyze(phase_record([noisy_steps(rng, 40, (4.0, 4.4, 1.0, 0.2), sd=0.05)]), None)
    assert headline(close).endswith("per step (39 steps), not surely by 10% of the step")
    few = analyze(phase_record([[(1.0, 2.0, 3.0, 0.5)] * 3]), None)
    assert headline(few) == "Can't tell what bounds the step: only 2 steady step(s) were kept"
    assert headline(analyze(None, comm_bound_case()[1])) is None  # no phase record: the all-reduce table opens


def test_by_default_only_the_lines_that_apply_and_with_detail_every_one(tmp_path, capsys):
    phases, comm = comm_bound_case()
    comm.ddp_memory = HELD
    phases.roofline = Roofline(4, 2e9, 4e9, 3e8)  # no peak known
    analysis = dataclasses.replace(analyze(phases, comm), savings={})
    short, full = ("\n".join(end_of_fit.tables(analysis, detail=d)) for d in (False, True))
    assert not any(text in short for text in DETAIL_ONLY), short
    assert all(text in full for text in DETAIL_ONLY), full
    assert short.splitlines()[0] == full.splitlines()[0] == headline(analysis)
    save(phases, tmp_path / "phases.json"), save(comm, tmp_path / "comm.json")
    for flags, shown in (([], False), (["--detail"], True)):
        assert report.main([str(tmp_path), "--no-plot", *flags]) == 0
        out = capsys.readouterr().out
        assert out.startswith("Bound by the all-reduce (95%)") and ("bucket_cap_mb (" in out) is shown, out


def test_fit_s_detail_reaches_the_ranks_through_the_environment(monkeypatch):
    monkeypatch.delenv(end_of_fit.DETAIL_ENV, raising=False)
    assert not end_of_fit.detail_asked()
    monkeypatch.setenv(end_of_fit.DETAIL_ENV, "1")
    assert end_of_fit.detail_asked()


def test_fit_takes_detail_on_its_command_line():
    from lit_ddp.fit import build_cli

    cpu = ["--trainer.accelerator", "cpu", "--devices", "1"]
    assert build_cli([*cpu, "--detail"]).config.detail and not build_cli(cpu).config.detail
