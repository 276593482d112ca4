"""The timeline's layout on hand-made records (``lit_ddp.present.timeline``): gradient accumulation's phases laid end
to end, NCCL's queue behind the bucket before, gloo's overlapping buckets on lanes, the markers of a SIGTERM and of
a rank out of memory, and times left as read without comm.json."""

import pytest

from lit_ddp.analysis.run_analysis import RunAnalysis
from lit_ddp.present import timeline
from lit_ddp.records.phases import StepPhases, boundaries
from lit_ddp.records.schema import (
    CommRecord,
    DDPMemory,
    NamedWait,
    OutOfMemory,
    PhaseRecord,
    RankComm,
    RankPhases,
    RunMeta,
    StepBuckets,
    StepRow,
)


def meta(backend: str = "gloo") -> RunMeta:
    return RunMeta(2, "cpu", "cpu", backend, "perf_counter", "32-true", "2", "2")


def row(step: int, start_s: float, micro: int = 1) -> StepRow:
    """forward 10, backward 20, update 5, data 60 and other 5 ms (1 before the forward, 2 + 2 between phases)."""
    offsets = dict(zip(boundaries(), (1.0, 11.0, 12.0, 32.0, 34.0, 39.0, 40.0, 100.0), strict=True))
    ms = StepPhases(forward=10.0, backward=20.0, update=5.0, other=5.0, step=100.0, data=60.0)
    return StepRow(step, ms, offsets, micro, start_s)


def phases(rows: list[list[StepRow]], **kwargs) -> PhaseRecord:
    return PhaseRecord(meta(), [RankPhases(r, kept, {}, node=0, host="h", device="cpu") for r, kept in enumerate(rows)],
                       **kwargs)  # fmt: skip


def events(content: dict, name: str = "", cat: str = "", pid=None) -> list[dict]:
    return [e for e in content["traceEvents"] if e["ph"] != "M" and (not name or e["name"] == name)
            and (not cat or e.get("cat") == cat) and (pid is None or e["pid"] == pid)]  # fmt: skip


def test_one_micro_batch_sits_where_it_ran_and_other_is_the_gaps():
    content = timeline.timeline(RunAnalysis(phases([[row(0, 10.0)], [row(0, 10.0)]]), None))
    starts = {e["name"]: e["ts"] for e in events(content, cat="phase", pid=0) if e["name"] != "other"}
    assert starts == {"forward": 1e3, "backward": 12e3, "update": 34e3, "data": 40e3}
    gaps = [(e["ts"], e["dur"]) for e in events(content, name="other", pid=0)]
    assert gaps == [(0.0, 1e3), (11e3, 1e3), (32e3, 2e3), (39e3, 1e3)]  # 5 ms, the record's other
    assert content["otherData"]["aligned_by"] == "none (no comm.json): each rank's own clock"


def test_micro_batches_are_laid_end_to_end_each_the_records_sum():
    content = timeline.timeline(RunAnalysis(phases([[row(4, 10.0, micro=3)], [row(4, 10.0, micro=3)]]), None))
    laid = [(e["name"], e["ts"], e["dur"]) for e in events(content, cat="phase", pid=1)]
    assert laid == [("forward", 0.0, 10e3), ("backward", 10e3, 20e3), ("update", 30e3, 5e3), ("data", 35e3, 60e3),
                    ("other", 95e3, 5e3)]  # fmt: skip
    step = events(content, cat="step", pid=1)[0]
    assert step["args"]["laid_end_to_end"] == "3 micro-batches: each phase summed over them"


def test_a_sigterm_and_a_rank_out_of_memory_are_marked_where_they_happened(tmp_path):
    record = phases([[row(0, 10.0), row(1, 10.1)], [row(0, 10.0), row(1, 10.1)]], ended_by="SIGTERM")
    held = DDPMemory(0, 0, [], False, 0, 0)
    oom = OutOfMemory(meta(), 1, 1, "backward", "CUDA out of memory", held)
    content = timeline.timeline(RunAnalysis(record, None), [oom])
    sigterm = events(content, name="SIGTERM: stopped after step 1")
    assert [(e["pid"], e["ts"]) for e in sigterm] == [(0, 200e3), (1, 200e3)]  # the end of step 1
    out = events(content, name="out of memory: step 1, backward")
    assert [(e["pid"], e["ts"], e["args"]["error"]) for e in out] == [(1, 100e3, "CUDA out of memory")]
    assert len(events(content, name="warm-up: step 0")) == 2


def bucket_rows(arrivals: list[float], ms: list[float]) -> list[StepBuckets]:
    return [StepBuckets(3, [1000] * len(ms), ms, [0.0] * len(ms), 0.0, 0.0, arrivals)]


def test_on_nccl_a_bucket_queues_behind_the_one_before_and_on_gloo_overlapping_buckets_take_lanes():
    rows = [[row(3, 10.0)], [row(3, 10.0)]]
    # Both ranks hand bucket 0 over at 10.020 s and bucket 1 at 10.022 s; bucket 0 takes 5 ms, bucket 1 4 ms.
    ranks = [RankComm(r, bucket_rows([10.020, 10.022], [5.0, 4.0]), {}) for r in range(2)]
    nccl = CommRecord(meta("nccl"), ranks, [1000, 1000], 2000, clock_offset_s=[0.0, 0.0], clock_error_s=[0.0, 0.0])
    content = timeline.timeline(RunAnalysis(phases(rows), nccl))
    parts = [(e["name"], e["ts"], e["dur"]) for e in events(content, cat="comm", pid=0)]
    assert parts == [("all-reduce bucket 0", 20e3, 5e3), ("transfer", 20e3, 5e3),
                     ("all-reduce bucket 1", 22e3, 7e3), ("queued", 22e3, 3e3), ("transfer", 25e3, 4e3)]  # fmt: skip
    gloo = CommRecord(meta("gloo"), ranks, [1000, 1000], 2000, clock_offset_s=[0.0, 0.0], clock_error_s=[0.0, 0.0])
    content = timeline.timeline(RunAnalysis(phases(rows), gloo))
    lanes = {e["name"]: e["tid"] for e in events(content, cat="comm", pid=0) if e["name"].startswith("all-reduce")}
    assert lanes == {"all-reduce bucket 0": timeline.COMM_TRACK, "all-reduce bucket 1": timeline.COMM_TRACK + 1}
    names = {
        e["tid"]: e["args"]["name"] for e in content["traceEvents"] if e["name"] == "thread_name" and e["pid"] == 0
    }
    assert names[timeline.COMM_TRACK + 1] == "all-reduce (2)"


def test_a_rank_waits_for_the_last_hand_over_on_rank_0s_clock():
    """Rank 1's clock is 100 s ahead (comm.json's offset): its hand-over, 5 ms after rank 0's, is what rank 0 waits
    for."""
    rows = [[row(3, 10.0)], [row(3, 110.0)]]
    ranks = [RankComm(0, bucket_rows([10.020], [8.0]), {}),
             RankComm(1, bucket_rows([110.025], [3.0]), {})]  # fmt: skip
    comm = CommRecord(meta(), ranks, [1000], 1000, clock_offset_s=[0.0, 100.0], clock_error_s=[0.0, 1e-6])
    content = timeline.timeline(RunAnalysis(phases(rows), comm))
    wait = events(content, name="wait", pid=0)
    assert [(e["ts"], e["dur"]) for e in wait] == [(pytest.approx(20e3), pytest.approx(5e3))]
    assert not events(content, name="wait", pid=1)
    bucket = events(content, name="all-reduce bucket 0", pid=0)[0]
    assert bucket["args"]["transfer_ms"] == pytest.approx(3.0) and bucket["args"]["bytes"] == 1000


def test_the_watchdogs_lines_are_marked_where_and_when_they_were_said():
    said = [NamedWait(3, 10.25, "waiting 12 s: rank 0 has been at u.py:3 f: g() for 12 s, outside any collective"),
            NamedWait(4, 10.3, "moved on after 14 s")]  # fmt: skip
    record = phases([[row(0, 10.0), row(1, 10.1)], [row(0, 10.0), row(1, 10.1)]])
    record.ranks[0].waits = said
    content = timeline.timeline(RunAnalysis(record, None))
    marked = [(e["pid"], e["ts"], e["args"]["step"], e["args"]["line"]) for e in events(content, cat="marker")
              if e["name"].startswith("watchdog: ")]  # fmt: skip
    assert marked == [(0, 250e3, 3, said[0].line), (0, 300e3, 4, said[1].line)]
    assert {e["name"] for e in events(content, cat="marker")} >= {
        "watchdog: waiting 12 s",
        "watchdog: moved on after 14 s",
    }
