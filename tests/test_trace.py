"""``lit_ddp.derive.trace``: a kineto trace's figures, held against HTA on a real A100 NCCL trace and against
hand-computed numbers on a trace built here; DDP's collectives; phases and steps from each family of range names."""

import gzip
import json
import math
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from lit_ddp.derive import trace as T
from lit_ddp.maths.bus_factors import bus_factor
from lit_ddp.records.phases import range_of

pytestmark = pytest.mark.timeout(60)

DATA = Path(__file__).parent / "data"
A100 = DATA / "a100_nccl_2rank_rank0.json.gz"

# The oracle: HTA 0.5.0's figures for this very file (TraceAnalysis(trace_dir=...).get_temporal_breakdown() and
# .get_comm_comp_overlap(), rank 0), as the trace's source publishes them (tests/data/README.md).
HTA = {"idle_us": 338_781, "compute_us": 75_169, "non_compute_us": 21_636, "span_us": 435_586, "overlap_pct": 14.31}


@pytest.fixture(scope="module")
def a100() -> T.RankAnalysis:
    return T.analyze_rank(T.load(A100))


def assert_like_hta(total: T.Breakdown, hta: dict) -> None:
    """Idle, compute and non-compute within 1% of the span, the overlap within 1 percentage point."""
    for key in ("span_us", "idle_us", "compute_us", "non_compute_us"):
        assert abs(getattr(total, key) - hta[key]) <= 0.01 * hta["span_us"], (key, getattr(total, key), hta[key])
    assert abs(total.comm_comp_overlap_pct - hta["overlap_pct"]) <= 1.0, total.comm_comp_overlap_pct


def test_a100_trace_gives_htas_published_figures(a100):
    assert (a100.rank, a100.world_size) == (0, 2)
    assert_like_hta(a100.total, HTA)
    t = a100.total
    assert t.idle_us == pytest.approx(t.span_us - t.busy_us)
    assert t.busy_us == pytest.approx(t.compute_us + t.non_compute_us)
    assert t.host_wait_us + t.kernel_wait_us + t.other_wait_us == pytest.approx(t.idle_us)


def test_with_htas_rounding_the_figures_are_htas_to_the_microsecond():
    """HTA rounds each op inward to whole microseconds; with the same rounding the definitions give its numbers
    exactly: the 1% above is rounding, not a different definition."""
    trace = T.load(A100)
    ops = tuple(replace(op, start_us=math.ceil(op.start_us), end_us=math.floor(op.end_us)) for op in trace.ops)
    t = T.analyze_rank(replace(trace, ops=ops)).total
    keys = ("span_us", "idle_us", "compute_us", "non_compute_us")
    assert {k: getattr(t, k) for k in keys} == {k: HTA[k] for k in keys}
    assert round(t.comm_comp_overlap_pct, 2) == HTA["overlap_pct"]


def test_a100_trace_against_hta_run_live(a100, tmp_path):
    pytest.importorskip("hta")
    from hta.trace_analysis import TraceAnalysis

    shutil.copy(A100, tmp_path / A100.name)
    analysis = TraceAnalysis(trace_dir=str(tmp_path))
    temporal = analysis.get_temporal_breakdown(visualize=False).set_index("rank").loc[0]
    overlap = analysis.get_comm_comp_overlap(visualize=False).set_index("rank").loc[0]
    live = {"idle_us": temporal["idle_time(us)"], "compute_us": temporal["compute_time(us)"],
            "non_compute_us": temporal["non_compute_time(us)"], "span_us": temporal["kernel_time(us)"],
            "overlap_pct": overlap["comp_comm_overlap_pctg"]}  # fmt: skip
    assert_like_hta(a100.total, live)


def test_a100_ddp_steps_phases_and_collectives(a100):
    assert [(s.step, s.counted) for s in a100.steps] == [(4, True), (5, True), (6, False)]  # HTA leaves #6 out
    assert set(a100.phases) == {"forward", "backward", "update"}
    assert a100.phases["backward"].communication_us > 0 and a100.phases["update"].communication_us == 0
    for step in (4, 5, 6):
        mine = [c for c in a100.collectives if c.step == step]
        # DDP's buffer broadcast (module buffers, then their count) in forward, five gradient buckets in backward.
        assert [(c.name, c.kind, c.phase) for c in mine] == [("broadcast", "other", "forward")] * 2 + [
            ("all_reduce", T.GRADIENT, "backward")] * 5  # fmt: skip
        assert mine[2].bytes == 2_049_000 * 4  # In msg nelems x Float
        assert mine[3].bytes == 7_875_584 * 4 and mine[1].bytes == 53 * 8  # Long
        for c in mine:
            assert c.group_size == 2 and c.algbw_gbps == pytest.approx(c.bytes / c.duration_us / 1e3)
            assert c.busbw_gbps == pytest.approx(c.algbw_gbps)  # 2(n-1)/n and 1 are both 1 for n = 2
    for step in a100.steps:
        last_bucket = [c for c in a100.collectives if c.step == step.step][-1]
        assert 0 < step.exposed_comm_us <= last_bucket.duration_us


def event(cat: str, name: str, ts: float, dur: float, **args) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur, "args": args}


def gpu(name: str, start: float, dur: float, launch: float, stream: int = 7, cat: str = "kernel",
        **args) -> list[dict]:  # fmt: skip
    """A GPU op and the CUDA runtime call that queued it, linked by correlation id."""
    gpu.correlation += 1
    return [event("cuda_runtime", "cudaLaunchKernel", launch, 3, correlation=gpu.correlation),
            event(cat, name, start, dur, stream=stream, correlation=gpu.correlation, **args)]  # fmt: skip


gpu.correlation = 0
NAMES = {  # forward, backward, update (the update holds the others, as Lightning's optimizer_step does)
    "tool": tuple(range_of(p) for p in ("forward", "backward", "update")),
    "user": ("## forward ##", "## backward ##", "## optimizer ##"),
    "lightning": ("[pl][profile][Strategy]LitDDPStrategy.training_step",
                  "[pl][profile][Strategy]LitDDPStrategy.backward",
                  "[pl][profile][LightningModule]LinearRegression.optimizer_step"),
}  # fmt: skip


def synthetic(tmp_path: Path, names=NAMES["user"], step="ProfilerStep#{}", name="rank.json.gz", info=True,
              extra=()) -> Path:  # fmt: skip
    """Two steps on two streams, hand-timed (us):

    stream 7   A [0,100) q -5 fwd   B [150,250) q 140 bwd   C [260,300) q 200 upd   memcpy D [400,420) q 250 upd
    stream 20  NCCL all-reduce N [200,255) q 190 bwd, 1000 Float over 4 ranks
    step 2     E [450,470) q 440 (no phase range: "other"), left out of the rank's totals
    """
    forward, backward, update = names
    events = [
        event("user_annotation", step.format(1), -20, 370), event("user_annotation", step.format(2), 350, 150),
        event("user_annotation", update, -15, 355), event("user_annotation", forward, -10, 140),
        event("user_annotation", backward, 130, 65), event("cpu_op", "aten::mm", -8, 2),
        *gpu("gemm_A", 0, 100, -5), *gpu("gemm_B", 150, 100, 140), *gpu("adam_C", 260, 40, 200),
        *gpu("Memcpy DtoD (Device -> Device)", 400, 20, 250, cat="gpu_memcpy"),
        *gpu("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 200, 55, 190, stream=20, **{
            "Collective name": "allreduce", "In msg nelems": 1000, "Out msg nelems": 1000, "dtype": "Float",
            "Group size": 4}),
        *gpu("gemm_E", 450, 20, 440), *extra,
    ]  # fmt: skip
    data = {"traceEvents": events, **({"distributedInfo": {"rank": 3, "world_size": 4}} if info else {})}
    path = tmp_path / name
    path.write_bytes(gzip.compress(json.dumps(data).encode()) if name.endswith(".gz") else json.dumps(data).encode())
    return path


def test_synthetic_trace_against_hand_computed_figures(tmp_path):
    a = T.analyze_rank(T.load(synthetic(tmp_path)))
    assert (a.rank, a.world_size) == (3, 4)
    # Union [0,100) [150,255) [260,300) [400,420); gaps: 50 (B queued at 140, after the GPU went idle at 100: host
    # wait), 5 (C queued at 200, before: under 30 us, kernel wait), 100 (D queued at 250, before: other wait).
    assert a.total == T.Breakdown(span_us=420, busy_us=265, idle_us=155, compute_us=240, non_compute_us=25,
                                  communication_us=55, overlap_us=50,
                                  comm_comp_overlap_pct=pytest.approx(100 * 50 / 55),
                                  host_wait_us=50, kernel_wait_us=5, other_wait_us=100)  # fmt: skip
    assert a.phases["forward"] == T.Breakdown(100, 100, 0, 100, 0, 0, 0, None, 0, 0, 0)
    assert a.phases["backward"] == T.Breakdown(105, 105, 0, 100, 5, 55, 50, pytest.approx(100 * 50 / 55), 0, 0, 0)
    assert a.phases["update"] == T.Breakdown(160, 60, 100, 40, 20, 0, 0, None, 0, 0, 100)
    one, two = a.steps
    assert (one.step, one.counted, two.step, two.counted) == (1, True, 2, False)
    assert one.breakdown == a.total and two.breakdown.busy_us == 20 and set(two.phases) == {"other"}
    assert one.exposed_comm_us == 5  # N runs on 5 us after B, backward's last compute kernel, ends
    (n,) = a.collectives
    assert (n.step, n.name, n.kind, n.bytes, n.duration_us, n.group_size) == (1, "all_reduce", T.GRADIENT, 4000, 55, 4)
    assert n.algbw_gbps == pytest.approx(4000 / 55e-6 / 1e9) and n.busbw_gbps == pytest.approx(n.algbw_gbps * 1.5)
    strict = T.analyze_rank(
        T.load(tmp_path / "rank.json.gz"), kernel_wait_us=5
    ).total  # the 5 us gap is no longer under
    assert (strict.kernel_wait_us, strict.other_wait_us) == (0, 105)
    with pytest.raises(ValueError, match=r"`analyze_rank\(kernel_wait_us=-1\)` must be >= 0"):
        T.analyze_rank(T.load(tmp_path / "rank.json.gz"), kernel_wait_us=-1)


@pytest.mark.parametrize("family", sorted(NAMES))
def test_each_family_of_phase_names_gives_the_same_phases(tmp_path, family):
    a = T.analyze_rank(T.load(synthetic(tmp_path, names=NAMES[family])))
    assert {p: b.busy_us for p, b in a.phases.items()} == {"forward": 100, "backward": 105, "update": 60}


def test_the_tools_own_steps_and_buckets_win(tmp_path):
    bucket = event("user_annotation", f"{T.BUCKET_PREFIX}0", 185, 10)  # N's all-reduce, queued at 190
    # The tool's steps hold ProfilerStep#1 and #2 (which would be the innermost): still the tool's win.
    own = [
        event("user_annotation", f"{T.STEP_PREFIX}7", -25, 375),
        event("user_annotation", f"{T.STEP_PREFIX}8", 349, 152),
    ]
    a = T.analyze_rank(T.load(synthetic(tmp_path, names=("x", "y", "z"), extra=[bucket, *own])))
    assert [s.step for s in a.steps] == [7, 8] and a.phases == {}  # ProfilerStep#1/#2 give way; no phase names
    (n,) = a.collectives
    assert (n.step, n.bucket, n.kind, n.phase) == (7, 0, T.GRADIENT, None)


def test_without_phase_ranges_every_all_reduce_of_a_step_is_a_gradient(tmp_path):
    a = T.analyze_rank(T.load(synthetic(tmp_path, names=("x", "y", "z"))))
    assert a.phases == {} and a.collectives[0].kind == T.GRADIENT and a.steps[0].exposed_comm_us is None


def test_an_all_gathers_bytes_are_its_output(tmp_path):
    """nccl-tests' size of an all-gather is what each rank receives: the output, n times the input."""
    args = {"Collective name": "_allgather_base", "In msg nelems": 250, "Out msg nelems": 1000, "dtype": "BFloat16",
            "Group size": 4}  # fmt: skip
    gather = gpu("ncclDevKernel_AllGather_RING_LL", 480, 10, 445, stream=20, **args)
    a = T.analyze_rank(T.load(synthetic(tmp_path, extra=gather)))
    assert [(c.name, c.bytes, c.kind, c.step) for c in a.collectives][1] == ("all_gather", 2000, "other", 2)
    assert a.collectives[1].busbw_gbps == pytest.approx(a.collectives[1].algbw_gbps * 3 / 4)


def test_collective_names_and_bus_factors():
    op = T.GpuOp("ncclKernel_AllGather_RING_LL_Sum_int8_t", "communication", 1, 0, 1, None, {})
    assert T.collective_name(op) == "all_gather"  # from the kernel's name when the args say nothing
    # NCCL >= 2.27's symmetric-memory kernels (ncclSymDevKernel_*) and the device kernels of NCCL 2.19+.
    for kernel in ("ncclSymDevKernel_AllReduce_AGxLL_R_sum_f32", "ncclDevKernel_AllReduce_Sum_f32_RING_LL"):
        assert T.collective_name(replace(op, name=kernel)) == "all_reduce", kernel
    for raw, name in (
        ("_allgather_base", "all_gather"),
        ("reduce_scatter_tensor_coalesced", "reduce_scatter"),
        ("allreduce", "all_reduce"),
        ("broadcast", "broadcast"),
        ("alltoall_base", "all_to_all"),
    ):
        assert T.collective_name(replace(op, args={"Collective name": raw})) == name, raw  # fmt: skip
    assert [bus_factor(n, 8) for n in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "barrier")] == [
        1.75, 0.875, 0.875, 1.0, None]  # fmt: skip


def test_rank_from_the_file_name_when_the_trace_has_no_distributed_info(tmp_path):
    assert T.load(synthetic(tmp_path, name="rank5.json", info=False)).rank == 5
    lightning = T.load(synthetic(tmp_path, name="fit-1-[Strategy]LitDDPStrategy.training_step.1.pt.trace.json",
                                 info=False))  # fmt: skip
    assert (lightning.rank, lightning.world_size) == (1, None)
    with pytest.raises(T.TraceError, match=r"trace\.json: cannot tell its rank: no distributedInfo"):
        T.load(synthetic(tmp_path, name="trace.json", info=False))


def test_files_that_are_not_traces_are_refused(tmp_path):
    (tmp_path / "a.json").write_text('{"steps": [1, 2]}')
    (tmp_path / "b.json.gz").write_bytes(b"\x1f\x8b not really gzip")
    (tmp_path / "c.json").write_text('{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "dur": 1}]}')
    with pytest.raises(T.TraceError, match=r"a\.json: not a trace file \(JSON without 'traceEvents'\)"):
        T.load(tmp_path / "a.json")
    with pytest.raises(T.TraceError, match=r"b\.json\.gz: not a trace file"):
        T.load(tmp_path / "b.json.gz")
    with pytest.raises(T.TraceError, match=r"c\.json: cannot tell its rank"):
        T.load(tmp_path / "c.json")
    (tmp_path / "rank0.json").write_text('{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "dur": 1}]}')
    with pytest.raises(T.TraceError, match=r"rank0\.json: a malformed trace event \(KeyError: 'ts'\)"):
        T.load(tmp_path / "rank0.json")


def test_a_cpu_only_trace_has_no_gpu_events_and_no_made_up_zeros(tmp_path):
    path = tmp_path / "rank0.json"
    cpu = [event("cpu_op", "aten::mm", 0, 5), event("user_annotation", "ProfilerStep#1", 0, 9)]
    path.write_text(json.dumps({"traceEvents": cpu}))
    with pytest.raises(T.NoGpuEvents, match=r"rank0\.json: the trace has no GPU events"):
        T.analyze_rank(T.load(path))


def test_the_analysis_runs_without_torch(tmp_path):
    """Loaded from its file alone with ``import torch`` made to fail: it needs no torch at all."""
    path = synthetic(tmp_path)
    code = ("import importlib.util, sys; sys.modules['torch'] = None\n"
            f"spec = importlib.util.spec_from_file_location('trace', {str(Path(T.__file__))!r})\n"
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
            f"print(m.analyze_rank(m.load({str(path)!r})).total.busy_us, sys.modules['torch'])")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["265.0", "None"]


@pytest.mark.parametrize(
    "name",
    [
        "ncclDevKernel_AllReduce_Sum_f32_RING_LL",  # NCCL 2.19+: ncclDevKernel_<op>_<redop>_<type>_<algo>_<proto>
        "ncclDevKernel_Generic",  # one kernel for every collective: the name tells none
        "ncclDevKernel_Generic_4(ncclDevKernelArgsStorage<4096ul>)",  # as kineto writes it, arguments and all
        "ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)",  # NCCL before 2.19
    ],
)
def test_a_nccl_kernel_without_collective_args_is_communication(tmp_path, name):
    """A trace without ProcessGroupNCCL's record_param_comms args (``Collective name``, sizes): the kernel's name
    alone makes it communication, newer NCCL's ``ncclDevKernel_*`` as well as the older ``ncclKernel_*``."""
    bare = gpu(name, 475, 10, 445, stream=20)  # in step 2, after E [450,470): no args but stream and correlation
    a = T.analyze_rank(T.load(synthetic(tmp_path, extra=bare)))
    (op,) = [p.op for p in a.ops if p.op.start_us == 475]
    assert op.kind == "communication", f"{name} counted as {op.kind}"
    two = a.steps[1]
    assert (two.step, two.breakdown.communication_us, two.breakdown.compute_us) == (2, 10, 20), two.breakdown
    assert [(c.step, c.bytes, c.duration_us) for c in a.collectives][1:] == [(2, None, 10)]


def test_an_events_missing_fields_have_their_defaults_and_only_complete_events_and_named_ranges_are_kept(tmp_path):
    """What a trace may leave out: a kernel's stream (then its thread's is taken, else -1), its name, a memory
    event's device (the CPU's). Kept: "X" events with a duration (not an instant with one, not one without);
    the ranges of steps, phases and buckets, in time order (no ``cpu_op`` of other names, no other category's range
    however named); memory events in time order, those at one time in the file's. A kernel that the profiler gives
    a collective's arguments is communication whatever its name."""
    extra = [
        {"ph": "X", "cat": "kernel", "name": "by_thread", "ts": 480, "dur": 1, "tid": 9, "args": {}},
        {"ph": "X", "cat": "kernel", "ts": 482, "dur": 1},
        *gpu("my_allreduce", 484, 1, 445, stream=20, **{"Collective name": "allreduce"}),
        {"ph": "i", "name": "[memory]", "ts": 5, "args": {"Bytes": 100}},
        {"ph": "i", "name": "[memory]", "ts": 5, "args": {"Bytes": -100, "Device Type": 1}},
        {"ph": "i", "name": "[memory]", "ts": 1, "args": {"Bytes": 8, "Device Type": 1}},
        7,
        {"ph": "X", "cat": "kernel", "name": "no_duration", "ts": 486},
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 487, "dur": 1},
        event("python_function", "ProfilerStep#9", 0, 1),
    ]
    trace = T.load(synthetic(tmp_path, extra=extra))
    assert [(op.name, op.kind, op.stream) for op in trace.ops if op.start_us >= 400] == [
        ("Memcpy DtoD (Device -> Device)", "memory", 7), ("gemm_E", "compute", 7), ("by_thread", "compute", 9),
        ("", "compute", -1), ("my_allreduce", "communication", 20)]  # fmt: skip
    assert [r.name for r in trace.ranges] == [
        "ProfilerStep#1", "## optimizer ##", "## forward ##", "## backward ##", "ProfilerStep#2"]  # fmt: skip
    assert trace.memory == (T.MemoryEvent(1, 8, 1), T.MemoryEvent(5, 100, T.CPU_DEVICE), T.MemoryEvent(5, -100, 1))


def test_a_trace_without_its_rank_is_refused_in_full_and_a_world_size_that_is_no_number_is_unknown(tmp_path):
    path = synthetic(tmp_path, name="trace.json", info=False)
    with pytest.raises(T.TraceError) as refused:
        T.load(path)
    assert str(refused.value) == (f"{path}: cannot tell its rank: no distributedInfo in the trace and no 'rank<N>' in "
                                  "its name")  # fmt: skip
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "distributedInfo": {"rank": 2, "world_size": "4"}}))
    trace = T.load(path)
    assert (trace.rank, trace.world_size) == (2, None)
    (tmp_path / "b.json.gz").write_bytes(b"\x1f\x8b not really gzip")
    with pytest.raises(T.TraceError) as refused:
        T.load(tmp_path / "b.json.gz")
    assert str(refused.value).endswith("b.json.gz: not a trace file (BadGzipFile: Unknown compression method)")


def test_the_kernel_wait_threshold_reaches_every_step_and_phase_and_may_be_0(tmp_path):
    path = synthetic(tmp_path)
    wide = T.analyze_rank(T.load(path), kernel_wait_us=150)  # the gaps of 5 and 100 us now under it
    assert (wide.total.host_wait_us, wide.total.kernel_wait_us, wide.total.other_wait_us) == (50, 105, 0)
    assert wide.steps[0].breakdown == wide.total and wide.phases["update"].kernel_wait_us == 100
    none = T.analyze_rank(T.load(path), kernel_wait_us=0).total
    assert (none.host_wait_us, none.kernel_wait_us, none.other_wait_us) == (50, 0, 105)


def test_a_single_step_ops_before_the_first_and_ops_queued_at_a_steps_edges(tmp_path):
    """One step is counted, with what was queued before it; an op queued at a step's end is in that step, one
    queued at the last step's start is the last step's (left out of the totals); one queued just as the GPU went
    idle waited on the GPU, not on the host."""
    ops = [*gpu("before", -10, 5, -20), *gpu("a", 10, 10, 5), *gpu("b", 30, 10, 20), *gpu("at_end", 105, 5, 100)]
    events = [event("user_annotation", "ProfilerStep#1", 0, 100), *ops]
    path = tmp_path / "rank0.json"
    path.write_text(json.dumps({"traceEvents": events}))
    a = T.analyze_rank(T.load(path))
    assert [(p.op.name, p.step) for p in a.ops] == [("before", None), ("a", 1), ("b", 1), ("at_end", 1)]
    assert [(s.step, s.counted, s.breakdown.busy_us) for s in a.steps] == [(1, True, 25)]
    # Union [-10,-5) [10,20) [30,40) [105,110): a queued at 5 and at_end at 100, after the GPU went idle (host
    # waits of 15 and 65); b queued at 20, as a ended: 10 us of kernel wait.
    t = a.total
    assert (t.span_us, t.busy_us, t.host_wait_us, t.kernel_wait_us, t.other_wait_us) == (120, 30, 80, 10, 0)
    two = T.analyze_rank(T.load(synthetic(tmp_path, extra=gpu("F", 430, 5, 350))))  # queued as step 2 starts
    assert two.total.busy_us == 265 and two.steps[1].breakdown.busy_us == 25


COLLECTIVE = {"In msg nelems": 10, "Out msg nelems": 10, "dtype": "Float"}


def test_a_collectives_size_group_bandwidth_and_kind_from_its_kernels_arguments(tmp_path):
    """In step 2, outside every phase: a reduce-scatter's size is its input, a subgroup's size is its own and
    without one the world's; a dtype of no known size gives no size, no duration no bandwidth, and one under a
    microsecond its own; an all-reduce neither in the backward nor in a bucket (a metric's) is no gradient."""
    scatter = {"Collective name": "_reduce_scatter_base", "In msg nelems": 1000, "Out msg nelems": 250,
               "dtype": "Float", "Group size": 2}  # fmt: skip
    fp8 = {**COLLECTIVE, "dtype": "Float8_e4m3fn"}  # not in DTYPE_BYTES
    extra = [*gpu("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 480, 10, 445, stream=20, **scatter),
             *gpu("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 491, 0.5, 446, stream=20, **COLLECTIVE),
             *gpu("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 492, 0, 447, stream=20, **COLLECTIVE),
             *gpu("ncclDevKernel_AllGather_RING_LL", 493, 1, 448, stream=20, **fp8)]  # fmt: skip
    a = T.analyze_rank(T.load(synthetic(tmp_path, extra=extra)))
    assert [(c.name, c.bytes, c.group_size, c.kind, c.phase) for c in a.collectives[1:]] == [
        ("reduce_scatter", 4000, 2, "other", "other"), ("all_reduce", 40, 4, "other", "other"),
        ("all_reduce", 40, 4, "other", "other"), ("all_gather", None, 4, "other", "other")]  # fmt: skip
    scattered, short, instant, unknown = a.collectives[1:]
    assert scattered.algbw_gbps == pytest.approx(0.4) and scattered.busbw_gbps == pytest.approx(0.2)  # (n-1)/n
    assert short.algbw_gbps == pytest.approx(0.08) and short.busbw_gbps == pytest.approx(0.12)  # 2(n-1)/n
    assert (instant.algbw_gbps, instant.busbw_gbps, unknown.algbw_gbps, unknown.busbw_gbps) == (None,) * 4
    bare = synthetic(tmp_path, names=("x", "y", "z"), info=False, name="rank3.json",
                     extra=gpu("ncclDevKernel_AllGather_RING_LL", 262, 5, 201, stream=20))  # fmt: skip
    (_, gather) = T.analyze_rank(T.load(bare)).collectives
    # Without phase ranges only a step's all-reduces are gradients; no group size nor world size: no bus factor.
    assert (gather.step, gather.kind, gather.group_size, gather.busbw_gbps) == (1, "other", None, None)


def test_collective_names_nccl_tests_has_and_those_it_has_none_for():
    op = T.GpuOp("ncclDevKernel_Generic", "communication", 1, 0, 1, None, {})
    assert T.collective_name(replace(op, args={"Collective name": "allgather_into_tensor_coalesced"})) == "all_gather"
    # One nccl-tests has no name for keeps its words: snake-cased from the kernel, a leading underscore cut.
    assert T.collective_name(replace(op, args={"Collective name": "_reduce_oop"})) == "reduce_oop"
    assert T.collective_name(replace(op, name="ncclDevKernel_NewCollective_RING_LL")) == "new_collective"
    assert T.collective_name(replace(op, name="custom_comm_kernel")) == "custom_comm_kernel"  # names no NCCL op
