"""Scaling forecast: a DDP step at N ranks, from one measured run.

    python -m lit_ddp.forecast runs/mini_train_profile/version_0 --forecast 8,64,512 --link nvlink+ib400

(``python -m lit_ddp.report RUN --forecast ...`` does the same after its tables.) Reads ``phases.json``
(PhaseTimer) and ``comm.json`` (CommMonitor, with each bucket's ``ready_ms``) of a run, prints step time,
exposed communication, scaling efficiency and samples/s at each N, what-if rows for DDP's knobs, and writes
``forecast.png`` into the run directory.

The model of one step at N ranks. Inputs are steady-state medians (steps >= 1 with DDP's final bucket
layout), per rank, then the slowest rank, since every all-reduce waits for it. The batch per rank is fixed
(weak scaling), so compute per rank does not depend on N::

    step(N)     = forward + backward(N) + update + other                      (measured, but backward)
    r_k         = ready time of bucket k: handed to the comm hook, ms after backward start (ready_ms);
                  r_K, the last one, is the end of backward's compute
    end_k       = max(r_k, end_{k-1}) + T(S_k, N)     one communication stream, buckets in index order
                                                      (DDP launches bucket k only after bucket k-1)
    exposed(N)  = end_K - r_K                         what communication adds after backward's compute
    backward(N) = c_K,  c_0 = r_K,  c_k = max(c_{k-1}, end_k) + tail x S_k / sum(S)
    tail        = measured backward - r_K - measured exposed

The last line is DDP's ``finalize_backward``: for each bucket in turn, wait for its all-reduce, then copy the
result into the parameters' ``.grad``. The copies are most of the tail (about S / memory bandwidth), so they
are shared out by bytes; on one rank they all follow r_K, at N ranks most of them hide under the wait for
the last all-reduce.
    T(S, n)     = 2(n-1) a + 2(n-1)/n S / busbw       ring all-reduce on n <= g GPUs of one node
    T(S, N)     = 2(g-1) a_intra + 2 ceil(log2 m) a_inter
                  + max(2(g-1)/g S / busbw_intra, 2(m-1)/m (S/g) / busbw_inter)     N = m nodes x g GPUs

The multi-node form is NCCL's hierarchical one: a reduce-scatter then an all-gather inside each node (the
first bandwidth term), and between nodes an all-reduce of each GPU's S/g shard over its own NIC, all "rails"
in parallel (the second). NCCL pipelines chunks through the stages, so the slower stage sets the bandwidth
and the latencies add. Between nodes the latency is that of NCCL's tree (intra-node chains, a double binary
tree across nodes: 2 ceil(log2 m) network steps), which NCCL picks over the ring's 2(m-1) steps at scale.
``busbw`` and ``a`` (the latency of one step) are a link's: ``lit_ddp.scaling.links``, checked there against nccl-tests.

Gradient accumulation (k micro-batches per step): DDP all-reduces after the last backward only (``no_sync``
before): step = forward + backward_before (the k - 1 earlier backwards, compute) + backward(N) + update + other,
backward(N) the model above on the last backward. Efficiency: a configuration's 1-rank step over its N-rank one.

Not modelled: collectives other than the gradient all-reduce (``other`` is taken as measured, though
Lightning and the tool's callbacks reduce a few scalars every step), communication slowing compute (NCCL
kernels share SMs and memory bandwidth; on CPU, gloo's threads share the cores), stragglers that grow with
N, NCCL's protocol switch for small messages (a is NCCL's Simple-protocol latency throughout), the time to
cast buckets for fp16/bf16 compression.
"""

import argparse
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from lit_ddp.analysis.phases import comm_summary, micro_batches, phase_summary
from lit_ddp.analysis.tables import fmt_ms, table
from lit_ddp.errors import ForecastError, RecordError
from lit_ddp.records.schema import PHASES, StepRow
from lit_ddp.records.schema import load_run as load_record
from lit_ddp.scaling.links import GB, LINK_NAMES, Topology, allreduce_ms, check_ranks, topology

MIB = 1024**2


@dataclass(frozen=True)
class Bucket:
    """One gradient bucket: its bytes on the wire and when it was handed to the comm hook."""

    nbytes: float
    ready_ms: float


@dataclass(frozen=True)
class Measured:
    """A run's steady-state step, per rank compute at the slowest rank's pace."""

    forward_ms: float
    update_ms: float
    other_ms: float
    tail_ms: float
    buckets: tuple[Bucket, ...]
    world_size: int
    rows_per_rank: int | None
    compression: str | None
    backward_ms: float  # as measured, for the report
    exposed_ms: float  # as measured
    comm_ms: float  # as measured: sum of the bucket all-reduce times
    step_ms: float  # as measured
    n_steps: int
    backward_before_ms: float = 0.0  # the backward of the micro-batches before the last (under no_sync)
    micro_batches: int = 1


@dataclass(frozen=True)
class Forecast:
    """The model's step at ``ranks`` ranks."""

    ranks: int
    step_ms: float
    backward_ms: float
    exposed_ms: float  # from the end of backward's compute to the end of the last all-reduce
    comm_ms: float  # sum of the all-reduce times: busy, hidden or not


def simulate(run: Measured, ranks: int, topo: Topology, buckets: Sequence[Bucket] | None = None) -> Forecast:
    """The step at ``ranks`` ranks; ``buckets`` replaces the measured ones for what-ifs."""
    buckets = run.buckets if buckets is None else buckets
    end = ready = comm = 0.0
    ends = []
    for bucket in buckets:
        ready = max(ready, bucket.ready_ms)  # launched in index order: never before an earlier bucket
        cost = allreduce_ms(bucket.nbytes, ranks, topo)
        end = max(ready, end) + cost
        ends.append(end)
        comm += cost
    # DDP's finalize: wait for each bucket's all-reduce in turn, then copy its result into .grad.
    backward, total = ready, sum(b.nbytes for b in buckets)
    for bucket, bucket_end in zip(buckets, ends, strict=True):
        backward = max(backward, bucket_end) + run.tail_ms * bucket.nbytes / total
    step = run.forward_ms + run.backward_before_ms + backward + run.update_ms + run.other_ms
    return Forecast(ranks, step, run.backward_before_ms + backward, exposed_ms=end - ready, comm_ms=comm)


def rebucket(buckets: Sequence[Bucket], cap_bytes: float) -> tuple[Bucket, ...]:
    """Merges consecutive measured buckets the way DDP fills its buckets: one closes once it holds
    ``cap_bytes`` or more. A merged bucket is ready when its last gradient is. Measured buckets are the finest
    grain the run recorded, so a cap below their size leaves them as they are."""
    merged: list[Bucket] = []
    nbytes, ready = 0.0, 0.0
    for bucket in buckets:
        nbytes, ready = nbytes + bucket.nbytes, max(ready, bucket.ready_ms)
        if nbytes >= cap_bytes:
            merged.append(Bucket(nbytes, ready))
            nbytes = 0.0
    if nbytes:
        merged.append(Bucket(nbytes, ready))
    return tuple(merged)


def load_run(run_dir: Path) -> Measured:
    """Reads the run's ``phases.json`` and ``comm.json`` (``lit_ddp.records.schema``) into the model's inputs: per rank
    the steady medians (see the module docstring), then the slowest rank."""
    try:
        phases, comm = load_record(run_dir)
    except RecordError as err:
        raise ForecastError(str(err)) from err
    for name, found in (("phases.json", phases), ("comm.json", comm)):
        if found is None:
            raise ForecastError(f"no {name} in {run_dir}: the forecast needs a run with PhaseTimer and CommMonitor")
    if phases.meta.world_size != comm.meta.world_size:
        raise ForecastError(f"phases.json has world_size {phases.meta.world_size}, comm.json {comm.meta.world_size}")
    if not comm_summary(comm, 0, "total_ms").count:
        raise ForecastError(f"{run_dir}: no step with DDP's final bucket layout: run more steps")
    per_rank = []
    micro = micro_batches(phases)
    for r in range(comm.meta.world_size):
        med = {p: phase_summary(phases, r, p).median for p in PHASES}
        med["other"] += med.pop("data")  # the model takes everything outside the three phases as one
        for name in ("exposed_ms", "total_ms"):
            med[name] = comm_summary(comm, r, name).median
        med["ready"] = [comm_summary(comm, r, f"bucket{b}.ready_ms").median for b in range(len(comm.layout))]
        # With accumulation only the last micro-batch's backward all-reduces (the others are compute).
        last = phase_summary(phases, r, "backward_last").median if micro > 1 else med["backward"]
        med["backward_before"] = max(0.0, med["backward"] - last)
        # The tail joins the two records step by step: over the steady steps both kept.
        kept = {row.step: row for row in phases.steady_rows(r)}
        tails = [_last_backward(kept[b.step]) - max(b.ready_ms) - b.exposed_ms
                 for b in comm.ranks[r].rows if b.step in kept and b.bytes == comm.layout]  # fmt: skip
        med["tail"] = statistics.median(tails) if tails else 0.0
        per_rank.append(med)

    def slowest(key: str) -> float:  # every all-reduce waits for the slowest rank
        return max(m[key] for m in per_rank)

    buckets = tuple(Bucket(nbytes, max(m["ready"][b] for m in per_rank)) for b, nbytes in enumerate(comm.layout))
    return Measured(
        forward_ms=slowest("forward"), update_ms=slowest("update"), other_ms=slowest("other"),
        tail_ms=max(0.0, slowest("tail")), buckets=buckets, world_size=comm.meta.world_size,
        rows_per_rank=phases.roofline.rows_per_rank if phases.roofline else None, compression=comm.compression,
        backward_ms=slowest("backward"), exposed_ms=slowest("exposed_ms"), comm_ms=slowest("total_ms"),
        step_ms=slowest("step"), n_steps=comm_summary(comm, 0, "total_ms").count,
        backward_before_ms=slowest("backward_before"), micro_batches=micro,
    )  # fmt: skip


def _last_backward(row: StepRow) -> float:  # the backward DDP all-reduces after: the last micro-batch's
    return row.ms.backward_last if row.micro_batches > 1 else row.ms.backward


def what_ifs(run: Measured, caps_mib: Sequence[float]) -> list[tuple[str, Measured, tuple[Bucket, ...]]]:
    """(label, run, buckets) for each knob whose effect the model can compute."""
    rows = [(f"as measured ({len(run.buckets)} buckets)", run, run.buckets)]
    for cap in caps_mib:
        merged = rebucket(run.buckets, cap * MIB)
        rows.append((f"bucket_cap_mb {cap:g} ({len(merged)} buckets)", run, merged))
    if run.compression is None:
        half = tuple(replace(b, nbytes=b.nbytes / 2) for b in run.buckets)
        rows.append(("fp16/bf16 compression (1/2 bytes)", run, half))
    else:
        double = tuple(replace(b, nbytes=b.nbytes * 2) for b in run.buckets)
        rows.append((f"no compression (2x the {run.compression} bytes)", run, double))
    # The gradients are the buckets: no copy back into .grad (and none into the bucket during backward, a saving
    # the run cannot separate from backward's compute, so not counted).
    rows.append(("gradient_as_bucket_view (no copy-back)", replace(run, tail_ms=0.0), run.buckets))
    return rows


def report(run: Measured, topo: Topology, ranks: Sequence[int], caps_mib: Sequence[float], source: str) -> str:
    """The forecast table, the what-if table and the notes, as text."""
    base = simulate(run, 1, topo)
    lines = [
        f"Forecast from {source} ({run.world_size} rank(s) measured, median of {run.n_steps} steady steps; "
        f"slowest rank per phase): step {fmt_ms(run.step_ms)}, backward {fmt_ms(run.backward_ms)} of which "
        f"{fmt_ms(run.exposed_ms)} exposed communication",
        f"compute per rank: forward {fmt_ms(run.forward_ms)}, backward {fmt_ms(max(b.ready_ms for b in run.buckets))} "
        f"to the last bucket + {fmt_ms(run.tail_ms)} after communication, update {fmt_ms(run.update_ms)}, "
        f"other {fmt_ms(run.other_ms)}",
        f"{len(run.buckets)} bucket(s), {sum(b.nbytes for b in run.buckets):,.0f} bytes, ready at "
        + ", ".join(f"{b.ready_ms:.1f}" for b in run.buckets)
        + " ms after backward start",
    ]
    for role, link in (("intra-node", topo.intra), ("inter-node", topo.inter)):
        lines.append(f"{role} link {link.name}: busbw {link.busbw_gbps:.3g} GB/s, {link.hop_latency_us:.3g} us "
                     f"per step ({link.source})")  # fmt: skip
    lines.append(
        "exposed comm: from the end of backward's compute to the end of the last all-reduce (as CommMonitor); "
        "DDP copies finished buckets back into .grad meanwhile, so the step grows by less."
    )
    if run.micro_batches > 1:
        lines.append(
            f"gradient accumulation: {run.micro_batches} micro-batches per step, all-reduced once, after the last "
            f"one's backward (DDP's no_sync before it): the {run.micro_batches - 1} earlier backwards "
            f"({fmt_ms(run.backward_before_ms)}) are compute only, and samples/s counts every micro-batch"
        )
    rows = []
    for n in ranks:
        f = simulate(run, n, topo)
        nodes = max(1, n // topo.gpus_per_node)
        samples = f"{n * run.rows_per_rank / (f.step_ms / 1e3):,.0f}" if run.rows_per_rank else "-"
        rows.append((str(n), str(nodes), fmt_ms(f.step_ms), fmt_ms(f.exposed_ms), fmt_ms(f.comm_ms),
                     f"{base.step_ms / f.step_ms:.1%}", samples))  # fmt: skip
    lines.append(table(("ranks", "nodes", "step", "exposed comm", "all-reduce", "efficiency", "samples/s"), rows))
    header = ("what if", *[f"{n} ranks" for n in ranks])
    cells = []
    for label, variant, buckets in what_ifs(run, caps_mib):
        cells.append((label, *[f"{fmt_ms(f.step_ms)} ({fmt_ms(f.exposed_ms)})"
                               for f in (simulate(variant, n, topo, buckets) for n in ranks)]))  # fmt: skip
    lines += ["What if (step time, exposed communication in brackets):", table(header, cells)]
    lines.append(
        "Efficiency: the 1-rank step over the N-rank step of the same configuration (the picture's what-ifs "
        "each against their own 1-rank step: removing the copy-back shortens every N, 1 included)."
    )
    total = sum(b.nbytes for b in run.buckets)
    copy = f"{total / run.tail_ms / GB:.1f} GB/s" if run.tail_ms > 0 else "-"
    lines.append(
        f"The tail after communication ({fmt_ms(run.tail_ms)} for {total:,.0f} bytes, {copy}: the speed of a memory "
        "copy) is taken as DDP's copy of each bucket back into .grad, which gradient_as_bucket_view removes; its "
        "copy of the gradients into the buckets during backward is not modelled. Bucket caps can only merge the "
        "measured buckets (ready when the last one is); splitting them needs per-gradient ready times."
    )
    return "\n".join(lines)


def plot(run: Measured, topo: Topology, ranks: Sequence[int], caps_mib: Sequence[float], out: Path) -> Path:
    figure(run, topo, ranks, caps_mib).savefig(out, dpi=110)
    return out


def figure(run: Measured, topo: Topology, ranks: Sequence[int], caps_mib: Sequence[float]):
    """Step time and scaling efficiency vs ranks, for the measured buckets and each what-if."""
    from matplotlib.figure import Figure  # the Figure API, not pyplot: no global state, safe in notebooks

    fig = Figure(figsize=(11, 4.2))
    ax_step, ax_eff = fig.subplots(1, 2)
    top = base = simulate(run, 1, topo).step_ms  # nothing to reduce on 1 rank: the compute alone
    for i, (label, variant, buckets) in enumerate(what_ifs(run, caps_mib)):
        steps = [simulate(variant, n, topo, buckets).step_ms for n in ranks]
        own_base = simulate(variant, 1, topo, buckets).step_ms  # each against itself on 1 rank: <= 100%
        top = max(top, *steps)
        style = {"linewidth": 2.5, "color": "k"} if i == 0 else {"linestyle": "--", "linewidth": 1.2}
        ax_step.plot(ranks, steps, marker="o", label=label, **style)
        ax_eff.plot(ranks, [100 * own_base / s for s in steps], marker="o", label=label, **style)
    ax_step.axhline(base, color="grey", linewidth=0.8, label="compute only (1 rank)")
    # From zero: a rise of a fraction of a millisecond on a 300 ms step must not look like a slope.
    ax_step.set_ylim(0, 1.1 * top)
    links = topo.intra.name if topo.inter is topo.intra else f"{topo.intra.name}+{topo.inter.name}"
    for ax, title, unit in ((ax_step, "step time", "ms"), (ax_eff, "scaling efficiency (each vs its own 1 rank)", "%")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(ranks), [str(n) for n in ranks])
        ax.set_xlabel(f"ranks ({topo.gpus_per_node} per node, {links})")
        ax.set_ylabel(unit)
        ax.set_title(title)
    ax_eff.set_ylim(0, 105)
    ax_step.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _rank_list(text: str) -> list[int]:
    try:
        ranks = [int(x) for x in text.split(",")]
    except ValueError:
        ranks = []
    if not ranks or min(ranks) < 1:
        raise argparse.ArgumentTypeError(f"expected rank counts >= 1 like 8,64,512, got {text!r}")
    return ranks


def _cap_list(text: str) -> list[float]:
    try:
        caps = [float(x) for x in text.split(",")] if text else []
    except ValueError:
        caps = [-1.0]
    if any(not c > 0 for c in caps):
        raise argparse.ArgumentTypeError(f"expected bucket caps in MiB > 0 like 1,25,100, got {text!r}")
    return caps


def _link_spec(text: str) -> tuple[str, str | None]:
    names = text.split("+")
    unknown = [n for n in names if n not in LINK_NAMES]
    if len(names) > 2 or unknown or not names[0]:
        raise argparse.ArgumentTypeError(f"expected LINK or INTRA+INTER with links from {', '.join(LINK_NAMES)}, "
                                         f"got {text!r}")  # fmt: skip
    return names[0], names[1] if len(names) == 2 else None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The forecast's options, for ``python -m lit_ddp.report`` and this module's own ``main``."""
    group = parser.add_argument_group("scaling forecast")
    group.add_argument(
        "--forecast",
        type=_rank_list,
        default=None,
        metavar="N,N,...",
        help="forecast the step at these rank counts, e.g. 8,64,512",
    )
    group.add_argument(
        "--link",
        type=_link_spec,
        default=("nvlink", "ib400"),
        metavar="SPEC",
        help=f"INTRA+INTER or one LINK, from {', '.join(LINK_NAMES)} (default nvlink+ib400)",
    )
    group.add_argument("--gpus-per-node", type=_positive_int, default=8, help="GPUs per node (default 8)")
    group.add_argument(
        "--probe", type=Path, default=None, help="allreduce_probe JSON for --link measured (default: RUN/probe.json)"
    )
    group.add_argument("--what-if-bucket-mb", type=_cap_list, default=[25.0, 100.0], metavar="MIB,MIB,...",
                       help="bucket caps to try (default 25,100)")  # fmt: skip


def run(args: argparse.Namespace, run_dir: Path) -> str:
    """Runs the forecast for parsed ``args``; returns the text to print and writes ``forecast.png`` (unless
    ``args.no_plot``). Raises ``ForecastError`` (a ``ValueError``) with a one-line message on bad input."""
    spec = "+".join(n for n in args.link if n)
    probe = args.probe if args.probe is not None else (run_dir / "probe.json")
    topo = topology(args.link, args.gpus_per_node, probe if "measured" in args.link else None)
    ranks = sorted({1, *(args.forecast or [])})
    for n in ranks:
        check_ranks(n, topo, spec)
    measured = load_run(run_dir)
    text = report(measured, topo, ranks, args.what_if_bucket_mb, str(run_dir))
    if not getattr(args, "no_plot", False):
        try:
            text += f"\nwrote {plot(measured, topo, ranks, args.what_if_bucket_mb, run_dir / 'forecast.png')}"
        except ImportError:
            text += "\nno plot: matplotlib is missing (pip install 'lit_ddp[plot]')"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lit_ddp.forecast", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a run's log directory (phases.json, comm.json)")
    parser.add_argument("--no-plot", action="store_true", help="text only")
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.forecast is None:
        args.forecast = [8, 64, 512]
    try:
        print(run(args, args.run_dir))
    except ForecastError as e:
        parser.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
