"""What a folder holds when it holds no run record of its own: the runs under it (a logger's folder holds its
``version_N``), for the line that says so.

    python -m lit_ddp.report runs/mini_train_profile      # names the versions under it
"""

import os
from pathlib import Path
from typing import Union


def no_record(run_dir: Union[str, os.PathLike]) -> str:
    """The line for a directory with no record of its own: the runs under it that have one (a logger's folder,
    ``runs/mini_train_profile``, holds its ``version_N``), or what would have written one."""
    run_dir = Path(run_dir)
    runs = sorted({p.parent for name in ("phases.json", "comm.json") for p in run_dir.glob(f"*/{name}")},
                  key=lambda p: (len(p.name), p.name))  # fmt: skip
    if runs:
        shown = ", ".join(str(p) for p in runs[-5:])
        more = f" (the last 5 of {len(runs)})" if len(runs) > 5 else ""
        return f"{run_dir} is a folder of runs: give one of {shown}{more}"
    return (f"{run_dir} holds neither phases.json nor comm.json: was PhaseTimer or CommMonitor on? (the CLI's "
            "--config configs/mini_train_profile.yaml turns both on)")  # fmt: skip
