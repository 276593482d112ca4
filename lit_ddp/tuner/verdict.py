"""What the tuner prints: every trial as a table, the verdict, and the strategy line of a script.

    python -m lit_ddp.tune --devices 2        # rank 0 prints report(outcome) once the trials are done

How to read the table and what the verdict rests on: docs/tuning.md.
"""

from lit_ddp.analysis.memory import fmt_bytes
from lit_ddp.analysis.tables import fmt_ms, table
from lit_ddp.tuner.knobs import Knobs
from lit_ddp.tuner.search import Outcome, faster, speedup


def report(outcome: Outcome, rows: int) -> str:
    """Every trial, and the verdict: the fastest against the user's configuration, with the rounds' range."""
    base, best = outcome.base, outcome.best
    memory_title = "peak memory" if base.peak_bytes is not None else "DDP holds"
    no_comm = outcome.no_comm.median if outcome.no_comm else None
    lines_rows = []
    for trial in outcome.trials:
        # Against the step without all-reduce of the user's configuration: for the DDP knobs only (an optimizer
        # of its own changes the compute too).
        same_compute = trial.knobs.optimizer == base.knobs.optimizer
        exposed = fmt_ms(max(0.0, trial.median - no_comm)) if no_comm is not None and same_compute else "-"
        memory = trial.peak_bytes if trial.peak_bytes is not None else trial.ddp_bytes
        lines_rows.append((
            trial.knobs.label(base.knobs) + (" *" if trial is best else ""),
            fmt_ms(trial.median),
            f"{fmt_ms(trial.low)}-{fmt_ms(trial.high)}",
            exposed,
            f"{rows / trial.median * 1e3:,.0f}" if rows else "-",
            fmt_bytes(memory) if memory is not None else "-",
            f"{trial.loss:.6g}" if trial.loss is not None else "-",
            "0" if trial.max_dw == 0 else f"{trial.max_dw:.2g}" if trial.max_dw is not None else "-",
            "yes" if trial.in_sync else "NO",
        ))  # fmt: skip
    lines = [
        f"DDP tuning: {len(outcome.trials)} configuration(s), {len(base.rounds_ms)} rounds each; "
        "step = median round (slowest rank), rounds = their range",
        table(
            (
                "configuration",
                "step",
                "rounds",
                "exposed comm",
                "samples/s",
                memory_title,
                "loss",
                "max |Δw|",
                "in sync",
            ),
            lines_rows,
        ),  # fmt: skip
    ]
    if outcome.no_comm is not None:
        lines.append(f"without any all-reduce (noop hook, a reference): step {fmt_ms(outcome.no_comm.median)} "
                     f"({fmt_ms(outcome.no_comm.low)}-{fmt_ms(outcome.no_comm.high)})")  # fmt: skip
    for what, why in outcome.skipped:
        lines.append(f"{what}: {why}")
    lines.append(verdict(outcome))
    return "\n".join(lines)


def verdict(outcome: Outcome) -> str:
    base, best = outcome.base, outcome.best
    if best is base:
        noise = max(t.spread for t in outcome.trials)
        return (f"Verdict: keep your configuration: no configuration tried beats it beyond the noise (rounds within "
                f"±{noise:.0%})" + _compression_hint(outcome))  # fmt: skip
    ratio, low, high = speedup(base, best)
    saved = (base.ddp_bytes or 0) - (best.ddp_bytes or 0)
    memory = f", {fmt_bytes(saved)} less held per rank" if saved > 0 else ""
    return (f"Verdict: {best.knobs.label(base.knobs)}: step {fmt_ms(base.median)} -> {fmt_ms(best.median)}, "
            f"{ratio:.2f}x ({low:.2f}x-{high:.2f}x over the rounds){memory}, measured by lit_ddp.tune"
            + _compression_hint(outcome))  # fmt: skip


def _compression_hint(outcome: Outcome) -> str:
    """Where the all-reduce still shows in the best step (beyond the noise, a fifth of it or more), the bytes on
    the wire are what is left to cut: fp16/bf16 compression halves them (lossy, so only measured when allowed)."""
    best, no_comm = outcome.best, outcome.no_comm
    tried = any(t.knobs.lossy for t in outcome.trials)
    if no_comm is None or tried or best.knobs.optimizer != outcome.base.knobs.optimizer or not faster(no_comm, best):
        return ""
    exposed = best.median - no_comm.median
    if exposed < best.median / 5:
        return ""
    return (f". The all-reduce shows {fmt_ms(exposed)} of the {fmt_ms(best.median)} step: fp16/bf16 compression "
            f"halves the bytes on the wire, at most ~{fmt_ms(exposed / 2)} less (an estimate; --tune.allow_lossy "
            "measures it)")  # fmt: skip


def strategy_line(knobs: Knobs) -> str:
    """The ``LitDDPStrategy(...)`` of a script for ``knobs``."""
    args = [f"{k}={v!r}" for k, v in knobs.changes(Knobs()).items() if k not in ("comm_hook", "optimizer")]
    if knobs.comm_hook in ("fp16", "bf16"):
        args.append(f"ddp_comm_hook=default_hooks.{knobs.comm_hook}_compress_hook")
    elif knobs.comm_hook.startswith("powersgd"):
        args.append(f"powersgd_rank={knobs.comm_hook.removeprefix('powersgd')}")
    return f"LitDDPStrategy({', '.join(args)})"


def script_lines(knobs: Knobs) -> list[str]:
    """The lines a script runs to get ``knobs``' strategy (``strategy = LitDDPStrategy(...)``, with its imports)."""
    lines = ["from lit_ddp.run.strategy import LitDDPStrategy"]
    if knobs.comm_hook in ("fp16", "bf16"):
        lines.append("from torch.distributed.algorithms.ddp_comm_hooks import default_hooks")
    return [*lines, f"strategy = {strategy_line(knobs)}"]
