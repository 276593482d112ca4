"""The tuner's search: which DDP configurations to try, in what order, and which one is kept.

    python -m lit_ddp.tune --devices 2 --tune.budget_s 120     # lit_ddp.tuner.DDPTuner runs this search

Pure logic over measured trials, so that it is tested on hand-made ones. Configurations are measured in
interleaved rounds, and "faster" is the noise model's word (``trial.compare``) at a level that holds for the whole
search (Bonferroni). The step without any all-reduce is a floor: a step measured below it, or a floor above the
user's step, is noise, measured again and never a win. How it goes: docs/tuning.md.
"""

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Optional

from lit_ddp.derive import noise
from lit_ddp.tuner.knobs import Knobs, Model, bucket_caps
from lit_ddp.tuner.trial import MIN_GAIN, Comparison, Rounds, Trial, compare

CONFIDENCE = 0.95  # for the search as a whole: every comparison it makes together
RETRIES = 1  # times a measurement that the floor shows to be noise is taken again
# The head to head's rounds, at most, where the budget allows more than the stages' (three default tunes of the
# notes' model took 14-17 s of their 120 s budget, and gave two answers: the fused optimizer, a real 1.3-1.9x cut
# of the step at dim 1024 here, was called faster head to head in one of them and level in the others); a close
# call in a stage gets as many.
CONFIRM_ROUNDS = 8


@dataclass
class Outcome:
    base: Trial  # the user's configuration, every round of it (a row of the table)
    no_comm: Optional[Trial]  # the same step without any all-reduce (the noop hook): the floor
    best: Trial  # the pick, all a config can carry (``base`` when nothing beats it)
    trials: list[Trial]  # every configuration measured, every round of each
    skipped: list[tuple[str, str]]  # candidates not tried or not kept, and why
    notes: list[str] = field(default_factory=list)  # where the noise showed, and what was measured again
    verdict: Optional[Comparison] = None  # the pick against yours, in fresh interleaved rounds (None: yours kept)
    script: Optional[tuple[Knobs, Comparison]] = None  # a change no config can carry, against the pick
    confidence: float = CONFIDENCE  # each comparison's level
    comm_shows: bool = False  # the step is slower than the floor beyond the noise
    extra_rounds: int = 0  # rounds added where a call was close


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


def _floor_of(knobs: Knobs) -> Knobs:
    return dataclasses.replace(knobs, comm_hook="noop")  # type: ignore[arg-type]


def _below(trial: Trial, floor: Optional[Trial], base: Knobs, word: str, level: float) -> bool:
    """``trial`` (the user's compute: their optimizer) measured under the floor, which it cannot be: noise. A speed
    win ("faster") must not be under the floor's median at all, so that no reported win is faster than the step
    without any all-reduce; a level pick (kept for its memory) only not beyond the noise, as it sits at the floor
    wherever the all-reduce hides."""
    if floor is None or trial.knobs.optimizer != base.optimizer:
        return False
    if word == "faster":
        return trial.median < floor.median
    return compare(floor, trial, level).word == "faster"


def _ms(trial: Trial) -> str:
    return f"{trial.median:.2f} ms"


def search(measure: Callable[[Knobs], Trial], model: Model, base: Knobs, budget_s: float, rounds: int = 3,
           allow_lossy: bool = False, optimizer_in_config: bool = True) -> Outcome:  # fmt: skip
    """Measures ``base`` and the floor, then each stage's candidates on top of the best so far, and confirms the
    pick against ``base``; ``measure`` times one round of a configuration (the same numbers on every rank, so every
    rank takes the same path). A candidate is kept when it is faster than the best beyond the noise, or level with
    it and holding less memory; a close call gets more rounds while the budget allows. A stage starts only while
    its rounds fit in ``budget_s`` (at the mean round so far); the confirmation (at most 4 configurations'
    rounds) comes after it, so that a slow machine still confirms what it found.
    With ``optimizer_in_config`` false (the user builds the optimizer), an optimizer change is confirmed apart, as a
    script change with its own figure, and the pick is what a config carries."""
    plan = stages(model, base, comm_shows=True, allow_lossy=allow_lossy)
    comparisons = 2 + sum(len(c) for _, c in plan) + 4  # the floor twice, every candidate, the confirmation's
    level = noise.family_confidence(CONFIDENCE, comparisons)
    bench, notes, skipped = Rounds(measure, budget_s), [], []
    floor_knobs = _floor_of(base) if model.world_size > 1 else None
    yours, floor = _yours_and_floor(bench, base, floor_knobs, rounds, level, notes)
    comm_shows = floor is not None and compare(floor, yours, level).word == "slower"
    best = lean = base  # lean: only the changes kept for their memory (level, lighter)
    for _, candidates in stages(model, base, comm_shows, allow_lossy):
        knobs = [dataclasses.replace(best, **c.changes(base)) for c in candidates]
        knobs = [k for k in dict.fromkeys(knobs) if k not in bench.rows]
        fit = next((n for n in range(len(knobs), 0, -1) if bench.fit(1 + n, rounds)), 0)
        skipped += [(k.label(base), f"budget ({budget_s:g} s) spent") for k in knobs[fit:]]
        if fit:
            kept, lighter = _stage(bench, best, knobs[:fit], rounds, level, floor, base, notes, skipped)
            lean = dataclasses.replace(lean, **kept.changes(best)) if lighter else lean
            best = kept
    outcome = Outcome(bench.rows[base], floor, bench.rows[base], [], skipped, notes, None, None, level, comm_shows)
    _confirm(outcome, bench, best, lean, floor_knobs, rounds, optimizer_in_config)
    outcome.trials = [t for k, t in bench.rows.items() if k != floor_knobs]
    outcome.extra_rounds = bench.extra
    outcome.no_comm = bench.rows.get(floor_knobs) if floor_knobs else None
    if floor is not None and not comm_shows:
        skipped.append(("bucket_cap_mb, comm_hook", "not tried: in the first rounds the step without any all-reduce "
                        "was no faster beyond the noise, so no bucket size or compression can shorten it"))  # fmt: skip
    return outcome


def _yours_and_floor(bench: Rounds, base: Knobs, floor_knobs: Optional[Knobs], rounds: int, level: float,
                     notes: list[str]) -> tuple[Trial, Optional[Trial]]:  # fmt: skip
    """The user's step and the floor, interleaved; a floor above the user's step beyond the noise (removing the
    all-reduce cannot add time) is measured again, and where it stays above, no floor is used."""
    for attempt in range(1 + RETRIES):
        yours, *floor = bench.fresh([base, *([floor_knobs] if floor_knobs else [])], rounds)
        if not floor or compare(yours, floor[0], level).word != "slower":
            return yours, floor[0] if floor else None
        again = "measured again" if attempt < RETRIES else "still, so the all-reduce cannot be told from the noise"
        notes.append(f"the step without any all-reduce ({_ms(floor[0])}) measured slower than yours "
                     f"({_ms(yours)}) beyond the noise, which it cannot be: noise; {again}")  # fmt: skip
    return yours, None


def _stage(bench: Rounds, best: Knobs, knobs: list[Knobs], rounds: int, level: float, floor: Optional[Trial],
           base: Knobs, notes: list[str], skipped: list) -> tuple[Knobs, bool]:  # fmt: skip
    """One knob's candidates against the best so far, interleaved; the best after it, and whether it was kept for
    its memory (level with the best so far, and lighter)."""
    ref, *trials = bench.fresh([best, *knobs], rounds)
    words = {t.knobs: compare(ref, t, level) for t in trials}
    for _ in range(max(rounds, CONFIRM_ROUNDS - rounds)):  # a close call (can't tell yet, a win worth having not
        # ruled out): more rounds, while the budget allows, up to the head to head's
        close = [t for t in trials if _close(words[t.knobs])]
        if not close or not bench.fit(1 + len(close), 1):
            break
        bench.more([ref, *close])
        bench.extra += 1
        words.update({t.knobs: compare(ref, t, level) for t in trials})
    for t in trials:
        if not t.in_sync:
            skipped.append((t.knobs.label(base), "ranks out of sync after it: not kept"))
    kept = [t for t in trials if t.in_sync]
    faster = [t for t in kept if words[t.knobs].word == "faster"]
    lighter = [t for t in kept if words[t.knobs].word == "same" and t.holds_less(ref)]  # level, less memory
    pick = min(faster, key=lambda t: t.median) if faster else min(lighter, key=lambda t: t.ddp_bytes or 0, default=None)
    if pick is None:
        return best, False
    if not _below(pick, floor, base, words[pick.knobs].word, level):
        return pick.knobs, not faster
    said = f"{pick.knobs.label(base)} measured {_ms(pick)}, under the step without any all-reduce ({_ms(floor)}): noise"
    if not bench.fit(3, rounds):
        notes.append(f"{said}, not kept (no budget left to measure it again)")
        return best, False
    ref, again, floor = bench.fresh([ref.knobs, pick.knobs, floor.knobs], rounds)
    word = compare(ref, again, level).word
    kept = not _below(again, floor, base, word, level) and (
        word == "faster" or (word == "same" and again.holds_less(ref))
    )
    notes.append(f"{said}; measured again: {_ms(again)} against {_ms(ref)}, the floor {_ms(floor)}: "
                 + ("kept" if kept else "not kept"))  # fmt: skip
    return (pick.knobs, word != "faster") if kept else (best, False)


def _close(c: Comparison) -> bool:
    """Not beyond the noise yet, leaning faster, and a gain over ``MIN_GAIN`` still inside the interval."""
    return c.word == "same" and c.difference.estimate < 0 and c.speedup.high > 1 + MIN_GAIN


def _confirm(outcome: Outcome, bench: Rounds, pick: Knobs, lean: Knobs, floor_knobs: Optional[Knobs], rounds: int,
             optimizer_in_config: bool) -> None:  # fmt: skip
    """The pick against the user's configuration in fresh interleaved rounds, with the floor beside them: the
    verdict's figures. Faster there, it is the verdict; level, only the changes kept for their memory (``lean``)
    stand, if they hold less: a speed change that is not faster head to head is not kept. A pick under the floor
    is noise, measured again, and never a win."""
    base = outcome.base.knobs
    if pick == base:
        return
    carried, lean = (pick, lean) if optimizer_in_config else (_no_optimizer(pick, base), _no_optimizer(lean, base))
    plain = _no_optimizer(carried, base)  # the DDP changes alone: the optimizer's own figure is against them
    with_opt = [dataclasses.replace(k, optimizer=carried.optimizer) for k in (lean, base)] if plain != carried else []
    floors = [floor_knobs] if floor_knobs else []
    configs = list(dict.fromkeys([base, carried, lean, pick, plain, *with_opt, *floors]))
    for attempt in range(1 + RETRIES):
        n = rounds
        while n < CONFIRM_ROUNDS and bench.fit(len(configs), n + 1):
            n += 1
        lineup = bench.fresh(configs, n)
        got = {t.knobs: t for t in lineup}
        floor = got.get(floor_knobs) if floor_knobs else None
        choice, verdict = _choose(got, base, carried, lean, outcome.confidence)
        if choice is None or not _below(got[choice], floor, base, verdict.word, outcome.confidence):
            break
        again = "measured again" if attempt < RETRIES else "not reported as a win"
        outcome.notes.append(f"{choice.label(base)} measured {_ms(got[choice])} head to head with yours, under "
                             f"the step without any all-reduce ({_ms(floor)}): noise; {again}")  # fmt: skip
    else:
        return
    if choice is not None:
        outcome.best = bench.rows[choice]
        outcome.verdict = dataclasses.replace(verdict, floor_ms=floor.median if floor is not None else None)
    if choice != carried and carried != base:
        v = compare(got[base], got[carried], outcome.confidence)
        outcome.notes.append(
            f"{carried.label(base)} was kept in the stages, but head to head with yours it is "
            f"{v.word} ({v.after_ms:.2f} against {v.before_ms:.2f} ms): "
            + (
                f"{choice.label(base)} is kept" + (", for its memory" if choice == lean else "")
                if choice
                else "yours is kept"
            )  # fmt: skip
        )
    if pick != carried and choice == carried:
        script = compare(got[carried], got[pick], outcome.confidence)
        if script.word == "faster":
            outcome.script = (pick, script)
        else:
            outcome.notes.append(f"optimizer={pick.optimizer} (a change to configure_optimizers, which a config "
                                 f"cannot carry): {script.word} head to head, {script.after_ms:.2f} against "
                                 f"{script.before_ms:.2f} ms: not advised")  # fmt: skip


def _no_optimizer(knobs: Knobs, base: Knobs) -> Knobs:
    return dataclasses.replace(knobs, optimizer=base.optimizer)


def _choose(got: dict[Knobs, Trial], base: Knobs, carried: Knobs, lean: Knobs,
            level: float) -> tuple[Optional[Knobs], Optional[Comparison]]:  # fmt: skip
    """What the confirmation's rounds back: the pick if its step is faster than yours; else, where it changes the
    optimizer, the DDP changes that stand on their own (all of the pick's where they are faster than yours, the
    memory ones where those are level and lighter, else none) with the optimizer change on top of them where it is
    faster in the update, the one phase it changes (the step's noise can hide a real cut of the update); else the
    changes kept for their memory alone, if level with yours (or faster) and lighter; else nothing."""
    verdict = compare(got[base], got[carried], level) if carried != base else None
    if verdict is not None and verdict.word == "faster":
        return carried, verdict
    lighter = _lighter(got, base, carried, lean, level, verdict)
    plain = _no_optimizer(carried, base)
    if plain != carried:
        under = plain if plain != base and compare(got[base], got[plain], level).word == "faster" else \
            lighter[0] or base  # fmt: skip
        top = dataclasses.replace(under, optimizer=carried.optimizer)
        optimizer = compare(got[under], got[top], level)
        if optimizer.word == "faster":
            if under == base:  # the optimizer alone: its comparison is the verdict's
                return top, optimizer
            return top, dataclasses.replace(compare(got[base], got[top], level), word="faster", because=optimizer)
    return lighter


def _lighter(got: dict[Knobs, Trial], base: Knobs, carried: Knobs, lean: Knobs, level: float,
             verdict: Optional[Comparison]) -> tuple[Optional[Knobs], Optional[Comparison]]:  # fmt: skip
    """The changes kept for their memory (``lean``), where they are faster than yours or level and lighter."""
    if lean == base:
        return None, None
    v = verdict if lean == carried and verdict is not None else compare(got[base], got[lean], level)
    if v.word == "faster" or (v.word == "same" and got[lean].holds_less(got[base])):
        return lean, v
    return None, None


def grid(measure: Callable[[Knobs], Trial], model: Model, base: Knobs, rounds: int = 3,
         allow_lossy: bool = False) -> Outcome:  # fmt: skip
    """Every combination of the knobs ``search`` could try (as if communication showed), in interleaved rounds:
    the reference a benchmark holds the search against. The best is the fastest median among the trials that
    kept the ranks in sync (the least of many noisy figures: a reference, not a verdict); slow, as it has no
    budget."""
    combos: list[Knobs] = [base]
    for _, candidates in stages(model, base, comm_shows=True, allow_lossy=allow_lossy):
        combos += [dataclasses.replace(k, **c.changes(base)) for k in combos for c in candidates]
    floor_knobs = _floor_of(base) if model.world_size > 1 else None
    level = noise.family_confidence(CONFIDENCE, len(combos))
    bench = Rounds(measure)
    trials = bench.fresh([*combos, *([floor_knobs] if floor_knobs else [])], rounds)
    floor = trials.pop() if floor_knobs else None
    best = min((t for t in trials if t.in_sync), key=lambda t: t.median)
    verdict = compare(trials[0], best, level) if best is not trials[0] else None
    return Outcome(trials[0], floor, best, trials, [], [], verdict, None, level)


def head_to_head(measure: Callable[[Knobs], Trial], base: Knobs, configs: Sequence[Knobs], rounds: int) -> Outcome:
    """``base`` and ``configs`` head to head: one round of each in turn, ``rounds`` times, so that the machine's
    drift over the run falls on every configuration alike. The best is the fastest median among those faster
    than ``base`` beyond the noise (at a level that holds for all of them together) that kept the ranks in sync;
    else ``base``."""
    measured = Rounds(measure).fresh([base, *configs], rounds)  # the user's first: max |Δw|'s reference
    level = noise.family_confidence(CONFIDENCE, max(1, len(measured) - 1))
    words = {t.knobs: compare(measured[0], t, level) for t in measured[1:]}
    better = [t for t in measured[1:] if t.in_sync and words[t.knobs].word == "faster"]
    best = min(better, key=lambda t: t.median, default=measured[0])
    verdict = words.get(best.knobs) if best is not measured[0] else None
    return Outcome(measured[0], None, best, measured, [], [], verdict, None, level)


def to_record(outcome: Outcome, rows: int) -> dict:
    """The outcome as plain JSON-ready data (what ``--out``'s .json holds, and what a ``ddp_fork`` rank carries
    back): every trial with every step it timed and its median's 95% interval, the user's and the best knobs (what
    the config carries), the verdict's comparison, and the script change a config cannot carry."""

    def trial(t: Trial) -> dict:
        interval = t.interval()
        return {**dataclasses.asdict(t), "median_ms": t.median, "low_ms": interval.low, "high_ms": interval.high}

    script = outcome.script
    return {
        "base": dataclasses.asdict(outcome.base.knobs),
        "best": dataclasses.asdict(outcome.best.knobs),
        "samples_per_step": rows,
        "confidence": outcome.confidence,
        "verdict": outcome.verdict.as_dict() if outcome.verdict else None,
        "script": {"knobs": dataclasses.asdict(script[0]), **script[1].as_dict()} if script else None,
        "no_comm": trial(outcome.no_comm) if outcome.no_comm else None,
        "trials": [trial(t) for t in outcome.trials],
        "skipped": [list(s) for s in outcome.skipped],
        "notes": outcome.notes,
    }
