"""One optimizer step's phases from the marks PhaseTimer makes (``lit_ddp.measure.step_marks``), on hand-made marks:
numbers for times, their difference for the clock."""

from types import SimpleNamespace

import pytest
import torch

from lit_ddp.measure.step_marks import OptimizerSteps, StepMarks, Updates, close_micro_batch, phases_of
from lit_ddp.records import phases as phase_table
from lit_ddp.records.phases import StepPhases


def elapsed(a: float, b: float) -> float:
    return b - a


def micro(start: float, forward: float, backward: float, update: float | None, data: float, end: float) -> dict:
    """A micro-batch's marks: forward and backward take ``forward``/``backward`` ms, the update (the last one
    only) ``update``, and the data span starts ``data`` ms before ``end``."""
    marks = {"start": start, "forward_start": start + 1.0, "forward_end": start + 1.0 + forward}
    marks["backward_start"] = marks["forward_end"]
    marks["backward_end"] = marks["backward_start"] + backward
    if update is not None:
        marks["update_start"], marks["update_end"] = marks["backward_end"], marks["backward_end"] + update
    marks["data_start"], marks["end"] = end - data, end
    return marks


@pytest.mark.timeout(10)
def test_each_phase_sums_its_spans_over_the_micro_batches_and_other_is_the_rest():
    step = StepMarks(3, [micro(100.0, 4.0, 6.0, None, 2.0, 115.0), micro(115.0, 5.0, 8.0, 3.0, 1.0, 140.0)])
    assert step.complete() and step.end == 140.0
    phases, offsets, outside = phases_of(step, elapsed)
    assert phases == StepPhases(forward=9.0, backward=14.0, update=3.0, other=11.0, step=40.0, data=3.0,
                                backward_last=8.0)  # fmt: skip
    # Each boundary where the last micro-batch that has it put it: update only in the last, data_start too.
    assert list(offsets.values()) == [16.0, 21.0, 21.0, 29.0, 29.0, 32.0, 39.0, 40.0]
    assert tuple(offsets) == phase_table.boundaries() and outside == {}


@pytest.mark.timeout(10)
def test_work_outside_the_step_is_taken_out_of_the_step_and_of_its_data_span():
    """Validation between two batches (inside the data span): 6 ms of the step's 40, reported apart."""
    marks = [micro(100.0, 4.0, 6.0, None, 10.0, 115.0), micro(115.0, 5.0, 8.0, 3.0, 1.0, 140.0)]
    step = StepMarks(3, marks, outside=[("validation", 106.0, 110.0), ("validation", 110.0, 112.0)])
    phases, _, outside = phases_of(step, elapsed)
    assert outside == {"validation": [4.0, 2.0]}
    assert (phases.step, phases.data) == (34.0, 5.0) and phases.other == pytest.approx(34.0 - 9 - 14 - 3 - 5)
    more_than_data = StepMarks(3, [micro(100.0, 4.0, 6.0, 3.0, 2.0, 115.0)], outside=[("validation", 106.0, 111.0)])
    assert phases_of(more_than_data, elapsed)[0].data == 0.0  # never below zero


@pytest.mark.timeout(10)
def test_a_step_missing_a_mark_is_incomplete_and_a_micro_batch_without_backward_adds_none():
    whole = micro(0.0, 4.0, 6.0, 3.0, 2.0, 20.0)
    assert StepMarks(0, [whole]).complete()
    for missing in ("start", "forward_end", "backward_start", "backward_end", "update_start", "update_end"):
        assert not StepMarks(0, [{k: v for k, v in whole.items() if k != missing}]).complete(), missing
    assert StepMarks(0, [{k: v for k, v in whole.items() if k not in ("data_start", "end")}]).complete()
    # The last micro-batch ran no backward: the backward DDP all-reduced after is the one before, and so are its
    # boundaries.
    last = {k: v for k, v in micro(20.0, 5.0, 0.0, None, 1.0, 30.0).items() if not k.startswith("backward")}
    phases, offsets, _ = phases_of(StepMarks(0, [whole, last]), elapsed)
    assert (phases.backward, phases.backward_last, phases.forward, phases.update) == (6.0, 6.0, 9.0, 3.0)
    assert list(offsets.values())[2:4] == [5.0, 11.0]


@pytest.mark.timeout(10)
def test_closing_a_micro_batch_ends_it_and_fills_what_was_never_marked():
    closed = close_micro_batch({"start": 5.0, "backward_start": 6.0}, 9.0)
    assert closed == {"start": 5.0, "forward_start": 5.0, "backward_start": 6.0, "data_start": 9.0, "end": 9.0}
    kept = close_micro_batch({"start": 5.0, "forward_start": 5.5, "data_start": 8.0}, 9.0)
    assert (kept["forward_start"], kept["data_start"], kept["end"]) == (5.5, 8.0, 9.0)


@pytest.mark.timeout(10)
def test_a_batch_ended_an_optimizer_step_when_the_global_step_moved_while_it_ran():
    trainer, steps = SimpleNamespace(global_step=4), OptimizerSteps()
    assert not steps.ended(SimpleNamespace(global_step=0))  # nothing started: step 0 still
    steps.batch_start(trainer)
    assert not steps.ended(trainer)  # an accumulating micro-batch
    trainer.global_step = 5
    assert steps.ended(trainer)


@pytest.mark.timeout(10)
def test_an_update_is_skipped_when_fewer_ran_than_began_and_each_step_starts_afresh():
    fresh = Updates()
    fresh.begin()
    assert fresh.skipped() is True  # the first step's update never ran
    updates = Updates()
    updates.begin()
    updates.ran(SimpleNamespace())  # an optimizer without the scaler's found_inf
    assert updates.skipped() is False and (updates.begun, updates._ran) == (0, 0)
    updates.begin()
    updates.begin()
    updates.ran(SimpleNamespace())
    assert updates.skipped() is True  # manual optimization: two optimizers began, one stepped
    updates.begin()  # the scaler called no optimizer.step()
    assert updates.skipped() is True
    updates.begin()
    updates.ran(SimpleNamespace())
    assert updates.skipped() is False  # the last step's counts are gone


@pytest.mark.timeout(10)
def test_a_fused_optimizers_found_inf_tells_on_its_device_when_every_update_ran():
    updates = Updates()
    for found in (torch.tensor([0.0]), torch.tensor(2.0)):  # one per optimizer, as the scaler sets it
        updates.begin()
        updates.ran(SimpleNamespace(found_inf=found))
    skipped = updates.skipped()
    assert isinstance(skipped, torch.Tensor) and skipped.shape == (1,) and bool(skipped)
    updates.begin()
    updates.ran(SimpleNamespace(found_inf=torch.tensor([1.0])))
    assert updates.skipped().tolist() == [True]
    updates.begin()
    updates.ran(SimpleNamespace(found_inf=torch.tensor([0.0])))
    assert updates.skipped().tolist() == [False] and updates._found_inf == []
    updates.begin()
    updates.begin()
    updates.ran(SimpleNamespace(found_inf=torch.tensor([0.0])))
    assert updates.skipped() is True  # one never ran: a bool, whatever the other's found_inf says


@pytest.mark.timeout(10)
def test_a_span_whose_ends_fell_in_two_micro_batches_adds_nothing():
    """Each span counts within one micro-batch: a backward begun in one and ended in the next is no backward."""
    first = micro(0.0, 4.0, 6.0, None, 2.0, 20.0)
    del first["backward_end"], first["forward_end"]
    second = micro(20.0, 5.0, 6.0, 3.0, 1.0, 40.0)
    del second["backward_start"]
    phases, _, _ = phases_of(StepMarks(0, [first, second]), elapsed)
    assert (phases.forward, phases.backward, phases.backward_last) == (5.0, 0.0, 0.0)
