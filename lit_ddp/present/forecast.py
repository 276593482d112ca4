"""Scaling forecast: a DDP step at N ranks, from one measured run.

    python -m lit_ddp.forecast runs/mini_train_profile/version_0 --forecast 8,64,512 --link nvlink+ib400

(``python -m lit_ddp.report RUN --forecast ...`` prints the same, and only that.) Reads ``phases.json`` and
``comm.json`` of a run, prints step time, exposed communication, scaling efficiency and samples/s at each N,
what-if rows for DDP's knobs, and writes ``forecast.png`` into the run directory. The model
(``lit_ddp.scaling.model``) and what it leaves out: docs/forecast.md.
"""

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path

from lit_ddp.formatting import fmt_bandwidth, fmt_ms, table
from lit_ddp.present import plots
from lit_ddp.scaling.links import BYTES_PER_MS_PER_GBPS, LINK_NAMES, Topology, check_ranks, topology
from lit_ddp.scaling.model import Measured, simulate, what_ifs


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
    if run.device != "cuda" and any(link.name != "measured" for link in (topo.intra, topo.inter)):
        lines.append(
            f"Note: the compute was measured on a {run.device.upper()}"
            + (f" ({run.device_name})" if run.device_name not in ("", run.device) else "")
            + "; the links "
            "below are a GPU cluster's. The forecast is that of this compute over those links, not of GPUs: run "
            "the profile on the GPU to forecast a GPU cluster."
        )
    for role, link in (("intra-node", topo.intra), ("inter-node", topo.inter)):
        lines.append(f"{role} link {link.name}: busbw {fmt_bandwidth(link.busbw_gbps)}, {link.hop_latency_us:.3g} us "
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
    copy = fmt_bandwidth(total / run.tail_ms / BYTES_PER_MS_PER_GBPS) if run.tail_ms > 0 else "-"
    lines.append(
        f"The tail after communication ({fmt_ms(run.tail_ms)} for {total:,.0f} bytes, {copy}: the speed of a memory "
        "copy) is taken as DDP's copy of each bucket back into .grad, which gradient_as_bucket_view removes; its "
        "copy of the gradients into the buckets during backward is not modelled. Bucket caps can only merge the "
        "measured buckets (ready when the last one is); splitting them needs per-gradient ready times."
    )
    return "\n".join(lines)


def figure(run: Measured, topo: Topology, ranks: Sequence[int], caps_mib: Sequence[float]):
    """``forecast.png``: step time and scaling efficiency vs ranks, for the measured buckets and each what-if (here,
    not in ``lit_ddp.present.plots``: it draws the model's curves, and analysis is a floor below scaling)."""
    fig = plots.figure(figsize=(11, 4.2))
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


def run(args: argparse.Namespace, run_dir: Path, inputs: Callable[[], Measured]) -> int:
    """Prints the forecast for parsed ``args`` of the run's forecast inputs (``inputs``, asked for once the options
    are known good) and writes ``forecast.png`` (unless ``args.no_plot``); returns the
    exit code, 0 or ``EXIT_NO_PICTURE`` (``lit_ddp.present.plots.write``). Raises ``ForecastError`` (a
    ``ValueError``) with a one-line message on bad input, before it prints anything."""
    spec = "+".join(n for n in args.link if n)
    probe = args.probe if args.probe is not None else (run_dir / "probe.json")
    ranks = sorted({1, *(args.forecast or [])})
    measured_probe = probe if "measured" in args.link else None
    topo = topology(args.link, args.gpus_per_node, measured_probe, across_nodes=ranks[-1] > args.gpus_per_node)
    for n in ranks:
        check_ranks(n, topo, spec)
    measured = inputs()
    print(report(measured, topo, ranks, args.what_if_bucket_mb, str(run_dir)))
    if getattr(args, "no_plot", False):
        return 0
    return plots.write(lambda: figure(measured, topo, ranks, args.what_if_bucket_mb), run_dir / "forecast.png")
