"""What the tuner prints: every trial as a table, the verdict, and the strategy line of a script.

    python -m lit_ddp.tune --devices 2        # rank 0 prints report(outcome) once the trials are done

How to read the table and what the verdict rests on: docs/tuning.md.
"""

import dataclasses
import math
import statistics
from typing import Optional

from lit_ddp.derive.noise import Interval
from lit_ddp.formatting import fmt_bytes, fmt_ms, table
from lit_ddp.records import phases
from lit_ddp.tuner.knobs import Knobs
from lit_ddp.tuner.search import CONFIDENCE, Outcome
from lit_ddp.tuner.trial import Comparison, Trial, compare


def report(outcome: Outcome, rows: int) -> str:
    """Every trial, the floor, what was skipped and where the noise showed, and the verdict."""
    base, no_comm = outcome.base, outcome.no_comm
    memory_title = "peak memory" if base.peak_bytes is not None else "DDP holds"
    lines_rows = []
    for trial in outcome.trials:
        interval = trial.interval()
        memory = trial.peak_bytes if trial.peak_bytes is not None else trial.ddp_bytes
        lines_rows.append((
            trial.knobs.label(base.knobs) + (" *" if trial is outcome.best else ""),
            fmt_ms(trial.median),
            f"{fmt_ms(interval.low)}-{fmt_ms(interval.high)}",
            str(len(trial.samples_ms)),
            fmt_ms(statistics.median(trial.update_ms)) if trial.update_ms else "-",
            _exposed(trial, no_comm, base.knobs, outcome.confidence),
            f"{rows / trial.median * 1e3:,.0f}" if rows else "-",
            fmt_bytes(memory) if memory is not None else "-",
            f"{trial.loss:.6g}" if trial.loss is not None else "-",
            "0" if trial.max_dw == 0 else f"{trial.max_dw:.2g}" if trial.max_dw is not None else "-",
            "yes" if trial.in_sync else "NO",
        ))  # fmt: skip
    header = ("configuration", "step", "95% interval", "steps", phases.UPDATE, "exposed comm", "samples/s",
              memory_title, "loss", "max |Δw|", "in sync")  # fmt: skip
    extra = f" (+{outcome.extra_rounds} where a call was close)" if outcome.extra_rounds else ""
    lines = [
        f"DDP tuning: {len(outcome.trials)} configuration(s) in interleaved rounds{extra}; step = the median step "
        f"(slowest rank), update = its optimizer.step(); faster = beyond the noise at {CONFIDENCE:.0%} for all the "
        f"calls together ({outcome.confidence:.2%} each; docs/noise.md)",
        table(header, lines_rows),
    ]
    if no_comm is not None:
        floor = no_comm.interval()
        lines.append(f"without any all-reduce (noop hook, the floor): step {fmt_ms(no_comm.median)} "
                     f"({fmt_ms(floor.low)}-{fmt_ms(floor.high)})")  # fmt: skip
    lines += [f"{what}: {why}" for what, why in outcome.skipped]
    lines += [f"noise: {note}" for note in outcome.notes]
    lines.append(verdict(outcome))
    return "\n".join(lines)


def _exposed(trial: Trial, no_comm: Optional[Trial], base: Knobs, level: float) -> str:
    """What the all-reduce adds to the step over the floor, where that is beyond the noise (at the search's level,
    over every round of both); else "can't tell" with the most the noise allows it to be (a step's difference of
    two noisy medians: CommMonitor's exposed time, measured in each step, may show a few ms that this cannot); for
    the rows whose optimizer is the user's (another one changes the compute too)."""
    if no_comm is None or trial.knobs.optimizer != base.optimizer:
        return "-"
    c = compare(no_comm, trial, level)
    if c.word == "slower":
        return fmt_ms(trial.median - no_comm.median)
    high = c.difference.high
    # A floor slower than the step with its all-reduce (high <= 0) is the machine's noise: no bound to give
    return f"can't tell, <= {fmt_ms(high)}" if math.isfinite(high) and high > 0 else "can't tell"


def _x(interval: Interval) -> str:
    if math.isinf(interval.low) or math.isinf(interval.high):  # the noise model could not bound it
        return f"{interval.estimate:.2f}x (its interval cannot be told from these steps)"
    return f"{interval.estimate:.2f}x ({interval.low:.2f}x-{interval.high:.2f}x)"


def _update(c: Comparison) -> str:
    """An optimizer change's figure: the update's medians, and the step's speedup its difference allows."""
    before, after = c.phase_ms or (math.nan, math.nan)
    return f"the update, the one phase it changes ({fmt_ms(before)} -> {fmt_ms(after)}: the step {_x(c.speedup)})"


def verdict(outcome: Outcome) -> str:
    """The pick against the user's configuration, from the rounds that confirmed it, with its interval; the change
    a config cannot carry, with its own figure; and what is left to cut where the all-reduce still shows."""
    base, best, v = outcome.base, outcome.best, outcome.verdict
    if v is None:
        interval = base.interval()
        noise = (interval.high - interval.low) / 2 / base.median if base.median else 0.0
        said = ("Verdict: keep your configuration: no configuration tried is faster beyond the noise (your step "
                f"{fmt_ms(base.median)}, its 95% interval ±{noise:.0%})")  # fmt: skip
    else:
        saved = (base.ddp_bytes or 0) - (best.ddp_bytes or 0)
        memory = f", {fmt_bytes(saved)} less held per rank" if saved > 0 else ""
        floor = f", no all-reduce at all {fmt_ms(v.floor_ms)}" if v.floor_ms is not None else ""
        steps = f"step {fmt_ms(v.before_ms)} -> {fmt_ms(v.after_ms)}, {_x(v.speedup)} head to head with yours{floor}"
        label = best.knobs.label(base.knobs)
        if v.because is not None:  # the step's own interval could not tell; the optimizer's update did
            rest = dataclasses.replace(best.knobs, optimizer=base.knobs.optimizer)
            on = rest.label(base.knobs) if rest != base.knobs else "your configuration"
            steps += (f", which the step alone cannot tell; optimizer={best.knobs.optimizer} on top of {on} is "
                      f"faster beyond the noise in {_update(v.because)}")  # fmt: skip
        elif v.phase == phases.UPDATE:
            steps += f", faster beyond the noise in {_update(v)}"
        if v.word == "faster":
            said = f"Verdict: {label}: {steps}{memory}, measured by lit_ddp.tune"
        else:
            said = (f"Verdict: {label}: level with yours within the noise ({steps}){memory}: a memory win, not a "
                    "speedup, measured by lit_ddp.tune")  # fmt: skip
    if outcome.script is not None:
        knobs, c = outcome.script
        said += (f". In configure_optimizers, {knobs.optimizer}=True for the optimizer (a change to your script, which "
                 f"the config cannot carry): step {fmt_ms(c.before_ms)} -> {fmt_ms(c.after_ms)}, {_x(c.speedup)} "
                 f"more{f', from {_update(c)}' if c.phase == phases.UPDATE else ''}, measured")  # fmt: skip
    return said + _compression_hint(outcome)


def _compression_hint(outcome: Outcome) -> str:
    """Where the all-reduce still shows in the best step (beyond the noise, a fifth of it or more), the bytes on
    the wire are what is left to cut: fp16/bf16 compression halves them (lossy, so only measured when allowed)."""
    best, no_comm = outcome.best, outcome.no_comm
    tried = any(t.knobs.lossy for t in outcome.trials)
    if no_comm is None or not outcome.comm_shows or tried or best.knobs.optimizer != outcome.base.knobs.optimizer:
        return ""
    if compare(no_comm, best, outcome.confidence).word != "slower":
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
    """The lines a script runs to get ``knobs``' strategy (``strategy = LitDDPStrategy(...)``, with its imports),
    and a comment for an optimizer implementation the pick holds (the optimizer is the module's own to build)."""
    lines = ["from lit_ddp.run.strategy import LitDDPStrategy"]
    if knobs.comm_hook in ("fp16", "bf16"):
        lines.append("from torch.distributed.algorithms.ddp_comm_hooks import default_hooks")
    lines.append(f"strategy = {strategy_line(knobs)}")
    if knobs.optimizer in ("fused", "foreach"):
        impl = knobs.optimizer
        lines.append(f"# and in configure_optimizers, the optimizer with {impl}=True (torch's Adam, AdamW and SGD "
                     f"take it: torch.optim.Adam(self.parameters(), lr=..., {impl}=True))")  # fmt: skip
    return lines
