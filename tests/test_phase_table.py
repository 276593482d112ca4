"""The phases' one table (``lit_ddp.records.phases``): a phase added there, with the hook that marks it, reaches the
record, the tables, the plot, the profiler's ranges and the forecast with nothing else changed; and no module outside
``records`` names a phase but the renderers' labels."""

import ast
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from lit_ddp.analysis.run_analysis import analyze
from lit_ddp.callbacks import PhaseTimer
from lit_ddp.lab.module import LinearRegression
from lit_ddp.measure import profiling
from lit_ddp.present import plots
from lit_ddp.present.headline import headline
from lit_ddp.present.phases import phase_table
from lit_ddp.records import phases
from lit_ddp.records import schema as record
from lit_ddp.scaling.model import measured
from tests.records import comm_record
from tests.test_phase_timer import FakeTrainer, drive_one_step

PACKAGE = Path(__file__).resolve().parents[1] / "lit_ddp"

# A test-only phase: the gradients' reset, from Lightning's zero_grad to the backward's start; torch's own range for
# it in another tool's profile reads back as it.
ZERO_GRAD = phases.Phase("zero_grad", "zero_grad_start", "zero_grad_end", "lit_ddp.zero_grad", "the gradients' reset",
                         "#123456", read_from=(r"Optimizer\.zero_grad#\w+\.zero_grad",))  # fmt: skip


class ZeroGradTimer(PhaseTimer):
    """PhaseTimer with the hook that marks the test's phase (Lightning's on_before_zero_grad, then the backward)."""

    def on_before_zero_grad(self, trainer, pl_module, optimizer) -> None:
        super().on_before_zero_grad(trainer, pl_module, optimizer)
        self._fit.mark_once("zero_grad_start")

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self._fit.mark_once("zero_grad_end")
        super().on_before_backward(trainer, pl_module, loss)


@pytest.fixture
def with_zero_grad(monkeypatch):
    """The table with the test's phase after forward: one row more."""
    table = list(phases.TABLE)
    table.insert(1, ZERO_GRAD)
    monkeypatch.setattr(phases, "TABLE", tuple(table))


@pytest.mark.timeout(30)
def test_a_phase_added_to_the_table_reaches_the_record_the_tables_and_the_plot(with_zero_grad, monkeypatch, tmp_path):
    clock = SimpleNamespace(now=100.0)
    monkeypatch.setattr("lit_ddp.measure.clock.perf_counter", lambda: clock.now)
    model = LinearRegression(dim=8)
    trainer = FakeTrainer(model, tmp_path)
    timer = ZeroGradTimer(print_steps=0)
    timer.on_train_start(trainer, model)
    for _ in range(8):
        drive_one_step(timer, trainer, model, clock)
    trainer.train_end(model, timer)
    # The record: the phase's time in every step, its marks by name, its summary; read back as written.
    loaded = record.load(tmp_path / "phases.json")
    assert loaded.ranks[0].rows
    for row in loaded.ranks[0].rows:
        assert row.ms["zero_grad"] == pytest.approx(1.0, abs=1e-6)  # drive_one_step: 1 ms from zero_grad
        assert row.ms.other == pytest.approx(4.0, abs=1e-6)  # 5 ms without the phase, 1 of them now its
        assert row.offsets_ms["zero_grad_end"] - row.offsets_ms["zero_grad_start"] == pytest.approx(1.0, abs=1e-6)
    assert loaded.ranks[0].summaries["zero_grad"].median == pytest.approx(1.0, rel=0.01)
    # The tables: a row of its own, between forward and backward.
    analysis = analyze(loaded, None)
    names = [line.split()[0] for line in phase_table(analysis).splitlines()[2:9]]
    assert names == ["forward", "zero_grad", "backward", "update", "data", "other", "step"], names
    # The headline, where it bounds the step (500 ms of each step's): named, with no change of its own to try.
    slow = replace(
        loaded,
        ranks=[
            replace(
                loaded.ranks[0],
                rows=[
                    replace(row, ms=record.StepPhases({**row.ms, "zero_grad": 500.0})) for row in loaded.ranks[0].rows
                ],
            )
        ],
    )
    assert headline(analyze(slow, None)).startswith("Bound by zero_grad (")
    # The plot: a bar of its own in its colour, and its span in the timeline.
    pytest.importorskip("matplotlib")
    figure = plots.phases_figure(analysis)
    bars, timeline = figure.axes
    assert "zero_grad" in [t.get_text() for t in bars.get_legend().get_texts()]
    coloured = [c for c in timeline.collections if c.get_label() == "zero_grad"]
    assert coloured and tuple(coloured[0].get_facecolor()[0][:3]) == pytest.approx((0x12 / 255, 0x34 / 255, 0x56 / 255))
    # The profiler: the range PhaseTimer opens at its mark, and reads back as the phase.
    assert profiling.opens()["zero_grad_start"] == "lit_ddp.zero_grad"
    assert phases.read_as("lit_ddp.zero_grad") == "zero_grad"
    assert phases.read_as("Optimizer.zero_grad#AdamW.zero_grad") == "zero_grad"  # another tool's range
    # The forecast: a phase its model is not built of counts with the rest of the step.
    comm = comm_record([[record.StepBuckets(row.step, [1024], [0.5], [1.0], 0.5, 0.1) for row in loaded.ranks[0].rows]],
                       param_bytes=1024)  # fmt: skip
    inputs = measured(loaded, comm)
    summaries = loaded.ranks[0].summaries
    assert inputs.other_ms == pytest.approx(sum(summaries[p].median for p in ("zero_grad", "data", "other")))
    assert inputs.forward_ms == pytest.approx(10.0, rel=0.01)


def test_without_the_row_the_same_marks_make_no_phase(tmp_path, monkeypatch):
    """The table is the only place: the same hook with the table as it ships adds no phase (the marks are dropped,
    its time stays in other)."""
    clock = SimpleNamespace(now=100.0)
    monkeypatch.setattr("lit_ddp.measure.clock.perf_counter", lambda: clock.now)
    model = LinearRegression(dim=8)
    trainer = FakeTrainer(model, tmp_path)
    timer = ZeroGradTimer(print_steps=0)
    timer.on_train_start(trainer, model)
    for _ in range(3):
        drive_one_step(timer, trainer, model, clock)
    trainer.train_end(model, timer)
    row = record.load(tmp_path / "phases.json").ranks[0].rows[-1]
    assert "zero_grad" not in row.ms and row.ms.other == pytest.approx(5.0, abs=1e-6)
    assert "zero_grad_start" not in row.offsets_ms


def test_the_roles_are_rows_of_the_table():
    for role in (phases.FORWARD, phases.BACKWARD, phases.UPDATE, phases.REMAINDER, phases.ALL_REDUCING):
        assert role in phases.names(), role
    assert [p.name for p in phases.TABLE if p.opens is None] == [phases.REMAINDER]


def test_other_tools_ranges_read_as_their_phase():
    assert phases.read_as("lit_ddp.update") == "update"
    assert phases.read_as("## Backward ##") == "backward"
    assert phases.read_as("[pl][profile][Strategy]DDPStrategy.training_step") == "forward"
    assert phases.read_as("Optimizer.step#AdamW.step") == "update"
    assert phases.read_as("Optimizer.step#AdamW.step and more") is None  # the whole name or nothing
    assert phases.read_as("aten::mm") is None


# A phase's name as a string outside ``records`` that is no phase: (the module under lit_ddp/, the string) -> why.
# The renderers (present/) are free to label with the names; everything else reads the table.
NOT_THE_PHASE = {
    ("derive/trace.py", "other"): "a collective's kind beside the gradient all-reduce",
    ("run/arguments.py", "data"): "LightningCLI's data key",
}


def phase_names_outside_records(root: Path) -> set[tuple[str, str]]:
    """(module, phase name) for each string literal that is a phase's name, in the package's modules outside
    ``records/`` and ``present/``."""
    found = set()
    for path in root.rglob("*.py"):
        module = path.relative_to(root).as_posix()
        if module.startswith(("records/", "present/")):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and node.value in phases.names():
                found.add((module, node.value))
    return found


def test_outside_records_a_phase_is_named_only_by_the_renderers():
    named = phase_names_outside_records(PACKAGE)
    assert named <= set(NOT_THE_PHASE), sorted(named - set(NOT_THE_PHASE))


def test_a_phase_named_outside_the_table_is_found(tmp_path):
    planted = tmp_path / "measure"
    planted.mkdir()
    (planted / "spans.py").write_text('SPANS = {"update": 0}\nTEXT = "forward and update"\n')
    assert phase_names_outside_records(tmp_path) == {("measure/spans.py", "update")}
