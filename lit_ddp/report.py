"""Timing JSON -> the summary tables and a picture.

    python -m lit_ddp.report runs/mini_train_profile/version_0
    python -m lit_ddp.report runs/mini_train_profile/version_0 --forecast 8,64,512 --link nvlink+ib400

Reads ``phases.json`` (PhaseTimer) and ``comm.json`` (CommMonitor) from a run directory, prints the same
tables the callbacks print at the end of training, and writes ``phases.png``: stacked forward / backward /
update / other bars per step (rank 0) and per rank (steady-state medians), with the communication time
marked. The picture needs matplotlib (``pip install 'lit_ddp[plot]'``).
"""

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from lit_ddp import forecast
from lit_ddp.tables import fmt_ms, table

PHASES = ("forward", "backward", "update", "other", "step")


def _steady(steps: list) -> list:
    """Step 0 is warm-up (allocator, kernel selection, DDP's first-iteration bookkeeping)."""
    return steps[1:] if len(steps) > 1 else steps


def _steady_indices(data: dict[str, Any]) -> list[int]:
    """Rows of ``phases.json`` to summarise: after step 0, without the steps PhaseTimer profiled for GPU-busy time
    (the profiler slows every kernel launch) as long as others remain."""
    steps = _steps(data)
    indices = _steady(list(range(len(steps))))
    profiled = set(data.get("profiled_steps", ()))
    return [i for i in indices if steps[i] not in profiled] or indices


def _steps(data: dict[str, Any]) -> list[int]:
    return data.get("steps") or list(range(len(data["ms"][0])))


def _profiled_steps_run(data: dict[str, Any]) -> list[int]:
    """The steps PhaseTimer profiled for GPU-busy time that the run reached."""
    steps = set(_steps(data))
    return [s for s in data.get("profiled_steps", ()) if s in steps]


def _steady_rows(data: dict[str, Any], rank: int) -> list:
    return [data["ms"][rank][i] for i in _steady_indices(data)]


def format_step(step: int, forward: float, backward: float, update: float) -> str:
    """The notes' per-step format (``mini_train_profile.py``), times in ms."""
    return f"Step {step}\n forward : {forward:.2f} ms\n backward: {backward:.2f} ms\n update  : {update:.2f} ms"


def phase_table(data: dict[str, Any]) -> str:
    """Per phase: warm-up (step 0, rank 0), median/min/max over steady steps of all ranks, the slowest rank."""
    ms = data["ms"]  # [rank][step][phase]
    rows = []
    for p, phase in enumerate(PHASES):
        warmup = ms[0][0][p]
        pooled = [step[p] for rank in range(len(ms)) for step in _steady_rows(data, rank)]
        per_rank = [statistics.median(step[p] for step in _steady_rows(data, rank)) for rank in range(len(ms))]
        slowest = max(range(len(per_rank)), key=per_rank.__getitem__)
        rows.append((phase, fmt_ms(warmup), fmt_ms(statistics.median(pooled)), fmt_ms(min(pooled)), fmt_ms(max(pooled)),
                     f"rank {slowest}: {fmt_ms(per_rank[slowest])}"))  # fmt: skip
    header = ["phase", "step 0", "median", "min", "max", "slowest rank (median)"]
    busy = data.get("busy_ms")  # [rank][profiled step][phase], GPU kernel time inside each phase
    if busy:
        header.append("GPU busy (rank 0)")
        rows = [(*row, fmt_ms(statistics.median(step[p] for step in busy[0]))) for p, row in enumerate(rows)]
    n_steady = len(_steady_indices(data))
    clock = data["clock"] + CLOCKS.get(data["clock"], "")
    title = f"Phase times ({clock}), {len(ms)} rank(s), step 0 = warm-up, then {n_steady} steady step(s)"
    if n_steady < len(_steady(ms[0])):
        profiled = _profiled_steps_run(data)
        which = f"step {profiled[0]}" if len(profiled) == 1 else f"steps {profiled[0]}-{profiled[-1]}"
        why = "for the GPU-busy column" if busy else "without completing a GPU-busy measurement"
        title += f" ({which} ran under the profiler {why}, left out of the others)"
    title += ":"
    text = title + "\n" + table(tuple(header), rows)
    if data.get("roofline"):
        text += "\n" + roofline_table(data)
    return text + "\n" + verdict(data)


CLOCKS = {  # what each clock's times mean
    "perf_counter": ": host time",
    "cuda_event": ": device time between the marks, idle gaps included",
}

HINTS = {
    "forward": "a larger batch per rank or fewer, larger ops",
    "backward": "more overlap of the all-reduce with backward (smaller buckets; see the all-reduce table)",
    "update": "a fused or foreach optimizer (--model.fused true)",
    "other": "less per-step Python: callbacks, logging, printing every step",
}


def verdict(data: dict[str, Any]) -> str:
    """One line: what bounds the step, and what would help."""
    steps = [step[PHASES.index("step")] for step in _steady_rows(data, 0)]
    step_ms = statistics.median(steps)
    busy = data.get("busy_ms")
    if busy:
        share = statistics.median(step[PHASES.index("step")] for step in busy[0]) / step_ms if step_ms else 0.0
        if share >= 0.8:
            return (f"Verdict: GPU-bound: the GPU was busy {share:.0%} of the step; lower precision (bf16), "
                    "fewer FLOPs or faster kernels would help")  # fmt: skip
        return (f"Verdict: host-bound: the GPU was busy {share:.0%} of the step; larger batches, fewer kernel "
                "launches (fused Adam, CUDA graphs) or less per-step Python would help")  # fmt: skip
    if data["clock"] == "cuda_event":
        why = "no profiled step completed on every rank" if "profiled_steps" in data else "PhaseTimer(kernel_steps=0)"
        return f"Verdict: unknown: GPU-busy time was not measured ({why})"
    shares = {
        p: statistics.median(step[i] for step in _steady_rows(data, 0)) / step_ms for i, p in enumerate(PHASES[:4])
    }
    top = max(shares, key=shares.get)
    return f"Verdict: a CPU run (no device to idle): {top} is {shares[top]:.0%} of the step; {HINTS[top]} would help"


def roofline_table(data: dict[str, Any]) -> str:
    """Achieved FLOP/s of forward and backward, achieved bytes/s of the update, and fractions of peak."""
    r = data["roofline"]
    med = {p: statistics.median(step[i] for step in _steady_rows(data, 0)) for i, p in enumerate(PHASES)}
    rows = []
    for phase, work, unit, peak in (
        ("forward", r["forward_flop"], "GFLOP/s", r.get("peak_tflops")),
        ("backward", r["backward_flop"], "GFLOP/s", r.get("peak_tflops")),
        ("update", r["update_bytes"], "GB/s", r.get("peak_gbps")),
    ):
        rate = work / (med[phase] / 1e3) / 1e9 if med[phase] > 0 else float("nan")
        peak_rate = peak * 1e3 if (peak and unit == "GFLOP/s") else peak
        frac = f"{rate / peak_rate:.1%}" if peak_rate else "-"
        amount = f"{work / 1e9:.3f} GFLOP" if unit == "GFLOP/s" else f"{work / 1e6:.1f} MB"
        rows.append((phase, amount, fmt_ms(med[phase]), f"{rate:,.1f} {unit}", frac))
    return "Roofline (rank 0, steady median):\n" + table(("phase", "work", "time", "achieved", "of peak"), rows)


def comm_table(data: dict[str, Any]) -> str:
    """Per bucket: bytes, all-reduce time, algbw and busbw (nccl-tests definitions); per step: totals.

    Buckets are those of the final layout (DDP rebuilds its buckets after the first step), timed over the
    steady steps that used it.
    """
    n = data["world_size"]
    ring = 2 * (n - 1) / n
    layout = data["bucket_bytes"]
    same_layout = [i for i, sizes in enumerate(data["bucket_bytes_per_step"]) if sizes == layout]
    steady = _steady(same_layout) if same_layout[0] == 0 else same_layout
    rows = []
    for b, nbytes in enumerate(layout):
        t = statistics.median(data["ms"][0][i][b] for i in steady)
        algbw = nbytes / (t / 1e3) / 1e9 if t > 0 else float("nan")
        rows.append((b, f"{nbytes:,}", fmt_ms(t), f"{algbw:.2f} GB/s", f"{algbw * ring:.2f} GB/s"))
    total = sum(layout)
    exposed = statistics.median(_steady(data["exposed_ms"][0]))
    busy = statistics.median(_steady(data["busy_ms"][0]))
    first = data["bucket_bytes_per_step"][0]
    rebuilt = f" (step 0 ran on DDP's initial {len(first)} bucket(s))" if first != layout else ""
    compression = data.get("compression") or "none"
    return (
        f"Gradient all-reduce per step ({n} ranks, compression {compression}, rank 0, steady median):\n"
        + table(("bucket", "bytes", "time", "algbw", "busbw"), rows)
        + f"\n{len(layout)} bucket(s){rebuilt}, {total:,} bytes reduced per step "
        f"({data['param_bytes']:,} bytes of gradients); each rank sends 2(n-1)/n x S = {ring * total:,.0f} bytes "
        f"in a ring all-reduce.\ncommunication {fmt_ms(busy)} per step, of which {fmt_ms(exposed)} exposed "
        f"(not hidden under backward compute)"
    )


def plot(phases: dict[str, Any], comm: dict[str, Any] | None, out: Path) -> Path:
    """Left: stacked phase bars per step (rank 0). Right: a timeline of one steady step per rank: the phases as
    segments, each bucket's all-reduce as a segment below them, its exposed part (after backward) hatched."""
    # The Figure API, not pyplot: no backend switch and no global state, so this also works inside a notebook
    # without breaking its inline plots.
    from matplotlib.figure import Figure

    ms = phases["ms"]
    colors = {"forward": "#4C72B0", "backward": "#DD8452", "update": "#55A868", "other": "#BBBBBB"}
    fig = Figure(figsize=(13, 4.5))
    ax_step, ax_line = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 2]})
    steps = phases["steps"]
    bottom = [0.0] * len(steps)
    for i, phase in enumerate(PHASES[:4]):
        heights = [max(row[i], 0.0) for row in ms[0]]
        ax_step.bar(steps, heights, bottom=bottom, color=colors[phase], label=phase)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax_step.set(title=f"per step, rank 0 ({phases['clock']})", xlabel="step", ylabel="ms")
    ax_step.legend(loc="upper right", fontsize=8)
    if "offsets_ms" in phases:
        _timeline(ax_line, phases, comm, colors)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


def _timeline(ax, phases: dict[str, Any], comm: dict[str, Any] | None, colors: dict[str, str]) -> None:
    """One steady step per rank (the step whose rank-0 time is the median), ms from the step's start."""
    steady = _steady_indices(phases)
    by_time = sorted(steady, key=lambda i: phases["ms"][0][i][PHASES.index("step")])
    index = by_time[len(by_time) // 2]
    at = {name: i for i, name in enumerate(phases["boundaries"])}
    spans = (("forward", "forward_start", "forward_end"), ("backward", "backward_start", "backward_end"),
             ("update", "update_start", "update_end"))  # fmt: skip
    for rank, offsets in enumerate(phases["offsets_ms"]):
        marks = offsets[index]
        y = 2 * rank
        ax.broken_barh([(0, marks[at["end"]])], (y + 0.55, 0.4), color=colors["other"])
        for phase, start, end in spans:
            ax.broken_barh([(marks[at[start]], marks[at[end]] - marks[at[start]])], (y + 0.55, 0.4),
                           color=colors[phase], label=phase if rank == 0 else None)  # fmt: skip
        if comm is None or index >= len(comm["ms"][rank]):
            continue
        backward_start, backward_end = marks[at["backward_start"]], marks[at["backward_end"]]
        ready, durations = comm["ready_ms"][rank][index], comm["ms"][rank][index]
        last_ready = backward_start + max(ready)
        for b, (r, d) in enumerate(zip(ready, durations, strict=True)):
            start, end = backward_start + r, backward_start + r + d
            ax.broken_barh([(start, d)], (y + 0.05, 0.4), facecolor="#8172B3", edgecolor="white",
                           label="all-reduce (one per bucket)" if rank == 0 and b == 0 else None)  # fmt: skip
            if end > last_ready:  # what runs after the last gradient is ready is not hidden under compute
                lo = max(start, last_ready)
                ax.broken_barh([(lo, end - lo)], (y + 0.05, 0.4), facecolor="none", edgecolor="#C44E52",
                               hatch="///", label="exposed" if rank == 0 and b == 0 else None)  # fmt: skip
        ax.vlines(backward_end, y, y + 1, color="#888888", lw=0.8)  # backward's compute ends
    ax.set_yticks([2 * r + 0.5 for r in range(len(phases["offsets_ms"]))])
    ax.set_yticklabels([f"rank {r}" for r in range(len(phases["offsets_ms"]))])
    ax.set(title=f"timeline of step {phases['steps'][index]} (the median step)", xlabel="ms from the step's start")
    ax.legend(loc="upper right", fontsize=8)


def load(run_dir: Path) -> tuple[dict | None, dict | None]:
    def read(name: str) -> dict | None:
        path = run_dir / name
        return json.loads(path.read_text()) if path.is_file() else None

    return read("phases.json"), read("comm.json")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lit_ddp.report", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a run's log directory (it holds phases.json / comm.json)")
    parser.add_argument("--no-plot", action="store_true", help="tables only")
    forecast.add_arguments(parser)
    args = parser.parse_args(argv)
    if not args.run_dir.is_dir():
        parser.error(f"{args.run_dir} is not a directory")
    phases, comm = load(args.run_dir)
    if phases is None and comm is None:
        parser.error(f"{args.run_dir} holds neither phases.json nor comm.json: was PhaseTimer or CommMonitor on?")
    if phases is not None:
        print(phase_table(phases))
    if comm is not None:
        print(comm_table(comm))
    if phases is not None and not args.no_plot:
        try:
            out = plot(phases, comm, args.run_dir / "phases.png")
        except ImportError:
            print("no picture: matplotlib is missing (pip install 'lit_ddp[plot]')", file=sys.stderr)
            return 1
        print(f"wrote {out}")
    if args.forecast:
        try:
            print(forecast.run(args, args.run_dir))
        except forecast.ForecastError as err:
            parser.error(str(err))
    return 0


if __name__ == "__main__":
    sys.exit(main())
