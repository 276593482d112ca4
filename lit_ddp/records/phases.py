"""The phases of a step, defined once: a row each (its name, the marks that open and close it, the profiler range
the tool opens for it, what it is, its colour). Every other list of phases is read from here.

    python -m lit_ddp.fit --config configs/mini_train_profile.yaml --devices 2     # the phase table's rows

Adding a phase is a row here and the hook that marks it (docs/architecture.md#the-phases).
"""

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Phase:
    """One phase. ``opens``/``closes``: the marks (PhaseTimer's boundaries) its span runs between, in each
    micro-batch; both None for the step's remainder (``other``: the step less every marked phase)."""

    name: str
    opens: Optional[str]
    closes: Optional[str]
    profiler_range: str  # the torch.profiler range PhaseTimer opens at ``opens`` (lit_ddp.measure.profiling)
    meaning: str  # what it is, as the verdict says it
    colour: str  # in the plots
    # Other tools' profiler ranges that hold this phase, read back as it (lit_ddp.derive.trace): regular
    # expressions, each matched against a range's whole name in any case.
    read_from: tuple[str, ...] = ()


# Read at call time (``table()``), never copied at import: a test swaps it for one with a phase more.
TABLE: tuple[Phase, ...] = (
    Phase("forward", "forward_start", "forward_end", "lit_ddp.forward", "the model's compute", "#4C72B0",
          read_from=(r"#+ *forward *#+",
                     r"(\[pl\]\[profile\])?\[Strategy\]\w+\.training_step",  # Lightning's PyTorchProfiler
                     r"DistributedDataParallel\.forward")),  # torch's own
    Phase("backward", "backward_start", "backward_end", "lit_ddp.backward",
          "the model's compute, and the gradient all-reduce where backward does not hide it", "#DD8452",
          read_from=(r"#+ *backward *#+", r"(\[pl\]\[profile\])?\[Strategy\]\w+\.backward")),
    Phase("update", "update_start", "update_end", "lit_ddp.update", "the optimizer's step", "#55A868",
          read_from=(r"#+ *(optimizer|update) *#+",
                     r"(\[pl\]\[profile\])?\[LightningModule\]\w+\.optimizer_step",  # holds the closure's forward
                     r"Optimizer\.step#\w+\.step")),  # torch's own
    Phase("data", "data_start", "end", "lit_ddp.data", "the input pipeline, outside DDP", "#937860"),
    Phase("other", None, None, "lit_ddp.other", "Python between the phases (Lightning's loop, callbacks, logging)",
          "#BBBBBB"),
)  # fmt: skip
STEP = "step"  # the whole step, beside its phases in every per-step row
END = "end"  # the mark that ends a micro-batch (the next one's start)
# The backward DDP all-reduces after: the last micro-batch's (the others run under no_sync), beside the phases.
BACKWARD_LAST = "backward_last"
# The roles some phases play beyond their row, each a name of the table's (tests/test_phase_table.py): what the
# roofline counts (forward's and backward's FLOPs, the update's bytes), what the forecast's model builds a step of
# (the three, and the rest as one), what the tuner judges an optimizer change on (the update).
FORWARD = "forward"  # the model's forward, loss included
BACKWARD = "backward"  # the model's backward
UPDATE = "update"  # the optimizer's step
REMAINDER = "other"  # the phase that is the step less the marked ones (no marks of its own)
ALL_REDUCING = BACKWARD  # the phase DDP's gradient all-reduce runs in (its buckets' hand-overs, its wait)


def table() -> tuple[Phase, ...]:
    return TABLE


def names() -> tuple[str, ...]:
    """The phases, in the table's order (a step's parts)."""
    return tuple(p.name for p in TABLE)


def with_step() -> tuple[str, ...]:
    """The phases and the whole step: the rows of the phase table and the keys of a step's times."""
    return (*names(), STEP)


def marked() -> tuple[Phase, ...]:
    """The phases PhaseTimer marks (all but the remainder)."""
    return tuple(p for p in TABLE if p.opens is not None)


def boundaries() -> tuple[str, ...]:
    """The marks within a step, in the order a micro-batch passes them; ``END`` last."""
    found = [m for p in marked() for m in (p.opens, p.closes) if m != END]
    return (*found, END)


def ranges() -> dict[str, str]:
    """Profiler range -> phase."""
    return {p.profiler_range: p.name for p in TABLE}


def read_as(profiler_range: str) -> Optional[str]:
    """The phase a profiler range holds: the tool's own range's (``profiler_range``), else the first phase one of
    whose ``read_from`` matches the whole name; None for a range of no phase."""
    own, patterns = _readers()
    found = own.get(profiler_range)
    if found is not None:
        return found
    return next((phase for pattern, phase in patterns if pattern.fullmatch(profiler_range)), None)


# The table's readers (its own ranges, the others' patterns compiled), made once for the table in use: a trace holds
# many ranges, and a test swaps the table.
_compiled: tuple[tuple[Phase, ...], dict[str, str], tuple[tuple[re.Pattern, str], ...]] = ((), {}, ())


def _readers() -> tuple[dict[str, str], tuple[tuple[re.Pattern, str], ...]]:
    global _compiled
    if _compiled[0] is not TABLE:
        _compiled = (TABLE, ranges(), tuple((re.compile(r, re.I), p.name) for p in TABLE for r in p.read_from))
    return _compiled[1], _compiled[2]


def range_of(name: str) -> str:
    return next(p.profiler_range for p in TABLE if p.name == name)


def colour(name: str) -> str:
    return next(p.colour for p in TABLE if p.name == name)


def meaning(name: str) -> str:
    return next(p.meaning for p in TABLE if p.name == name)


class StepPhases(Mapping[str, float]):
    """One optimizer step's phases on one rank, in milliseconds, keyed by name (``TABLE``): each summed over the
    step's micro-batches; the remainder (``other``) = ``step`` minus the marked phases; ``data`` runs from the end of
    each batch to the start of the next one (fetching it, Lightning's loop). Validation inside fit is in none of
    them, ``step`` included. ``backward_last``: the last micro-batch's backward, which DDP all-reduces (the others
    run under ``no_sync``). A phase not given is 0; each reads as an attribute too (``ms.forward``)."""

    def __init__(self, values: Mapping[str, float] | Iterable[tuple[str, float]] = (), **named: float) -> None:
        found = {**dict(values), **named}
        for name in (*with_step(), BACKWARD_LAST):
            found.setdefault(name, 0.0)
        self._values = found

    def __getitem__(self, name: str) -> float:
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __getattr__(self, name: str) -> float:
        if name.startswith("_"):  # pickle's and copy's look-ups before _values exists
            raise AttributeError(name)
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"StepPhases has no phase {name!r}") from None

    def __repr__(self) -> str:
        return f"StepPhases({self._values!r})"
