"""What the end of training prints and logs: the run's records analyzed once (``lit_ddp.analysis.run_analysis``),
written with the straggler the analysis found, and rendered as the phase table, the all-reduce table and where the
record went, and as the loggers' row. ``lit_ddp.callbacks.end_of_fit.EndOfFit`` calls it on rank 0.

    python -m lit_ddp.fit --config configs/mini_train_profile.yaml --devices 2
"""

import os
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple, Optional, Union

from lit_ddp.analysis.run_analysis import RunAnalysis, analyze
from lit_ddp.formatting import CLI, Advice
from lit_ddp.present.comm import comm_table
from lit_ddp.present.headline import headline
from lit_ddp.present.loggers import logger_row
from lit_ddp.present.phases import phase_table
from lit_ddp.records.schema import CommRecord, PhaseRecord, as_json, save

DETAIL_ENV = "LIT_DDP_DETAIL"  # "1": the end of fit prints every line (fit's --detail sets it for its ranks)


class Rendered(NamedTuple):
    """The end of fit's output: the texts to print, and the row for the loggers (``lit_ddp.present.loggers``)."""

    texts: list[str]
    logged: dict[str, float]


def render(
    phases: Optional[PhaseRecord],
    comm: Optional[CommRecord],
    written: Sequence[tuple[Path, Union[PhaseRecord, CommRecord]]],
    advice: Advice = CLI,
    detail: bool = False,
) -> Rendered:
    """Analyzes the records once, saves each of ``written`` (its path, its record; ``comm.json`` holds the
    straggler verdict) and renders the analysis: the texts to print (the headline first, then the tables: every
    line with ``detail``, else those that apply to the run) and the loggers' row."""
    analysis = analyze(phases, comm)
    if comm is not None:
        comm.straggler = as_json(analysis.straggler) if analysis.straggler else None
    for path, record in written:
        save(record, path)
    texts = tables(analysis, advice, detail)
    if written:  # where it went, and the command that reads it, ready to paste (a script prints no other path)
        run_dir = shown_path(str(written[0][0].parent))
        files = ", ".join(path.name for path, _ in written)
        command = f"python -m lit_ddp.report {shlex.quote(run_dir)}"
        texts.append(f"Record in {run_dir} ({files}); the tables again: {command}")
        if phases is not None:  # the timeline is drawn from phases.json's steps
            texts.append(f"timeline: {command} --timeline run.json, open in Perfetto's UI")
    return Rendered(texts, logger_row(analysis))


def tables(analysis: RunAnalysis, advice: Advice = CLI, detail: bool = False) -> list[str]:
    """The headline, the phase table and the all-reduce table, as the end of fit and ``report`` print them."""
    texts = [line for line in (headline(analysis),) if line is not None]
    if analysis.phases is not None:
        texts.append(phase_table(analysis, detail))
    if analysis.comm is not None:
        texts.append(comm_table(analysis, advice, detail))
    return texts


def detail_asked() -> bool:
    """Whether this run asked for every line: ``python -m lit_ddp.fit --detail``, or ``LIT_DDP_DETAIL=1`` in a
    script's environment."""
    return os.environ.get(DETAIL_ENV) == "1"


def shown_path(path: str) -> str:
    """``path`` as a user would type it here: relative to the working directory when it lies inside it."""
    relative = os.path.relpath(path)
    return path if relative.startswith(os.pardir) else relative
