"""Why a job hung: the ranks' records of their collectives, compared, as one line per divergence.

    python -m lit_ddp.report --flight-recorder DIR      # the same comparison, on Flight Recorder dumps

Every collective of a process group has a sequence number, the same on every rank for the same call: the Nth
collective of rank 0 must be the Nth of rank 1, with the same op and sizes. A job hangs (or gloo fails) where
that stops holding. Each rank that fails leaves a ``RankReport``: its last collectives (torch's Flight Recorder
holds op, sizes, dtype and sequence number; lit_ddp adds the step and phase of each, and the user's line of the
collective the rank waited in, from its traceback), and what it was doing when it failed. The first sequence
number at which two ranks' collectives differ, or that some rank never reached, is the divergence: which
ranks called what there, and what each rank that never arrived did instead. docs/failures.md#why-did-it-hang.
"""

from dataclasses import asdict, dataclass, field
from typing import Any, Optional


@dataclass
class Collective:
    """One collective of one rank, as its record holds it."""

    seq: int  # the process group's sequence number: the same call has the same number on every rank
    op: str  # all_reduce, all_gather, broadcast, ...
    sizes: list[list[int]]  # the input tensors' shapes
    dtype: str  # of the first input (Float, Double, ...)
    step: Optional[int] = None  # the optimizer step it was called in
    phase: str = ""  # forward, backward, update, after the step, ... (lit_ddp.measure.collectives.PHASES)
    bucket: Optional[int] = None  # a DDP gradient bucket's all-reduce: its index in the step's backward
    where: str = ""  # the user's line that called it, where known: ``logkeys.py:21 training_step: self.log(...)``

    def call(self) -> str:
        """``all_reduce Float[9] (DDP gradient bucket 0)``"""
        if self.op == "barrier":
            return "barrier"
        shapes = ", ".join("[" + ", ".join(map(str, s)) + "]" for s in self.sizes) or "[]"
        text = f"{self.op} {self.dtype}{shapes}"
        return f"{text} (DDP gradient bucket {self.bucket})" if self.bucket is not None else text

    def same_call(self, other: "Collective") -> bool:
        return (self.op, self.sizes, self.dtype) == (other.op, other.sizes, other.dtype)


@dataclass
class RankReport:
    """What one rank left behind when it failed (through the rendezvous store, or in a Flight Recorder dump)."""

    rank: int
    failed_at: float  # time.time() of the failure: the first cause is the earliest
    kind: str  # "timeout", "collective error", "exception", "hung" (a SIGTERM found it outside any step)
    error: str = ""  # the exception's first line: ``RuntimeError: injected failure``
    where: str = ""  # the user's line it failed or waited at
    step: Optional[int] = None
    phase: str = ""
    collectives: list[Collective] = field(default_factory=list)  # its last ones, in sequence order

    def as_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "RankReport":
        fields = {**data, "collectives": [Collective(**c) for c in data.get("collectives", [])]}
        return cls(**fields)


def _place(c: Collective) -> str:
    """``all_reduce Float[9] (DDP gradient bucket 0) at step 3, backward (logkeys.py:21 training_step: ...)``"""
    text = f"{c.call()} at step {c.step}, {c.phase}" if c.step is not None else f"{c.call()} {c.phase}".rstrip()
    return f"{text} ({c.where})" if c.where else text


def _instead(report: Optional[RankReport], last_seq: int) -> str:
    """What a rank that never reached the collective did instead."""
    if report is None:
        return "sent no report (hung outside any collective, or dead)"
    at = f" at step {report.step}, {report.phase}" if report.step is not None else ""
    where = f" ({report.where})" if report.where else ""
    if report.kind == "exception":
        return f"raised {report.error}{at}{where}"
    if report.kind == "hung":
        return f"was hung outside any collective{at}{where}"
    last = next((c for c in report.collectives if c.seq == last_seq), None)
    if last is not None and report.kind == "dump":
        return f"had called only up to #{last.seq}, {_place(last)}"
    if last is not None:
        return f"waited in its #{last.seq}, {_place(last)}"
    if report.kind == "dump":  # a dump without the entry: its recorder held none (it called none, or was off)
        return "left a Flight Recorder dump that holds no collective"
    return f"failed{at}{where}: {report.error}"


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def divergences(reports: dict[int, RankReport], world_size: int) -> list[str]:
    """One line per divergence of the ranks' records (at most one: after the first, the records mean nothing);
    none when the ranks that reported agree (``never_arrived`` names the ranks that sent none)."""
    by_rank = {r: {c.seq: c for c in rep.collectives} for r, rep in reports.items()}
    last = {r: max(seqs, default=0) for r, seqs in by_rank.items()}  # an empty record: before #1, torch's first
    silent = [r for r in range(world_size) if r not in reports]
    # The sequence numbers every reporting rank's record still holds (a ring buffer forgets the oldest).
    start = max((min(seqs, default=0) for seqs in by_rank.values()), default=0)
    for seq in range(start, max(last.values(), default=0) + 1):
        calls = {r: seqs[seq] for r, seqs in by_rank.items() if seq in seqs}
        if not calls:
            continue
        groups: list[list[int]] = []
        for r, c in calls.items():
            group = next((g for g in groups if calls[g[0]].same_call(c)), None)
            group.append(r) if group is not None else groups.append([r])
        # Reported, never got this far.
        behind = [r for r in by_rank if r not in calls and seq > last[r]]
        if len(groups) == 1 and not behind:
            continue
        line = f"collective #{seq} diverged: " if len(groups) > 1 else f"collective #{seq}: "
        line += "; ".join(f"{_ranks(g)} called {_place(calls[g[0]])}" for g in groups)
        # Only a silent rank lacks a last, and it has no report to read one from.
        for r in sorted(behind + silent):
            line += f"; rank {r} never arrived: it {_instead(reports.get(r), last.get(r, 0))}"
        return [line]
    return []


def ranks_named(ranks: list[int], ranks_per_node: Optional[int] = None) -> str:
    """``rank(s) [1]``, and with several nodes ``rank(s) [1] (node 1)``."""
    if not ranks_per_node:
        return f"rank(s) {ranks}"
    nodes = sorted({r // ranks_per_node for r in ranks})
    return f"rank(s) {ranks} (node{'s' if len(nodes) > 1 else ''} {', '.join(map(str, nodes))})"


def never_arrived(reports: dict[int, RankReport], world_size: int, place: str, ranks_per_node: Optional[int] = None,
                  seen: Optional[dict[int, tuple[str, str]]] = None) -> Optional[str]:  # fmt: skip
    """The ranks that sent no report, named at ``place`` (the collective the others waited in), with that
    collective from the others' records when they agree on it: late, not diverged. None when every rank sent one.
    ``seen``: what a peer on its host read of a silent rank (``lit_ddp.run.frozen``), as (doing, fix): said
    instead of "sent no report" when it covers every silent rank."""
    silent = [r for r in range(world_size) if r not in reports]
    if not silent or not reports:
        return None
    line = (f"{ranks_named(silent, ranks_per_node)} never arrived at {place}; "
            f"{ranks_named(sorted(reports), ranks_per_node)} waited there until the timeout")  # fmt: skip
    read = seen is not None and all(r in seen for r in silent)
    instead = "; ".join(f"rank {r} {seen[r][0]}" for r in silent) if read else ""
    lasts = [rep.collectives[-1] for rep in reports.values() if rep.collectives]
    if lasts and len(lasts) == len(reports) and all(c.seq == lasts[0].seq and c.same_call(lasts[0]) for c in lasts):
        instead = instead or f"{ranks_named(silent)} sent no report: late, not diverged"
        line += f" (in collective #{lasts[0].seq}, {_place(lasts[0])}; {instead})"
    elif instead:
        line += f"; {instead}"
    return line + (f" -> {seen[silent[0]][1]}" if read else "")


def first_cause(reports: dict[int, RankReport]) -> Optional[RankReport]:
    """The rank whose failure came first and was its own: a Python exception beats a peer's timeout or closed
    connection (its consequences), whichever report arrived first; among equals, the earliest."""
    own = [r for r in reports.values() if r.kind == "exception"]
    pool = own or list(reports.values())
    return min(pool, key=lambda r: r.failed_at, default=None)
