"""The tuner's search: which DDP configurations to try, in what order, and when a difference is real.

    python -m lit_ddp.tune --devices 2 --tune.budget_s 120     # lit_ddp.tuner.DDPTuner runs this search

Pure logic over measured trials (``Trial``: each round's median step, the slowest rank's), so that it is tested on
hand-made ones. A difference is real only when the rounds do not overlap: the faster configuration's slowest round
beats the other's fastest. The search is greedy, one knob at a time from the user's configuration, and keeps a
change only when it is real; which knobs it tries follows from the first measurement (docs/tuning.md).
"""

import dataclasses
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Optional

from lit_ddp.tuner.knobs import Knobs, Model, bucket_caps


@dataclass
class Trial:
    """What one configuration measured: the median step of each round (ms, slowest rank), and what it holds."""

    knobs: Knobs
    rounds_ms: list[float] = field(default_factory=list)
    ddp_bytes: Optional[int] = None  # DDP's own memory from the live objects (parameters, gradients, buckets, state)
    peak_bytes: Optional[int] = None  # the caching allocator's peak over the trial (CUDA only)
    loss: Optional[float] = None  # the loss of the trial's last step
    max_dw: Optional[float] = None  # max |w - w_yours| after the same steps from the same start
    in_sync: bool = True  # every rank holds rank 0's weights at the trial's end
    seconds: float = 0.0  # wall time of all its rounds

    @property
    def median(self) -> float:
        return statistics.median(self.rounds_ms)

    @property
    def low(self) -> float:
        return min(self.rounds_ms)

    @property
    def high(self) -> float:
        return max(self.rounds_ms)

    @property
    def spread(self) -> float:
        """Half the range of the rounds, as a fraction of the median: the noise this trial measured."""
        return (self.high - self.low) / 2 / self.median if self.median else 0.0


def faster(a: Trial, b: Trial) -> bool:
    """``a`` is faster than ``b`` beyond the noise both measured: a's slowest round beats b's fastest."""
    return a.high < b.low


def _holds_less(a: Trial, b: Trial) -> bool:
    return a.ddp_bytes is not None and b.ddp_bytes is not None and a.ddp_bytes < b.ddp_bytes


def speedup(base: Trial, other: Trial) -> tuple[float, float, float]:
    """``base`` over ``other``: the medians' ratio, and the lowest and highest ratio the rounds allow."""
    return base.median / other.median, base.low / other.high, base.high / other.low


@dataclass
class Outcome:
    base: Trial
    no_comm: Optional[Trial]
    best: Trial
    trials: list[Trial]
    skipped: list[tuple[str, str]]  # candidates not tried or not kept, and why


def stages(model: Model, base: Knobs, comm_shows: bool, allow_lossy: bool) -> list[tuple[str, list[Knobs]]]:
    """The knobs to try, one stage per knob, each candidate a change of ``base`` (the search applies the best so far
    on top). Bucket caps and compression only when communication shows in the step."""
    out: list[tuple[str, list[Knobs]]] = []
    if comm_shows and model.world_size > 1:
        caps = bucket_caps(model.grad_bytes, base.bucket_cap_mb)
        if caps:
            out.append(("bucket_cap_mb", [dataclasses.replace(base, bucket_cap_mb=c) for c in caps]))
    if not base.gradient_as_bucket_view:
        out.append(("gradient_as_bucket_view", [dataclasses.replace(base, gradient_as_bucket_view=True)]))
    if base.find_unused_parameters and not model.unused_parameters:
        out.append(("find_unused_parameters", [dataclasses.replace(base, find_unused_parameters=False)]))
    if not base.static_graph and not model.unused_parameters:
        out.append(("static_graph", [dataclasses.replace(base, static_graph=True)]))
    if base.broadcast_buffers and model.has_buffers:
        out.append(("broadcast_buffers", [dataclasses.replace(base, broadcast_buffers=False)]))
    impls = [i for i in model.optimizer_impls if i != base.optimizer]
    if impls:
        out.append(("optimizer", [dataclasses.replace(base, optimizer=i) for i in impls]))  # type: ignore[arg-type]
    if allow_lossy and comm_shows and model.world_size > 1:
        hooks = [*(("fp16", "bf16") if model.bf16 else ("fp16",)), "powersgd1", "powersgd4"]  # bf16: NCCL only
        out.append(("comm_hook", [dataclasses.replace(base, comm_hook=h) for h in hooks]))  # type: ignore[arg-type]
    return out


def search(measure: Callable[[Knobs], Trial], model: Model, base: Knobs, budget_s: float,
           allow_lossy: bool = False) -> Outcome:  # fmt: skip
    """Measures ``base`` and the step without communication, then each stage's candidates on top of the best so
    far; keeps a candidate only when it is ``faster`` than the best, or level with it within the noise and holding
    less memory (``gradient_as_bucket_view``: DDP's own bytes, measured). Stops trying once the trials' wall time
    would pass ``budget_s`` (a candidate is started only if a trial as long as the longest so far still fits).
    ``measure`` must return the same numbers on every rank (the tuner all-reduces them): every rank then takes
    the same path."""
    trials = [measure(base)]
    no_comm = measure(dataclasses.replace(base, comm_hook="noop")) if model.world_size > 1 else None  # type: ignore[arg-type]
    spent = trials[0].seconds + (no_comm.seconds if no_comm else 0.0)
    comm_shows = no_comm is not None and faster(no_comm, trials[0])
    best = trials[0]
    skipped: list[tuple[str, str]] = []
    for _, candidates in stages(model, base, comm_shows, allow_lossy):
        stage_best = best
        for candidate in candidates:
            knobs = dataclasses.replace(best.knobs, **candidate.changes(base))
            if knobs in (t.knobs for t in trials):
                continue
            longest = max(t.seconds for t in trials)
            if spent + longest > budget_s:
                skipped.append((knobs.label(base), f"budget ({budget_s:g} s) spent"))
                continue
            trial = measure(knobs)
            trials.append(trial)
            spent += trial.seconds
            if not trial.in_sync:
                skipped.append((knobs.label(base), "ranks out of sync after it: not kept"))
            elif faster(trial, stage_best) or (not faster(stage_best, trial) and _holds_less(trial, stage_best)):
                stage_best = trial  # faster beyond the noise; or level within it, and holding less memory
        best = stage_best
    if no_comm is not None and not comm_shows:
        skipped.append(("bucket_cap_mb, comm_hook", "not tried: the step without any all-reduce is no faster "
                        "beyond the noise, so no bucket size or compression can shorten it"))  # fmt: skip
    return Outcome(trials[0], no_comm, best, trials, skipped)


def grid(measure: Callable[[Knobs], Trial], model: Model, base: Knobs, allow_lossy: bool = False) -> Outcome:
    """Every combination of the knobs ``search`` could try (as if communication showed): the reference a
    benchmark holds the search against. The best is the fastest median among the trials that kept the ranks in
    sync; slow, as it has no budget."""
    trials = [measure(base)]
    no_comm = measure(dataclasses.replace(base, comm_hook="noop")) if model.world_size > 1 else None  # type: ignore[arg-type]
    combos: list[Knobs] = [base]
    for _, candidates in stages(model, base, comm_shows=True, allow_lossy=allow_lossy):
        combos += [dataclasses.replace(k, **c.changes(base)) for k in combos for c in candidates]
    for knobs in combos[1:]:
        trials.append(measure(knobs))
    best = min((t for t in trials if t.in_sync), key=lambda t: t.median)
    return Outcome(trials[0], no_comm, best, trials, [])


def head_to_head(measure: Callable[[Knobs], Trial], base: Knobs, configs: Sequence[Knobs], rounds: int) -> Outcome:
    """``base`` and ``configs`` head to head: one round of each in turn (``measure`` times one), ``rounds``
    times, so that the machine's drift over the run falls on every configuration alike. The best is the fastest
    median among the trials ``faster`` than ``base`` beyond the noise that kept the ranks in sync; else ``base``."""
    trials = {knobs: Trial(knobs) for knobs in (base, *configs)}  # the user's first: max |Δw|'s reference
    for _ in range(rounds):
        for knobs, trial in trials.items():
            one = measure(knobs)
            trial.rounds_ms += one.rounds_ms
            trial.seconds += one.seconds
            trial.loss, trial.ddp_bytes, trial.peak_bytes = one.loss, one.ddp_bytes, one.peak_bytes
            trial.in_sync = trial.in_sync and one.in_sync
            if one.max_dw is not None:
                trial.max_dw = max(trial.max_dw or 0.0, one.max_dw)
    measured = list(trials.values())
    better = (t for t in measured[1:] if t.in_sync and faster(t, measured[0]))
    return Outcome(measured[0], None, min(better, key=lambda t: t.median, default=measured[0]), measured, [])


def to_record(outcome: Outcome, rows: int) -> dict:
    """The outcome as plain JSON-ready data (what ``--out``'s .json holds, and what a ``ddp_fork`` rank carries
    back): every trial with its median and spread, the user's and the best knobs."""

    def trial(t: Trial) -> dict:
        return {**dataclasses.asdict(t), "median_ms": t.median, "spread": t.spread}

    return {
        "base": dataclasses.asdict(outcome.base.knobs),
        "best": dataclasses.asdict(outcome.best.knobs),
        "samples_per_step": rows,
        "no_comm": trial(outcome.no_comm) if outcome.no_comm else None,
        "trials": [trial(t) for t in outcome.trials],
        "skipped": [list(s) for s in outcome.skipped],
    }
