"""What a zoo case must be named by, and the check of a job's output against it.

A hang is named when one line of the job's output holds all three: the rank (``rank 1``, ``rank(s) [1]``, ``rank 1
(node 1)``), the user's line as ``file.py:N`` (the case's file and the line that holds ``Hang.line``), and words of
its cause (``CAUSES``: the words a diagnosis of that cause says, its fix's words included, not one phrasing; not
found in the case's file name or the quoted code). A
healthy case must end 0 with no line that says the job hung (``HANG_WORDS``); a "waiting" line is allowed.
"""

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

CAUSES = {
    "collective on some ranks": r"diverged|rank_zero_only|called by some ranks|only on rank|never call",
    "sync_dist keys": r"diverged|sync_dist",
    "different shapes": r"\bshapes?\b|all_gather_object",
    "unused parameters": r"find_unused_parameters|unused|not used",
    "uneven data": r"uneven|runs? out of (data|batches)|ran out of|fewer batches|more batches|its data ended",
    "stuck data worker": r"data ?loader worker|\bworker\b",
    "dead rank": r"\bdied\b|\bdead\b|exited|terminated|killed|signal|\bgone\b|\bleft\b",
    "outside any collective": r"outside any collective|hung at|has been at",
    "left training early": r"\bleft\b|stopped|ended training|should_stop|exited",
    "never joined": r"never joined|not joined|did not join|never started|joined",
}
# Words that say the job hung. Not "hang" alone: a line may say what a hang would do without saying this job hung.
HANG_WORDS = re.compile(r"\bhung\b|\bhangs\b|\bhanging\b|diverged|never arrived|never joined|timed out", re.I)


@dataclass(frozen=True)
class Hang:
    """``rank`` (None: any), the user's ``line`` (a piece of the hanging line's code in the case's file; None: no
    line can be known, a dead process's), the ``cause`` (a key of CAUSES), and ``also``: words the line must hold
    too (the unused parameters' names)."""

    rank: Optional[int]
    line: Optional[str]
    cause: str
    also: tuple[str, ...] = ()
    certain: bool = False  # a divergence that can end the job at once (#48 item 2: within 20 s)
    avoidable: bool = False  # the tool may avoid the hang itself (StepSync evens uneven epochs): exit 0 allowed

    def __post_init__(self) -> None:
        if self.cause not in CAUSES:
            raise ValueError(f"Hang(cause={self.cause!r}): not one of {list(CAUSES)}")


@dataclass(frozen=True)
class Healthy:
    """Ends 0, and no line says it hung."""

    note: str = ""


@dataclass
class Verdict:
    rank: Optional[bool] = None  # None: not asked (a healthy case)
    line: Optional[bool] = None
    cause: Optional[bool] = None
    named_at: Optional[float] = None  # the clock time of the first line that named all three
    text: str = ""  # that line
    problems: list[str] = field(default_factory=list)


def source_line(script: Path, piece: str) -> int:
    """The number of the one line of ``script`` that holds ``piece`` (its ``EXPECT``'s ``line=`` left out)."""
    found = [n for n, text in enumerate(script.read_text().splitlines(), 1) if piece in text and "line=" not in text]
    if len(found) != 1:
        raise ValueError(f"{script.name}: {piece!r} is on lines {found}, not on one")
    return found[0]


def names_rank(text: str, rank: int) -> bool:
    """``rank 1``, ``rank(s) [0, 1]``, or Lightning's ``[rank: 1]`` (its launcher names a dead child so)."""
    return re.search(rf"\brank(?:\(s\))?:? \[?(?:\d+, )*{rank}\b", text) is not None


def judge(expect: Union[Hang, Healthy], script: Path, lines: list[tuple[float, str]], code: Optional[int]) -> Verdict:
    """``lines``: the job's output, each with the clock time it came at; ``code``: its exit code (None: killed at
    the runner's deadline)."""
    verdict = Verdict()
    if isinstance(expect, Healthy):
        hung = [text for _, text in lines if HANG_WORDS.search(text)]
        if code != 0:
            verdict.problems.append(f"exit {code}")
        if hung:
            verdict.problems.append(f"says it hung: {hung[0][:200]}")
        return verdict
    where = f"{script.name}:{source_line(script, expect.line)}" if expect.line else None
    cause = re.compile(CAUSES[expect.cause], re.I)
    verdict.rank = verdict.line = verdict.cause = False
    for at, text in lines:
        rank = expect.rank is None or names_rank(text, expect.rank)
        line = where is None or where in text
        # The cause in the diagnosis's own words: not in the case's file name nor the user's code it quotes.
        words = text.replace(script.name, "").replace(expect.line or script.name, "")
        said = cause.search(words) is not None and all(word in words for word in expect.also)
        verdict.rank |= rank
        verdict.line |= line
        verdict.cause |= said
        if rank and line and said:
            verdict.rank = verdict.line = verdict.cause = True
            verdict.named_at, verdict.text = at, text
            break
    if code == 0 and not expect.avoidable:
        verdict.problems.append("exit 0")
    return verdict
