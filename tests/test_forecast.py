"""The scaling forecast: the model on inputs worked out by hand, the links it runs over (``lit_ddp.scaling.links``: the
ring, NCCL's hierarchical form, topologies, the probe fit), the run loader on hand-made records, the CLI errors,
and one real 2-rank gloo probe."""

import argparse
import dataclasses
import json
import os
import sys

import pytest

from lit_ddp import report
from lit_ddp.errors import ForecastError
from lit_ddp.present import forecast
from lit_ddp.records import schema as record
from lit_ddp.records.phases import StepPhases
from lit_ddp.records.schema import Sketch, StepBuckets
from lit_ddp.scaling import links, model
from lit_ddp.scaling.links import Link, ProbePoint, Topology
from lit_ddp.scaling.model import Bucket, Measured
from tests.records import comm_record, comm_summaries, phase_record

# 1 GB/s = 1e6 bytes per ms: the numbers below are chosen so that the ms come out round.
SLOW = Link("slow", busbw_gbps=1.0, hop_latency_us=0.0, source="test")


def measured(buckets, forward=1.0, update=2.0, other=0.5, tail=0.25, compression=None) -> Measured:
    return Measured(forward_ms=forward, update_ms=update, other_ms=other, tail_ms=tail, buckets=tuple(buckets),
                    world_size=1, rows_per_rank=32, compression=compression, backward_ms=0.0, exposed_ms=0.0,
                    comm_ms=0.0, step_ms=0.0, n_steps=3)  # fmt: skip


def one_node(link: Link = SLOW, g: int = 8) -> Topology:
    return Topology(link, link, g)


@pytest.mark.timeout(10)
def test_one_bucket_no_overlap():
    # The single bucket is ready when backward's compute ends (10 ms): all of its all-reduce is exposed.
    run = measured([Bucket(1e6, 10.0)])
    two = model.simulate(run, 2, one_node())
    assert two.exposed_ms == pytest.approx(1.0)  # 2(1)/2 x 1e6 B / 1 GB/s
    assert two.backward_ms == pytest.approx(10.0 + 1.0 + 0.25)
    assert two.step_ms == pytest.approx(1.0 + 11.25 + 2.0 + 0.5)
    four = model.simulate(run, 4, one_node())
    assert four.exposed_ms == pytest.approx(1.5)  # 2(3)/4 x 1 ms
    one = model.simulate(run, 1, one_node())
    assert (one.exposed_ms, one.comm_ms, one.step_ms) == (0.0, 0.0, pytest.approx(13.75))


@pytest.mark.timeout(10)
def test_equal_buckets_overlap_and_queue():
    # 4 buckets of 1 ms each (2 ranks). Ready 2 ms apart: each is done before the next is ready, only the
    # last one shows.
    spread = measured([Bucket(1e6, t) for t in (2.0, 4.0, 6.0, 8.0)])
    f = model.simulate(spread, 2, one_node())
    assert (f.exposed_ms, f.comm_ms) == (pytest.approx(1.0), pytest.approx(4.0))
    # DDP copies each bucket back into .grad after its all-reduce (the 0.25 ms tail, 1/4 per bucket): three
    # copies follow the end of compute (8 ms), the last one the end of the last all-reduce (9 ms).
    assert f.backward_ms == pytest.approx(8.0 + 1.0 + 0.25 / 4)
    assert model.simulate(spread, 1, one_node()).backward_ms == pytest.approx(8.0 + 0.25)  # no wait: all copies
    # Ready 0.5 ms apart: they queue on the one stream (ends 2, 3, 4, 5) and 5 - 2.5 ms is exposed; the copies
    # start at 2.5 ms: 2.5625, then after each end 3.0625, 4.0625, 5.0625.
    queued = measured([Bucket(1e6, t) for t in (1.0, 1.5, 2.0, 2.5)])
    f = model.simulate(queued, 2, one_node())
    assert (f.exposed_ms, f.backward_ms) == (pytest.approx(2.5), pytest.approx(5.0625))
    # DDP launches buckets in index order: a bucket "ready" before its predecessor waits for it.
    out_of_order = measured([Bucket(1e6, 8.0), Bucket(1e6, 2.0)])
    assert model.simulate(out_of_order, 2, one_node()).exposed_ms == pytest.approx(2.0)


@pytest.mark.timeout(10)
def test_latency_bound_tiny_buckets():
    link = Link("lat", busbw_gbps=1.0, hop_latency_us=10.0, source="test")
    # 1 KB on 8 ranks: 2(7) x 10 us = 0.14 ms of latency, 2(7)/8 x 1e3 B / 1e6 B/ms = 0.00175 ms of bandwidth.
    assert links.ring_ms(1e3, 8, link) == pytest.approx(0.14175)
    tiny = measured([Bucket(1e3, 5.0)] * 100)
    assert model.simulate(tiny, 8, one_node(link)).exposed_ms == pytest.approx(14.175)
    # The same 100 KB in one bucket pays the latency once: 0.14 + 0.175 ms.
    merged = model.rebucket(tiny.buckets, 1e5)
    assert model.simulate(tiny, 8, one_node(link), merged).exposed_ms == pytest.approx(0.315)


@pytest.mark.timeout(10)
def test_hierarchical_multi_node():
    intra = Link("fast", busbw_gbps=100.0, hop_latency_us=1.0, source="test")
    inter = Link("net", busbw_gbps=10.0, hop_latency_us=10.0, source="test")
    topo = Topology(intra, inter, gpus_per_node=4)
    s = 8e6
    # One node (4 ranks): a ring on the intra link, 2(3) x 1 us + 2(3)/4 x 8e6 / 1e8 = 0.006 + 0.12 ms.
    assert links.allreduce_ms(s, 4, topo) == pytest.approx(0.126)
    # 2 nodes: latency 2(3) x 1 + 2 x log2(2) x 10 = 26 us; intra 0.12 ms, inter 2(1)/2 x (8e6/4) / 1e7 = 0.2 ms.
    assert links.allreduce_ms(s, 8, topo) == pytest.approx(0.026 + 0.2)
    # 4 nodes: 6 + 2 x 2 x 10 = 46 us; inter 2(3)/4 x 2e6 / 1e7 = 0.3 ms.
    assert links.allreduce_ms(s, 16, topo) == pytest.approx(0.046 + 0.3)
    # A fast network: the intra-node stage is the slower one and sets the bandwidth.
    fast_net = Topology(intra, Link("fat", busbw_gbps=1000.0, hop_latency_us=0.0, source="test"), gpus_per_node=4)
    assert links.allreduce_ms(s, 16, fast_net) == pytest.approx(0.006 + 0.12)


@pytest.mark.timeout(10)
def test_topology_from_specs():
    nvlink_ib = links.topology(("nvlink", "ib400"), 8, None)
    assert (nvlink_ib.intra.name, nvlink_ib.inter.name) == ("nvlink", "ib400")
    assert all(link.source for link in links.PRESETS.values())
    flat = links.topology(("roce200", None), 8, None)
    assert flat.intra is flat.inter is links.PRESETS["roce200"]
    with pytest.raises(ForecastError, match="nvlink joins the GPUs of one node"):
        links.topology(("ib400", "nvlink"), 8, None)
    nvlink_only = links.topology(("nvlink", None), 8, None)
    links.check_ranks(8, nvlink_only, "nvlink")
    with pytest.raises(ForecastError, match="--link nvlink reaches 8 GPUs .* 16 ranks need an inter-node link"):
        links.check_ranks(16, nvlink_only, "nvlink")
    with pytest.raises(ForecastError, match="12 ranks do not fill whole nodes of --gpus-per-node 8"):
        links.check_ranks(12, nvlink_ib, "nvlink+ib400")
    with pytest.raises(ForecastError, match="--link measured needs a probe"):
        links.topology(("measured", None), 8, None)


@pytest.mark.timeout(10)
def test_rebucket_merges_like_ddp():
    buckets = [Bucket(3, 1.0), Bucket(3, 2.0), Bucket(3, 3.0), Bucket(10, 4.0), Bucket(1, 5.0)]
    # A bucket closes once it reaches the cap; the merged one is ready with its last gradient.
    assert model.rebucket(buckets, 6) == (Bucket(6, 2.0), Bucket(13, 4.0), Bucket(1, 5.0))
    assert model.rebucket(buckets, 1e9) == (Bucket(20, 5.0),)
    assert model.rebucket(buckets, 1) == tuple(buckets)  # finer than measured: left as they are
    # Medians of ready times need not increase with the index; a merged bucket waits for its latest gradient.
    assert model.rebucket([Bucket(3, 2.0), Bucket(3, 1.0)], 6) == (Bucket(6, 2.0),)
    assert model.rebucket([Bucket(3, 0.25), Bucket(3, 0.5)], 6) == (Bucket(6, 0.5),)  # sub-ms ready times as they are
    # What-if: one merged bucket can only start after backward's compute, so none of it overlaps.
    run = measured([Bucket(1e6, t) for t in (2.0, 4.0, 6.0, 8.0)])
    merged = model.rebucket(run.buckets, 100 * model.MIB)
    assert model.simulate(run, 2, one_node(), merged).exposed_ms == pytest.approx(4.0)
    labels = [label for label, _, _ in model.what_ifs(run, [100.0])]
    assert labels[:2] == ["as measured (4 buckets)", "bucket_cap_mb 100 (1 buckets)"]


@pytest.mark.timeout(10)
def test_compression_and_bucket_view_what_ifs():
    run = measured([Bucket(2e6, 10.0)])
    rows = {label: (variant, buckets) for label, variant, buckets in model.what_ifs(run, [])}
    variant, buckets = rows["fp16/bf16 compression (1/2 bytes)"]
    assert model.simulate(variant, 2, one_node(), buckets).exposed_ms == pytest.approx(1.0)  # half of 2 ms
    # gradient_as_bucket_view: no copy-back, the 0.25 ms tail goes: 10 + 2 ms of backward instead of 12.25.
    variant, buckets = rows["gradient_as_bucket_view (no copy-back)"]
    assert model.simulate(variant, 2, one_node(), buckets).backward_ms == pytest.approx(12.0)
    already = measured([Bucket(2e6, 10.0)], compression="bf16")
    rows = {label: (variant, buckets) for label, variant, buckets in model.what_ifs(already, [])}
    variant, buckets = rows["no compression (2x the bf16 bytes)"]
    assert model.simulate(variant, 2, one_node(), buckets).exposed_ms == pytest.approx(4.0)


# The hand-made run of the loader tests: 2 ranks, step 0 warm-up (on DDP's construction-time layout, one bucket),
# then 3 steady steps with buckets of 400 and 600 bytes. Per figure one rank is constant (so its median is exact)
# and the slower one; the other rank's median is below it while its mean and its maximum are above: a loader
# that took a mean, a maximum or one rank only would read other numbers.
WARMUP = (100.0, 100.0, 100.0, 100.0)  # forward, backward, update, other
PHASES = [
    [(4.0, 11.0, 3.0, 1.0)] * 3,
    [(5.0, 10.5, 2.5, 0.8), (3.5, 12.0, 2.8, 0.5), (3.8, 10.8, 4.0, 2.0)],  # steps 18.8, 18.8, 20.6
]
BUCKETS = [  # per step: ms, ready_ms (from backward's start), busy_ms, exposed_ms
    [([1.0, 1.5], [4.0, 8.0], 2.5, 2.5), ([1.0, 1.5], [4.5, 8.0], 2.5, 2.5), ([1.0, 1.5], [7.0, 8.0], 2.5, 2.5)],
    [([1.0, 3.0], [5.0, 7.0], 4.0, 2.5), ([0.8, 0.8], [5.0, 7.5], 1.6, 1.0), ([0.6, 0.9], [5.0, 10.0], 1.5, 1.5)],
]
# Steps slowed by the profiler (PhaseTimer's kernel_steps): kept in the window, left out of every median.
PROFILED_PHASES = (40.0, 60.0, 30.0, 10.0)
PROFILED_BUCKETS = ([5.0, 5.0], [30.0, 50.0], 10.0, 2.0)  # a tail of 60 - 50 - 2 = 8 ms
ROOFLINE = record.Roofline(rows_per_rank=32, forward_flop=0.0, backward_flop=0.0, update_bytes=0.0)


def write_run(run_dir, profiled=0, exposed_ms=None):
    """``phases.json`` and ``comm.json`` of the run above; ``profiled``: that many profiled steps from step 2
    (after the first steady step, as PhaseTimer profiles); ``exposed_ms``: every step's exposed time instead."""
    profiled_steps = list(range(2, 2 + profiled))
    phases, buckets = [], []
    for rank in range(2):
        steps = [WARMUP, PHASES[rank][0], *[PROFILED_PHASES] * profiled, *PHASES[rank][1:]]
        rows = [StepBuckets(0, [1000], [20.0], [70.0], 30.0, 30.0)]
        for step, (ms, ready, busy, exposed) in enumerate(
            [BUCKETS[rank][0], *[PROFILED_BUCKETS] * profiled, *BUCKETS[rank][1:]], start=1
        ):
            rows.append(StepBuckets(step, [400, 600], ms, ready, busy, exposed if exposed_ms is None else exposed_ms))
        phases.append(steps)
        buckets.append(rows)
    record.save(phase_record(phases, profiled_steps, roofline=ROOFLINE), run_dir / "phases.json")
    record.save(comm_record(buckets, param_bytes=1000, profiled=profiled_steps), run_dir / "comm.json")
    return run_dir


@pytest.mark.timeout(10)
def test_measured_run(tmp_path):
    run = model.measured_run(write_run(tmp_path))
    # Steady steps 1-3 only; per rank medians, then the slower rank: forward max(4, 3.8), backward max(11, 10.8).
    assert (run.forward_ms, run.update_ms, run.other_ms, run.backward_ms, run.step_ms) == (4, 3, 1, 11, 19)
    # Bucket ready times: rank 0 medians (4.5, 8), rank 1 (5, 7.5) -> (5, 8): the slowest rank per bucket.
    assert run.buckets == (Bucket(400, 5), Bucket(600, 8))
    # Tail = backward - last ready - exposed per step: rank 0 (0.5, 0.5, 0.5), rank 1 (1, 3.5, -0.7) -> 1.
    # Exposed: rank 0 2.5, rank 1 median 1.5; all-reduce time: rank 0 2.5, rank 1 median 1.6.
    assert (run.tail_ms, run.exposed_ms, run.comm_ms) == (1, 2.5, 2.5)
    assert (run.world_size, run.rows_per_rank, run.n_steps, run.compression) == (2, 32, 3, None)
    # At 1 rank nothing is reduced: forward + (last ready + tail) + update + other.
    assert model.simulate(run, 1, one_node()).step_ms == 4 + 8 + 1 + 3 + 1


@pytest.mark.timeout(10)
def test_load_run_leaves_out_the_steps_phase_timer_profiled(tmp_path):
    # Three profiled steps among three steady ones: were they in any median (the tail's, which the loader joins
    # from the kept steps of both records, included), it would move.
    run = model.measured_run(write_run(tmp_path / "profiled", profiled=3))
    assert run == model.measured_run(write_run(tmp_path / "plain"))
    assert run.n_steps == 3


@pytest.mark.timeout(10)
def test_load_run_clamps_a_negative_tail(tmp_path):
    # backward - last ready - exposed < 0: timer noise, not time
    assert model.measured_run(write_run(tmp_path, exposed_ms=5.0)).tail_ms == 0.0


@pytest.mark.timeout(10)
def test_load_run_errors(tmp_path):
    old = tmp_path / "old"  # what lit_ddp wrote before the record had a schema
    old.mkdir()
    (old / "phases.json").write_text(json.dumps({"clock": "perf_counter", "world_size": 2, "ms": [[[1, 2, 3]]]}))
    with pytest.raises(ForecastError, match=r"phases.json: run record schema 1; this lit_ddp reads schema \d"):
        model.measured_run(old)
    with pytest.raises(ForecastError, match="no phases.json in .*: the forecast needs a run with PhaseTimer"):
        model.measured_run(tmp_path / "empty")
    (write_run(tmp_path / "phases_only") / "comm.json").unlink()
    with pytest.raises(ForecastError, match="no comm.json in"):
        model.measured_run(tmp_path / "phases_only")
    one_rank = write_run(tmp_path / "one_rank")
    record.save(phase_record([PHASES[0]]), one_rank / "phases.json")
    with pytest.raises(ForecastError, match="phases.json has world_size 1, comm.json 2"):
        model.measured_run(one_rank)


def probe_points(n, hop_us, busbw, noise=(1.0,)):
    """Times of the ring model itself, optionally scaled by a repeating pattern of factors."""
    points = []
    for i, size in enumerate(2**k for k in range(10, 27)):
        t = (2 * (n - 1) * hop_us / 1e3 + 2 * (n - 1) / n * size / (busbw * 1e6)) * noise[i % len(noise)]
        points.append(ProbePoint(size, t, size / t / 1e6, size / t / 1e6 * 2 * (n - 1) / n))
    return points


@pytest.mark.timeout(10)
def test_probe_fit():
    link = links.fit_probe(probe_points(4, hop_us=20.0, busbw=2.0), 4)
    assert (link.hop_latency_us, link.busbw_gbps) == (pytest.approx(20.0), pytest.approx(2.0))
    # +-10% noise at every size: the bandwidth from the large sizes and the latency stay within that.
    noisy = links.fit_probe(probe_points(2, hop_us=50.0, busbw=1.0, noise=(1.1, 0.9, 1.05, 0.95)), 2)
    assert noisy.hop_latency_us == pytest.approx(50.0, rel=0.1)
    assert noisy.busbw_gbps == pytest.approx(1.0, rel=0.1)
    # No latency, and the small sizes 20% fast: a free fit would give a negative latency; clamped to 0, the
    # bandwidth refitted.
    pure = links.fit_probe(probe_points(2, hop_us=0.0, busbw=1.0, noise=(0.8,) * 4 + (1.0,) * 13), 2)
    assert pure.hop_latency_us == 0.0 and pure.busbw_gbps == pytest.approx(1.0, rel=0.1)
    with pytest.raises(ForecastError, match="needs >= 2 sizes"):
        links.fit_probe(probe_points(2, 1.0, 1.0)[:1], 2)
    with pytest.raises(ForecastError, match="world_size=1"):
        links.fit_probe(probe_points(2, 1.0, 1.0), 1)


@pytest.mark.timeout(10)
def test_a_probe_across_nodes_gives_each_hop_its_own_measured_link(tmp_path):
    """``allreduce_probe`` under torchrun measured within node 0 and between the nodes apart: ``--link measured``
    takes each for its hop, and names a hop the probe did not measure."""

    def rows(n, hop_us, busbw):
        return [p.__dict__ for p in probe_points(n, hop_us, busbw)]

    across = {"backend": "gloo", "nodes": 2, "ranks_per_node": 2, "world_size": 4,
              "rows": rows(4, 30.0, 0.02),  # every rank: both hops mixed
              "intra_node": {"world_size": 2, "rows": rows(2, 5.0, 2.0)},
              "inter_node": {"world_size": 2, "rows": rows(2, 50.0, 0.0125)}}  # fmt: skip
    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps(across))
    topo = links.topology(("measured", None), 2, probe)
    assert (topo.intra.busbw_gbps, topo.intra.hop_latency_us) == (pytest.approx(2.0), pytest.approx(5.0))
    assert (topo.inter.busbw_gbps, topo.inter.hop_latency_us) == (pytest.approx(0.0125), pytest.approx(50.0))
    assert "within a node" in topo.intra.source and "between nodes" in topo.inter.source
    mixed = links.topology(("nvlink", "measured"), 8, probe)
    assert mixed.intra is links.PRESETS["nvlink"] and mixed.inter.busbw_gbps == pytest.approx(0.0125)
    # One rank per node: the probe measured no link within a node; with one rank per node none is needed.
    one_each = {key: value for key, value in across.items() if key != "intra_node"}
    probe.write_text(json.dumps({**one_each, "ranks_per_node": 1}))
    with pytest.raises(ForecastError, match=r"measured no link within a node .* --link nvlink\+measured"):
        links.topology(("measured", None), 2, probe)
    assert links.topology(("measured", None), 1, probe).inter.busbw_gbps == pytest.approx(0.0125)
    # One node: nothing between nodes.
    one_node = {key: value for key, value in across.items() if key != "inter_node"}
    probe.write_text(json.dumps({**one_node, "nodes": 1, "world_size": 2}))
    with pytest.raises(ForecastError, match=r"measured no link between nodes .* --link measured\+ib400"):
        links.topology(("measured", None), 2, probe)
    # ... which a forecast that stays within a node never takes.
    within = links.topology(("measured", None), 2, probe, across_nodes=False)
    assert within.intra is within.inter and within.intra.busbw_gbps == pytest.approx(2.0)
    assert within.gpus_per_node == 2


def forecast_rows(text):
    """The forecast table's rows by rank count, split into words."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("ranks "))
    end = next(i for i, line in enumerate(lines) if line.startswith("What if"))
    return {line.split()[0]: line.split() for line in lines[start + 1 : end]}


def parse(*argv):
    parser = argparse.ArgumentParser()
    forecast.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.timeout(60)
def test_run_prints_table_and_writes_plot(tmp_path, capsys):
    run_dir = write_run(tmp_path)
    (run_dir / "probe.json").write_text(json.dumps({"backend": "gloo", "world_size": 2, "rows": [
        p.__dict__ for p in probe_points(2, hop_us=0.0, busbw=0.001)]}))  # fmt: skip
    inputs = lambda: model.measured_run(run_dir)  # noqa: E731
    assert forecast.run(parse("--forecast", "2", "--link", "measured"), run_dir, inputs) == 0
    text = capsys.readouterr().out
    # 2 ranks at 1e3 B/ms: bucket 0 (400 B, ready at 5 ms) takes 0.4 ms, bucket 1 (600 B, ready at 8 ms) 0.6 ms,
    # all exposed. The 1 ms tail is copied back by bytes: 0.4 ms from 8 ms, 0.6 ms from the end at 8.6 ms, so
    # backward = 9.2 ms and step = 4 + 9.2 + 3 + 1 = 17.2 ms, against 17 ms on 1 rank; 2 x 32 rows.
    rows = forecast_rows(text)
    assert rows["1"] == ["1", "1", "17.00", "ms", "0.00", "ms", "0.00", "ms", "100.0%", "1,882"]
    assert rows["2"] == ["2", "1", "17.20", "ms", "0.60", "ms", "1.00", "ms", "98.8%", "3,721"]
    assert "intra-node link measured: busbw 1.00 MB/s, 0 us per step" in text
    assert (run_dir / "forecast.png").stat().st_size > 10_000 and f"wrote {run_dir / 'forecast.png'}" in text
    assert forecast.run(parse("--forecast", "8,64", "--link", "nvlink+ib400"), run_dir, inputs) == 0
    text = capsys.readouterr().out
    rows = forecast_rows(text)
    assert sorted(rows, key=int) == ["1", "8", "64"] and rows["64"][1] == "8"  # 8 nodes
    assert "bucket_cap_mb 25 (1 buckets)" in text and "gradient_as_bucket_view (no copy-back)" in text


@pytest.mark.timeout(60)
def test_without_matplotlib_the_commands_print_their_text_say_how_to_get_the_picture_and_exit_0(
    tmp_path, capsys, monkeypatch
):
    """report and forecast answer a missing matplotlib as trace_report does (lit_ddp.present.plots.write): the
    text in full, one line per picture on stderr that says how to get it, exit 0; --no-plot asks for none."""
    run_dir = write_run(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails as if matplotlib were missing
    missing = "matplotlib is missing (pip install 'lit_ddp[plot]'); the text above is complete"
    assert report.forecast_alias([str(run_dir), "--forecast", "8"]) == 0
    out, err = capsys.readouterr()
    assert "Forecast from" in out and err.splitlines() == [f"no forecast.png: {missing}"]
    assert report.main([str(run_dir), "--forecast", "8"]) == 0
    out, err = capsys.readouterr()
    assert "Phase times" not in out and out.startswith("Forecast from")  # its own lines only, not the tables again
    assert err.splitlines() == [f"no forecast.png: {missing}"]
    assert report.main([str(run_dir), "--forecast", "8", "--no-plot"]) == 0 and not capsys.readouterr().err
    assert not list(run_dir.glob("*.png"))


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--forecast", "8,x"], "argument --forecast: expected rank counts >= 1 like 8,64,512, got '8,x'"),
        (["--forecast", "0"], "argument --forecast: expected rank counts >= 1 like 8,64,512, got '0'"),
        (
            ["--link", "nvlink+foo"],
            "argument --link: expected LINK or INTRA+INTER with links from nvlink, ib400, "
            "roce200, roce100, measured, got 'nvlink+foo'",
        ),
        (["--gpus-per-node", "0"], "argument --gpus-per-node: expected an integer >= 1, got '0'"),
        (["--what-if-bucket-mb", "25,-1"], "argument --what-if-bucket-mb: expected bucket caps in MiB > 0"),
        (["--link", "nvlink", "--forecast", "16"], "--link nvlink reaches 8 GPUs (one node); 16 ranks need"),
        (["--link", "measured"], "no probe.json at"),
    ],
)
def test_cli_errors(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        report.forecast_alias([str(write_run(tmp_path)), "--no-plot", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("python -m lit_ddp.forecast: error: ") and err.count("\n") == 1, err


def test_a_run_directory_that_is_not_there_is_named_so(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        report.forecast_alias([str(tmp_path / "nope")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == f"python -m lit_ddp.forecast: error: {tmp_path / 'nope'} is not a directory\n"


@pytest.mark.timeout(10)
def test_probe_sizes_and_points():
    from lit_ddp.allreduce_probe import parse_bytes
    from lit_ddp.measure.allreduce import probe_points, sizes_between

    assert sizes_between(1024, 5000) == [1024, 2048, 4096, 5000]
    assert sizes_between(1024, 1024) == [1024]
    assert (parse_bytes("4096"), parse_bytes("64K"), parse_bytes("4M")) == (4096, 65536, 4 * 1024**2)
    with pytest.raises(argparse.ArgumentTypeError, match="got 'lots'"):
        parse_bytes("lots")
    # Median of the iterations; on 4 ranks busbw = algbw x 2(3)/4.
    (point,) = probe_points([4_000_000], [[9.0, 2.0, 4.0, 3.0, 5.0]], 4)
    assert point == ProbePoint(4_000_000, 4.0, 1.0, 1.5)


@pytest.mark.timeout(30)
def test_picture_starts_the_step_axis_at_zero_and_no_efficiency_passes_100():
    """forecast.png: a 0.6 ms rise on a 170 ms step must not look like a slope (the axis from 0), and
    gradient_as_bucket_view, faster than the measured run at every N, is measured against its own 1-rank step."""
    pytest.importorskip("matplotlib")
    run = measured([Bucket(1e6, 10.0)], tail=5.0)
    ax_step, ax_eff = forecast.figure(run, one_node(), [1, 2, 8], []).axes
    assert ax_step.get_ylim()[0] == 0
    lines = {line.get_label(): list(line.get_ydata()) for line in ax_eff.get_lines()}
    view = lines["gradient_as_bucket_view (no copy-back)"]
    assert view[0] == pytest.approx(100.0) and max(max(v) for v in lines.values()) <= 100.0 + 1e-9
    assert "Efficiency: the 1-rank step over the N-rank step of the same configuration" in forecast.report(
        run, one_node(), [1, 2], [], "test"
    )


@pytest.mark.timeout(30)
def test_under_srun_the_probe_takes_slurms_ranks_and_elsewhere_none(monkeypatch, capsys):
    from lit_ddp import allreduce_probe
    from lit_ddp.allreduce_probe import srun_env

    launcher = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    for name in [name for name in os.environ if name.startswith("SLURM_") or name in launcher]:
        monkeypatch.delenv(name)
    assert srun_env() is None  # no Slurm
    for name, value in {"SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "2", "SLURM_PROCID": "3",
                        "SLURM_LOCALID": "1",
                        "SLURM_NODEID": "1", "SLURM_JOB_ID": "1234", "SLURM_NODELIST": "node[07-08]",
                        "SLURM_JOB_NAME": "probe"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    assert srun_env() is None  # the batch script itself, outside srun: no job step
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    env = srun_env()
    assert {key: env[key] for key in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR")} == {
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "node07"}  # fmt: skip
    assert 1024 < int(env["MASTER_PORT"]) < 65536
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "3,1")  # uneven: a node's ranks cannot be grouped as torchrun's
    with pytest.raises(RuntimeError, match=r"as many tasks on every node.*this step has 3,1 tasks per node"):
        srun_env()
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "2(x2)")
    monkeypatch.setenv("SLURM_JOB_NAME", "bash")  # `srun --pty bash`: Lightning's rule, nothing launched
    assert srun_env() is None
    monkeypatch.setenv("SLURM_JOB_NAME", "probe")
    monkeypatch.delenv("SLURM_NTASKS_PER_NODE")  # Lightning's SLURMEnvironment asks for it, as fit does
    with pytest.raises(SystemExit) as exit_info:
        allreduce_probe.main(["--max-bytes", "1K"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m lit_ddp.allreduce_probe: error: under srun: You set `--ntasks=4`"), err
    assert err.count("\n") == 1, err  # one line, no usage block


@pytest.mark.timeout(10)
def test_hierarchical_at_node_counts_that_are_not_powers_of_two():
    """The tree across nodes is ceil(log2(m)) levels deep: 3 nodes need 2 levels, as 4 do; 5 nodes need 3."""
    intra = Link("fast", busbw_gbps=100.0, hop_latency_us=1.0, source="test")
    inter = Link("net", busbw_gbps=10.0, hop_latency_us=10.0, source="test")
    topo = Topology(intra, inter, gpus_per_node=4)
    s = 8e6
    # 3 nodes (12 ranks): latency 2(3) x 1 + 2 x 2 x 10 = 46 us; inter 2(2)/3 x (8e6/4) / 1e7 = 0.2667 ms.
    assert links.allreduce_ms(s, 12, topo) == pytest.approx(0.046 + 0.8 / 3)
    # 5 nodes (20 ranks): 6 + 2 x 3 x 10 = 66 us; inter 2(4)/5 x 2e6 / 1e7 = 0.32 ms.
    assert links.allreduce_ms(s, 20, topo) == pytest.approx(0.066 + 0.32)
    # Latency alone (no bytes): 3 nodes pay what 4 do, more than 2.
    assert links.allreduce_ms(0, 8, topo) < links.allreduce_ms(0, 12, topo) == links.allreduce_ms(0, 16, topo)


@pytest.mark.timeout(10)
def test_the_probe_fit_takes_its_bandwidth_from_the_large_sizes_alone():
    """The small sizes twice as fast as the model (a shaped link's burst) move no figure read off the large ones
    (a sixteenth of the largest up); two sizes are enough; a size that took no time is left out."""
    exact = links.fit_probe(probe_points(2, hop_us=40.0, busbw=1.0), 2)
    burst = links.fit_probe(probe_points(2, hop_us=40.0, busbw=1.0, noise=(0.5,) * 12 + (1.0,) * 5), 2)
    assert burst.busbw_gbps == pytest.approx(1.0, rel=1e-9) and exact.busbw_gbps == pytest.approx(1.0, rel=1e-9)
    assert (exact.name, exact.source) == ("measured", "")
    two = links.fit_probe(probe_points(2, hop_us=40.0, busbw=1.0)[-2:], 2)
    assert (two.busbw_gbps, two.hop_latency_us) == (pytest.approx(1.0), pytest.approx(40.0))
    untimed = ProbePoint(512, 0.0, 0.0, 0.0)  # a size too small for the clock
    assert links.fit_probe([untimed, *probe_points(2, hop_us=40.0, busbw=1.0)], 2) == exact
    # The large sizes all alike (noise): the slope over every size, by relative error, serves instead.
    flat_top = [*probe_points(2, hop_us=40.0, busbw=1.0)[:12], *[ProbePoint(2**k, 70.0, 0.0, 0.0)
                                                                  for k in range(22, 27)]]  # fmt: skip
    assert links.fit_probe(flat_top, 2).busbw_gbps > 0
    with pytest.raises(ForecastError, match=r"^the probe's times do not grow with size \(slope 0.0 ms/byte\)"):
        links.fit_probe([ProbePoint(2**k, 1.0, 0.0, 0.0) for k in range(10, 14)], 2)


@pytest.mark.timeout(10)
def test_the_hierarchical_latency_counts_each_hop_at_its_own_latency():
    intra = Link("fast", busbw_gbps=100.0, hop_latency_us=2.0, source="test")
    inter = Link("net", busbw_gbps=10.0, hop_latency_us=10.0, source="test")
    # 2 nodes of 4 and no bytes: 2(3) x 2 us + 2 x 1 x 10 us.
    assert links.allreduce_ms(0, 8, Topology(intra, inter, gpus_per_node=4)) == pytest.approx(0.032)


@pytest.mark.timeout(10)
def test_a_probe_file_is_named_in_every_link_it_gives_and_every_error(tmp_path):
    probe = tmp_path / "probe.json"
    rows = [p.__dict__ for p in probe_points(2, 5.0, 2.0)]
    probe.write_text(json.dumps({"backend": "gloo", "world_size": 2, "rows": rows}))
    topo = links.topology(("measured", None), 2, probe)
    assert topo.intra is topo.inter and topo.gpus_per_node == 2  # one machine: one link, named once
    assert topo.intra.source == f"fit to {probe}: gloo, 2 ranks, 17 sizes 1,024..67,108,864 bytes"
    across = {"backend": "nccl", "nodes": 2, "world_size": 4, "rows": rows, "intra_node": {"world_size": 2,
              "rows": rows}, "inter_node": {"world_size": 2, "rows": rows[:5]}}  # fmt: skip
    probe.write_text(json.dumps(across))
    assert links.load_probe(probe).source == f"fit to {probe} within a node: nccl, 2 ranks, 17 sizes " \
        "1,024..67,108,864 bytes"  # fmt: skip
    assert links.load_probe(probe, "inter").source == f"fit to {probe} between nodes: nccl, 2 ranks, 5 sizes " \
        "1,024..16,384 bytes"  # fmt: skip
    within = links.topology(("measured", None), 2, probe, across_nodes=False)
    assert within.gpus_per_node == 2
    with pytest.raises(ForecastError, match=r"^--link measured needs a probe: --probe probe.json \(python -m "
                       r"lit_ddp.allreduce_probe --out probe.json\)$"):  # fmt: skip
        links.topology(("measured", None), 2, None)
    probe.write_text("{")
    with pytest.raises(ForecastError, match=f"^{probe} is not JSON: Expecting"):
        links.load_probe(probe)
    probe.write_text(json.dumps({"rows": [{"nbytes": 1}]}))
    with pytest.raises(ForecastError, match=rf"^{probe} is not an allreduce_probe JSON \(TypeError\("):
        links.load_probe(probe)


def test_the_probe_fit_with_one_or_two_large_sizes_and_latency_weighted_by_relative_error():
    """Two sizes from a sixteenth of the largest up give the bandwidth alone; one alone cannot, and the fit falls
    back to every size. The latency is the mean of t - B x S weighted by 1/t^2 (each point's relative error)."""
    two_large = [ProbePoint(1_000, 0.5, 0.0, 0.0), ProbePoint(1_000_000, 2.0, 0.0, 0.0),
                 ProbePoint(16_000_000, 17.0, 0.0, 0.0)]  # fmt: skip
    link = links.fit_probe(two_large, 2)
    assert link.busbw_gbps == pytest.approx(1.0)  # (17 - 2) ms over 15 MB, the small size's 0.5 ms left out
    residuals, weights = (0.5 - 0.001, 1.0, 1.0), (1 / 0.5**2, 1 / 2.0**2, 1 / 17.0**2)
    latency_ms = sum(w * r for w, r in zip(weights, residuals, strict=True)) / sum(weights)
    assert link.hop_latency_us == pytest.approx(latency_ms / 2 * 1e3)  # 2(n-1) = 2 ring steps
    one_large = [ProbePoint(1_000, 1.001, 0.0, 0.0), ProbePoint(10_000, 1.01, 0.0, 0.0),
                 ProbePoint(1_000_000, 2.0, 0.0, 0.0)]  # fmt: skip
    link = links.fit_probe(one_large, 2)
    assert (link.busbw_gbps, link.hop_latency_us) == (pytest.approx(1.0), pytest.approx(500.0))


# A run accumulating 2 micro-batches per step, per rank constant over its steady steps 1-3 (step 0: warm-up):
# (forward, backward of both micro-batches, the last one's backward, update, data, other); the ranks differ in
# every figure, so each of the model's inputs is one rank's or the other's.
ACCUMULATING = [(4.0, 10.0, 6.0, 2.0, 1.0, 0.5), (3.0, 12.0, 7.0, 3.0, 0.5, 0.5)]
ACCUMULATING_BUCKETS = [([1.0, 2.0], [3.0, 5.0]), ([1.0, 2.0], [4.0, 5.5])]  # per rank: ms, ready_ms (exposed 0.5)
HELD = record.DDPMemory(parameters=1000, gradients=1000, buckets=[250, 750], gradient_as_bucket_view=False,
                        optimizer_state=2000, bucket_cap=1 << 20, compression="bf16")  # fmt: skip


def accumulating_run(run_dir, ranks=2, comm_steps=range(4), layout=(250, 750)):
    """``phases.json`` and ``comm.json`` of the run above, on a CPU named "test CPU" with bf16 compression and
    DDP's memory known; ``comm_steps``: the steps comm.json kept; ``layout``: DDP's final layout (the steps' own
    buckets are always 250 and 750 bytes)."""
    meta = record.RunMeta(ranks, "cpu", "test CPU", "gloo", "perf_counter", "32-true", "test", "test")
    phase_ranks, comm_ranks = [], []
    for r in range(ranks):
        forward, backward, last, update, data, other = ACCUMULATING[r]
        steady = StepPhases(forward=forward, backward=backward, update=update, other=other, data=data,
                            step=forward + backward + update + data + other, backward_last=last)  # fmt: skip
        warmup = StepPhases(forward=100.0, backward=100.0, update=100.0, other=100.0, step=500.0, data=100.0,
                            backward_last=50.0)  # fmt: skip
        rows = [record.StepRow(0, warmup, {}, 2)]
        rows += [record.StepRow(s, steady, {}, 2) for s in (1, 2, 3)]
        summaries = {p: Sketch.of([steady[p]] * 3) for p in steady}
        phase_ranks.append(record.RankPhases(r, rows, summaries))
        ms, ready = ACCUMULATING_BUCKETS[r]
        buckets = [StepBuckets(s, [250, 750], ms, ready, 3.0, 0.5, micro_batches=2, synced=[1]) for s in comm_steps]
        comm_ranks.append(record.RankComm(r, buckets, comm_summaries(buckets, list(layout), [])))
    record.save(record.PhaseRecord(meta, phase_ranks), run_dir / "phases.json")
    comm = record.CommRecord(meta, comm_ranks, list(layout), 1000, compression="bf16", ddp_memory=HELD)
    record.save(comm, run_dir / "comm.json")
    return run_dir


@pytest.mark.timeout(10)
def test_with_accumulation_only_the_last_micro_batchs_backward_waits_for_the_all_reduce(tmp_path):
    """Per rank the medians, then the slowest rank: forward 4, update 3, other + data 1.5 (rank 0's 0.5 + 1),
    backward 12; the backward before the last micro-batch, backward - last: 10 - 6 = 4 and 12 - 7 = 5 -> 5; the
    tail, the last micro-batch's backward - last ready - exposed: 6 - 5 - 0.5 and 7 - 5.5 - 0.5 -> 1. The record's
    compression, device, memory and micro-batches come through as they are."""
    run = model.measured_run(accumulating_run(tmp_path))
    assert run == Measured(forward_ms=4.0, update_ms=3.0, other_ms=1.5, tail_ms=1.0,
                           buckets=(Bucket(250, 4.0), Bucket(750, 5.5)), world_size=2, rows_per_rank=None,
                           compression="bf16", backward_ms=12.0, exposed_ms=0.5, comm_ms=3.0, step_ms=19.0, n_steps=3,
                           backward_before_ms=5.0, micro_batches=2, device="cpu", device_name="test CPU",
                           held=HELD)  # fmt: skip
    # At 1 rank: the last bucket ready at 5.5 ms, the 1 ms tail copied back by bytes (0.25, then 0.75 ms): 6.5 ms
    # of the last micro-batch's backward after the 5 ms before it; step 4 + 5 + 6.5 + 3 + 1.5.
    assert model.simulate(run, 1, one_node()) == model.Forecast(1, 20.0, 11.5, exposed_ms=0.0, comm_ms=0.0)
    # The bucket view's what-if says what it gives back: DDP's 1,000 bytes of buckets, unless it is on already.
    labels = [label for label, _, _ in model.what_ifs(run, [])]
    assert labels[-1] == "gradient_as_bucket_view (no copy-back; 1.00 kB less held per rank)"
    viewed = dataclasses.replace(run, held=dataclasses.replace(HELD, gradient_as_bucket_view=True))
    assert model.what_ifs(viewed, [])[-1][0] == "gradient_as_bucket_view (no copy-back)"


@pytest.mark.timeout(10)
def test_a_one_rank_run_is_read_and_one_with_no_step_of_the_final_layout_or_no_step_in_both_records_is_not(
    tmp_path,
):
    one = model.measured_run(accumulating_run(tmp_path / "one", ranks=1))
    assert (one.world_size, one.n_steps, one.forward_ms, one.tail_ms, one.backward_before_ms) == (1, 3, 4.0, 0.5, 4.0)
    # DDP rebuilt its buckets after the last step the run kept: no step ran on the final layout.
    short = accumulating_run(tmp_path / "short", layout=(1000,))
    with pytest.raises(ForecastError, match=f"^{short}: no step with DDP's final bucket layout: run more steps$"):
        model.measured_run(short)
    # comm.json kept other steps than phases.json: no step joins the two, no tail is measured (0, not a guess).
    apart = model.measured_run(accumulating_run(tmp_path / "apart", comm_steps=range(10, 14)))
    assert apart.tail_ms == 0.0 and apart.buckets == (Bucket(250, 4.0), Bucket(750, 5.5))


@pytest.mark.timeout(10)
def test_a_fitted_latency_of_a_picosecond_or_less_is_rounding():
    """Times exactly on t = 1e-9 + S / 2^38 ms: the fit's intercept is one picosecond to the last bit, the bar,
    and reads as no latency at all."""
    points = [ProbePoint(s, 1e-9 + s / 2**38, 0.0, 0.0) for s in (1024, 2048)]
    assert links.fit_probe(points, 2).hop_latency_us == 0.0
