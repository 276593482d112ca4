"""The run's record (``lit_ddp.records.schema``): the quantile sketch against exact quantiles, merging, the bounded
window of kept steps, the JSON round trip of both records, and the one-line refusal of a record of another schema (by
``load`` and by ``python -m lit_ddp.report``)."""

import dataclasses
import json
import math
import random
import types
import typing

import pytest

from lit_ddp import report
from lit_ddp.errors import RecordError
from lit_ddp.records import phases
from lit_ddp.records import schema as record
from lit_ddp.records.phases import StepPhases
from lit_ddp.records.schema import Roofline, Sketch, StepBuckets
from lit_ddp.records.steps import HEAD_STEPS, TAIL_STEPS, Window
from tests.records import comm_record, phase_record
from tests.runner import ROOT

QUANTILES = (0.0, 0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)


def distributions() -> dict[str, list[float]]:
    rng = random.Random(0)
    return {
        "uniform": [rng.uniform(0.1, 100.0) for _ in range(1000)],
        "lognormal, 8 decades": [rng.lognormvariate(0.0, 3.0) for _ in range(2000)],
        "negatives, zeros and positives": [rng.gauss(0.0, 5.0) for _ in range(500)] + [0.0] * 60,
        "all negative": [-rng.lognormvariate(1.0, 1.0) for _ in range(300)],
        "constant": [3.7] * 11,
        "two values": [1.0, 2.0],
    }


def exact_quantile(values: list[float], q: float) -> float:
    """The order statistic the sketch estimates: the ``floor(q (n - 1))``-th smallest value (for an even count the
    median is the lower of the two middle values, not their mean)."""
    return sorted(values)[math.floor(q * (len(values) - 1))]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("name", list(distributions()))
def test_summary_quantiles_are_within_the_relative_accuracy(name):
    values = distributions()[name]
    summary = Sketch.of(values)
    for q in QUANTILES:
        exact = exact_quantile(values, q)
        assert abs(summary.quantile(q) - exact) <= Sketch.RELATIVE_ACCURACY * abs(exact) + 1e-12, (q, exact)
    assert summary.median == summary.quantile(0.5)
    assert (summary.count, summary.min, summary.max) == (len(values), min(values), max(values))
    assert summary.mean == pytest.approx(sum(values) / len(values))
    if 0.0 in values:  # zeros are counted apart, and come back as exact zeros
        zeros = [q for q in QUANTILES if exact_quantile(values, q) == 0.0]
        assert zeros and all(summary.quantile(q) == 0.0 for q in zeros)


@pytest.mark.timeout(10)
def test_an_empty_summary_and_nan():
    empty = Sketch.of([math.nan])  # a NaN is not a time: left out
    assert empty.count == 0 and math.isnan(empty.median) and math.isnan(empty.mean)


@pytest.mark.timeout(10)
def test_merge_equals_the_summary_of_the_concatenation():
    parts = list(distributions().values())
    merged = Sketch.merged([Sketch.of(p) for p in parts] + [Sketch()])  # an empty one changes nothing
    whole = Sketch.of(v for p in parts for v in p)
    assert {**merged.to_json(), "total": None} == {**whole.to_json(), "total": None}
    assert merged.total == pytest.approx(whole.total)  # summed in another order
    assert [merged.quantile(q) for q in QUANTILES] == [whole.quantile(q) for q in QUANTILES]


@pytest.mark.timeout(10)
def test_window_keeps_the_head_the_profiled_steps_and_the_tail():
    profiled = range(HEAD_STEPS - 2, HEAD_STEPS + 5)  # kernel_steps running past the head
    window = Window(profiled)
    for step in range(200):
        window.add(step, f"row {step}")
    kept = [step for step, _ in window.items()]
    assert kept == [*range(HEAD_STEPS + 5), *range(200 - TAIL_STEPS, 200)]
    assert all(row == f"row {step}" for step, row in window.items())
    short = Window()
    for step in range(HEAD_STEPS + TAIL_STEPS):  # a run as long as the window loses nothing
        short.add(step, step)
    assert [step for step, _ in short.items()] == list(range(HEAD_STEPS + TAIL_STEPS))


def plain(value):
    """A record as plain data with its types, Summaries by their contents (a Sketch compares by identity)."""
    if isinstance(value, Sketch):
        return "Sketch", value.to_json()
    if dataclasses.is_dataclass(value):
        return type(value).__name__, {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, StepPhases):
        return "StepPhases", dict(value)
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def records():
    roof = Roofline(rows_per_rank=32, forward_flop=2e9, backward_flop=4e9, update_bytes=1.6e7, peak_tflops=989.0,
                    peak_gbps=3350.0, peak_label="H100 SXM, bf16")  # fmt: skip
    steps = [(1.5, 3.25, 0.5, 0.125), (1.0, 2.0, 0.5, 0.0), (40.0, 60.0, 30.0, 10.0), (1.25, 2.5, 0.75, -0.01)]
    phases = phase_record([steps, steps[::-1]], profiled=[2], clock="cuda_event", roofline=roof,
                          busy=[(0.75, 1.5, 0.25, 0.0)])  # fmt: skip

    def buckets(rank):  # step 0 on DDP's construction-time layout
        return [
            StepBuckets(0, [1000], [2.0], [7.0], 2.0, 2.0),
            *(StepBuckets(s, [400, 600], [0.5, 0.75 + rank], [1.0, 3.0], 1.0, 0.5 * s) for s in (1, 2, 3)),
        ]

    comm = comm_record([buckets(0), buckets(1)], param_bytes=2000, profiled=[2], compression="bf16")
    return phases, comm


@pytest.mark.timeout(10)
def test_both_records_survive_a_json_round_trip(tmp_path):
    phases, comm = records()
    short = phase_record([[(1.0, 2.0, 0.5, 0.25)]])  # a 1-step run: empty summaries
    for name, original in (("phases.json", phases), ("comm.json", comm), ("short.json", short)):
        path = record.save(original, tmp_path / name)
        assert json.loads(path.read_text())["schema"] == record.SCHEMA_VERSION
        loaded = record.load(path)
        assert type(loaded) is type(original)
        assert plain(loaded) == plain(original), name
    loaded_phases, loaded_comm = record.load_run(tmp_path)
    assert plain(loaded_phases) == plain(phases) and plain(loaded_comm) == plain(comm)
    assert record.load_run(tmp_path / "nothing") == (None, None)
    assert record.load_run(str(tmp_path)) == (loaded_phases, loaded_comm)  # a str, as trainer.log_dir is


class Filler:
    """Builds any record dataclass with every field set, each leaf to a value no other leaf has and no default is
    (a counter), from the dataclass's own fields: a field added later is filled too, and two fields of one type
    swapped by a reader cannot load equal. Booleans can only differ from their default."""

    def __init__(self) -> None:
        self.count = 1000

    def next(self) -> int:
        self.count += 1
        return self.count

    def build(self, cls, **fixed):
        hints = typing.get_type_hints(cls)
        values = {f.name: fixed[f.name] if f.name in fixed else self.value(hints[f.name], f)
                  for f in dataclasses.fields(cls)}  # fmt: skip
        return cls(**values)

    def value(self, kind, f=None):
        origin, args = typing.get_origin(kind), typing.get_args(kind)
        if kind is bool:
            return not (f.default if f is not None and f.default is not dataclasses.MISSING else False)
        if kind is int:
            return self.next()
        if kind is float:
            return self.next() + 0.5
        if kind is str or kind is typing.Any:
            return f"s{self.next()}"
        if kind is Sketch:
            return Sketch.of([float(self.next()), float(self.next())])
        if dataclasses.is_dataclass(kind):
            return self.build(kind)
        if kind is StepPhases:  # keyed by the phase table's names, and a name it lacks (an added phase's)
            return StepPhases(
                {name: self.next() + 0.25 for name in (*phases.with_step(), phases.BACKWARD_LAST, "zero_grad")}
            )
        if origin in (typing.Union, types.UnionType):
            return self.value(next(a for a in args if a is not type(None)), f)
        if origin is list:
            return [self.value(args[0]), self.value(args[0])]
        if origin is dict:
            return {f"k{self.next()}": self.value(args[1]) for _ in range(2)}
        raise AssertionError(f"no filler for {kind!r}")


def leaves(value, path="record"):
    """(path, value) of every field below ``value``."""
    if dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            yield from leaves(getattr(value, f.name), f"{path}.{f.name}")
    elif isinstance(value, (dict, StepPhases)):
        for key, item in value.items():
            yield from leaves(item, f"{path}[{key!r}]")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from leaves(item, f"{path}[{i}]")
    else:
        yield path, value.to_json() if isinstance(value, Sketch) else value


@pytest.mark.timeout(10)
@pytest.mark.parametrize("cls", [record.PhaseRecord, record.CommRecord, record.OutOfMemory])
def test_every_field_set_and_distinct_survives_a_round_trip(cls, tmp_path):
    original = Filler().build(cls, kind=cls.kind)  # the kind tells load which record it is
    seen = {}
    for path, value in leaves(original):  # the filler's promise, checked: no two leaves alike (booleans apart)
        if not isinstance(value, bool) and not path.endswith(".kind"):
            assert repr(value) not in seen, (path, seen.get(repr(value)))
            seen[repr(value)] = path
    loaded = record.load(record.save(original, tmp_path / "record.json"))
    assert plain(loaded) == plain(original)
    # Each field's JSON read back alone, by its own class: every part of the record is read by field name.
    for f in dataclasses.fields(cls):
        part = getattr(original, f.name)
        if dataclasses.is_dataclass(part):
            assert plain(record.read(type(part), record.as_json(part))) == plain(part), f.name


@pytest.mark.timeout(10)
def test_a_missing_field_is_named_and_an_added_one_takes_its_default(tmp_path):
    phases, _ = records()
    written = json.loads(record.save(phases, tmp_path / "phases.json").read_text())
    del written["ranks"][1]["rows"][2]["step"]
    (tmp_path / "phases.json").write_text(json.dumps(written))
    with pytest.raises(RecordError) as refused:
        record.load(tmp_path / "phases.json")
    assert str(refused.value) == (f"{tmp_path / 'phases.json'}: a damaged run record (PhaseRecord.ranks[1].rows[2]:"
                                  " no 'step', a required field of StepRow)")  # fmt: skip
    written = record.as_json(phases)
    for old in ("skipped_count", "memory_source"):  # as a record written before these fields existed
        del written[old]
    del written["ranks"][0]["memory"]
    loaded = record.read(record.PhaseRecord, written)
    assert (loaded.skipped_count, loaded.memory_source, loaded.ranks[0].memory) == (0, None, [])
    assert plain(loaded.ranks[1]) == plain(phases.ranks[1])


def schema_1_run(run_dir):
    """What PhaseTimer and CommMonitor wrote before the record had a schema: untyped lists, no "schema" key."""
    run_dir.mkdir()
    (run_dir / "phases.json").write_text(json.dumps({
        "clock": "perf_counter", "world_size": 2, "steps": [0, 1], "phases": list(phases.with_step()),
        "ms": [[[1.0, 2.0, 0.5, 0.5, 4.0]] * 2] * 2}))  # fmt: skip
    (run_dir / "comm.json").write_text(json.dumps({
        "world_size": 2, "steps": [0, 1], "bucket_bytes": [400], "ms": [[[1.0]] * 2] * 2}))  # fmt: skip
    return run_dir


@pytest.mark.timeout(10)
def test_load_refuses_another_schema_in_one_line(tmp_path):
    old = schema_1_run(tmp_path / "old")
    with pytest.raises(RecordError) as refused:
        record.load(old / "phases.json")
    message = str(refused.value)
    assert "\n" not in message
    now = record.SCHEMA_VERSION
    reads = f"this lit_ddp reads schema {record.READS[0]} to {now}"
    assert message.startswith(f"{old / 'phases.json'}: run record schema 1; {reads}")
    for other in (record.READS[0] - 1, now + 1):  # the schema before the oldest read (2: no memory), a newer one
        written = tmp_path / f"schema{other}.json"
        written.write_text(json.dumps({"schema": other, "kind": "phases"}))
        with pytest.raises(RecordError, match=f"run record schema {other}; {reads}"):
            record.load(written)
    damaged = json.dumps({"schema": now, "kind": "phases"})
    for text, why in (("{", "not a readable run record"), (damaged, "a damaged run record")):
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        with pytest.raises(RecordError, match=why) as refused:
            record.load(bad)
        assert "\n" not in str(refused.value)


@pytest.mark.timeout(10)
def test_a_schema_3_record_loads_as_before_without_the_steps_starts():
    """tests/data's real record was written by schema 3: it loads field by field, the fields of 4 as None."""
    old = ROOT / "tests" / "data" / "two_nodes_100mbit"
    assert json.loads((old / "phases.json").read_text())["schema"] == 3
    phases, comm = record.load_run(old)
    assert phases.steps and all(row.start_s is None for rank in phases.ranks for row in rank.rows)
    assert phases.ended_by is None
    assert comm.ranks[0].rows[0].arrival_s  # the arrivals were on the host clock already


@pytest.mark.timeout(60)
def test_report_exits_2_with_that_one_line(tmp_path, capsys):
    """In this process: what ``python -m lit_ddp.report`` runs (its exit through ``sys.exit(main())`` is tested
    where the command runs for real, e.g. ``tests/test_docs_commands.py``)."""
    old = schema_1_run(tmp_path / "old")
    with pytest.raises(RecordError) as refused:
        record.load(old / "phases.json")
    with pytest.raises(SystemExit) as exit_info:  # any other exception, a traceback, fails the test
        report.main([str(old)])
    captured = capsys.readouterr()
    assert exit_info.value.code == 2, captured.err
    assert captured.err.splitlines()[-1] == f"python -m lit_ddp.report: error: {refused.value}"
    assert captured.out == ""


@pytest.mark.timeout(10)
def test_a_comm_record_with_every_field_set_and_distinct_survives_a_json_round_trip(tmp_path):
    """Every field of ``comm.json`` away from its default and unlike its neighbours (the clock offsets and their
    errors, the first and final layouts, each rank's arrivals): a reader that swaps two of them fails here."""
    _, comm = records()
    for rank in comm.ranks:
        for row in rank.rows:
            row.arrival_s = [100.0 + rank.rank + 0.25 * row.step + 0.01 * b for b in range(len(row.bytes))]
    held = record.DDPMemory(parameters=2000, gradients=1600, buckets=[400, 600], gradient_as_bucket_view=True,
                            optimizer_state=3200, bucket_cap=1 << 20, compression="bf16")  # fmt: skip
    full = dataclasses.replace(
        comm, clock_offset_s=[0.0, 0.0125], clock_error_s=[0.0004, 0.0007], find_unused_parameters=True,
        unused=["head.bias"], unused_bytes=16, unused_every_step=True, straggler={"rank": 1, "cause": "update"},
        wire_dtype="torch.bfloat16", ddp_memory=held,
    )  # fmt: skip
    defaults = record.CommRecord(comm.meta, [], [], 0)
    for f in dataclasses.fields(record.CommRecord):
        if f.name not in ("meta", "kind"):
            assert getattr(full, f.name) != getattr(defaults, f.name), f"{f.name} is left at its default"
    lists = [full.layout, full.first_layout, full.profiled_steps, full.clock_offset_s, full.clock_error_s]
    assert len({json.dumps(v) for v in lists}) == len(lists)  # no two alike: a swap shows
    loaded = record.load(record.save(full, tmp_path / "comm.json"))
    assert plain(loaded) == plain(full)


def test_an_empty_sketch_writes_no_min_or_max_and_a_sketch_equals_only_a_sketch_of_the_same_values():
    empty = Sketch().to_json()
    assert (empty["count"], empty["min"], empty["max"]) == (0, None, None)
    assert Sketch.of([1.0, 2.0]) == Sketch.of([2.0, 1.0]) and Sketch.of([1.0]) != Sketch.of([2.0])
    assert Sketch.of([1.0]) != 1.0


@pytest.mark.timeout(10)
def test_a_fits_window_keeps_its_first_steps_from_its_own_first_step():
    """A fresh fit keeps steps 0-9 then the last 50; a fit resumed at step 5 keeps 5-14 then the last 50."""
    for first_step in (0, 5):
        window = Window(first_step=first_step) if first_step else Window()
        for step in range(first_step, first_step + 200):
            window.add(step, step)
        head, tail = range(first_step, first_step + HEAD_STEPS), range(first_step + 200 - TAIL_STEPS, first_step + 200)
        assert [step for step, _ in window.items()] == [*head, *tail]


@pytest.mark.timeout(10)
def test_steady_rows_are_rank_0s_after_the_warm_up_of_a_resumed_fit_and_a_step_not_kept_has_no_row(tmp_path):
    phases = phase_record([[(1.0, 2.0, 0.5, 0.25)] * 8, [(2.0, 2.0, 0.5, 0.25)] * 8], profiled=[7])
    for rank in phases.ranks:
        for row in rank.rows:
            row.step += 5  # a fit resumed from step 5: steps 5-12, step 5 its warm-up, step 7 profiled
    phases.first_step = 5
    assert [(r.step, r.ms.forward) for r in phases.steady_rows()] == [(s, 1.0) for s in (6, 8, 9, 10, 11, 12)]
    assert phases.ranks[1].row(6).ms.forward == 2.0 and phases.ranks[1].row(4) is None
    # A run's folder is made as the record is written.
    assert record.load(record.save(phases, tmp_path / "runs" / "version_0" / "phases.json")).first_step == 5


@dataclasses.dataclass
class Part:
    """A part of a record as ``read`` may meet one: a field the constructor does not take (computed from the
    others), a field of two types, and lists in a dict."""

    lists: dict[str, list[int]]
    count: int = dataclasses.field(init=False)
    either: Sketch | float = 0.0
    last: int = 0

    def __post_init__(self) -> None:
        self.count = sum(len(v) for v in self.lists.values())


@pytest.mark.timeout(10)
def test_read_reads_any_dataclass_by_its_fields_and_names_where_the_data_is_not_shaped_as_it():
    part = Part({"a": [1, 2], "b": [3]}, 2.5, 7)
    assert record.read(Part, record.as_json(part)) == part  # count, written, is computed again, not passed
    with pytest.raises(RecordError) as refused:
        record.read(Part, {"lists": {"a": [1], "b": "3"}})
    assert str(refused.value) == "Part.lists['b']: expected a list, got str"
    with pytest.raises(RecordError) as refused:
        record.read(record.RunMeta, [2, "cpu"])
    assert str(refused.value) == "RunMeta: expected an object of RunMeta's fields, got list"


@pytest.mark.timeout(10)
def test_load_says_what_is_wrong_with_a_record_in_its_words(tmp_path):
    def refusal(data) -> str:
        path = tmp_path / "record.json"
        path.write_text(json.dumps(data))
        with pytest.raises(RecordError) as refused:
            record.load(path)
        return str(refused.value).removeprefix(f"{path}: ")

    now = record.SCHEMA_VERSION
    assert refusal([1, 2]) == (f"run record schema None; this lit_ddp reads schema 3 to {now} (written by another "
                               "version of the tool: run the job again)")  # fmt: skip
    assert refusal({"schema": now, "kind": "memory"}) == (
        "a damaged run record (kind 'memory' is none of ['comm', 'oom', 'phases'])"
    )
    phases, comm = records()
    written = {"schema": now, **record.as_json(phases), "profiled_steps": "2"}
    assert refusal(written) == "a damaged run record (PhaseRecord.profiled_steps: expected a list, got str)"
    held = record.as_json(record.DDPMemory(6000, 3000, [3000], False, 12000, 1 << 20))
    del held["parameters"]
    written = {"schema": now, **record.as_json(comm), "ddp_memory": held}
    assert refusal(written) == ("a damaged run record (CommRecord.ddp_memory: no 'parameters', a required field of "
                                "DDPMemory)")  # fmt: skip
    for kept in (phases, comm):  # a record of no rank: nothing any table could read
        assert refusal({"schema": now, **record.as_json(kept), "ranks": []}) == (
            f"a damaged run record ({type(kept).__name__}.ranks: no rank)")  # fmt: skip


@pytest.mark.timeout(10)
def test_the_straggler_verdict_in_comm_json_survives_a_round_trip_with_its_phases_excess(tmp_path):
    from lit_ddp.derive.stragglers import Straggler

    _, comm = records()
    comm.straggler = record.as_json(Straggler(
        rank=1, late_ms=250.0, share=0.83, wait_ms=[500.0, 0.0], transfer_ms=2.0, transfer_per_bucket_ms=[2.0],
        wait_per_bucket_ms=[500.0], threshold_ms=200.0, spread_ms=500.0, cause="update", cause_extra_ms=500.0,
        steps=12, extra_ms={"forward": 0.0, "update": 500.0}, late_low_ms=240.0, late_high_ms=260.0,
    ))  # fmt: skip
    assert plain(record.load(record.save(comm, tmp_path / "comm.json"))) == plain(comm)


@pytest.mark.timeout(10)
def test_load_oom_reads_every_ranks_record_in_rank_order_and_nothing_else(tmp_path):
    phases, _ = records()
    record.save(phases, tmp_path / "phases.json")
    held = record.DDPMemory(6000, 3000, [3000], False, 12000, 1 << 20)
    for rank in (2, 10, 1):  # neither the names' order nor the files' (nor its reverse) is the ranks'
        oom = record.OutOfMemory(phases.meta, rank, 7, "backward", "CUDA out of memory", held)
        record.save(oom, tmp_path / f"oom_rank{rank}.json")
    assert [oom.rank for oom in record.load_oom(tmp_path)] == [1, 2, 10]
    assert record.load_oom(tmp_path / "no_run") == []
