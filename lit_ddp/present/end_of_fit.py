"""What the end of training prints: the run's records analyzed once (``lit_ddp.analysis.run_analysis``), written
with the straggler the analysis found, and rendered as the phase table, the all-reduce table and where the record
went. ``lit_ddp.callbacks.end_of_fit.EndOfFit`` calls it on rank 0.

    python -m lit_ddp.fit --config configs/mini_train_profile.yaml --devices 2
"""

import os
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Optional, Union

from lit_ddp.analysis.run_analysis import analyze
from lit_ddp.formatting import CLI, Advice
from lit_ddp.present.comm import comm_table
from lit_ddp.present.phases import phase_table
from lit_ddp.records.schema import CommRecord, PhaseRecord, as_json, save


def render(
    phases: Optional[PhaseRecord],
    comm: Optional[CommRecord],
    written: Sequence[tuple[Path, Union[PhaseRecord, CommRecord]]],
    advice: Advice = CLI,
) -> list[str]:
    """Analyzes the records once, saves each of ``written`` (its path, its record; ``comm.json`` holds the
    straggler verdict) and returns the texts to print, the phase table first."""
    analysis = analyze(phases, comm)
    if comm is not None:
        comm.straggler = as_json(analysis.straggler) if analysis.straggler else None
    for path, record in written:
        save(record, path)
    texts = []
    if phases is not None:
        texts.append(phase_table(analysis))
    if comm is not None:
        texts.append(comm_table(analysis, advice))
    if written:  # where it went, and the command that reads it, ready to paste (a script prints no other path)
        run_dir = shown_path(str(written[0][0].parent))
        files = ", ".join(path.name for path, _ in written)
        command = f"python -m lit_ddp.report {shlex.quote(run_dir)}"
        texts.append(f"Record in {run_dir} ({files}); the tables again: {command}")
    return texts


def shown_path(path: str) -> str:
    """``path`` as a user would type it here: relative to the working directory when it lies inside it."""
    relative = os.path.relpath(path)
    return path if relative.startswith(os.pardir) else relative
