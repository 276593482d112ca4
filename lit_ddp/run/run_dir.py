"""The run's own log folder, ``<save_dir>/<name>/version_N``: claimed before any rank starts, by creating it.

    python -m lit_ddp.fit --devices 2 & python -m lit_ddp.fit --devices 2    # version_0 and version_1

A logger left to find its version (``version: null``, Lightning's default) picks one more than the highest
folder it sees when it first looks, so two runs started together in one place both took ``version_0`` and
wrote into each other's ``metrics.csv`` and records. Here the launching process (global rank 0) claims the next
free number by creating the folder (``mkdir`` fails for all but one claimant of a name) and writes it into the
config of every logger of the run; the ranks that Lightning's ``ddp`` launcher starts, which parse the same
command again, read the number it claimed from their environment instead of claiming one of their own.
"""

import os
import re
from pathlib import Path
from typing import Any, Optional

# "<launcher pid>:<version>", written by the launcher for the ranks it starts (see claim_version).
VERSION_ENV = "LIT_DDP_LOG_VERSION"


def _loggers(trainer_config: Any) -> list[Any]:
    """The logger configs that leave their version to Lightning and say where they write."""
    logger = trainer_config.get("logger") if hasattr(trainer_config, "get") else None
    configs = logger if isinstance(logger, list) else [logger]
    found = []
    for config in configs:
        init_args = config.get("init_args") if hasattr(config, "get") else None
        if init_args is not None and init_args.get("version") is None and init_args.get("save_dir") is not None:
            found.append(init_args)
    return found


def _launched_version() -> Optional[int]:
    """The version this process's launcher claimed, if Lightning's launcher started this process."""
    value = os.environ.get(VERSION_ENV, "")
    pid, _, version = value.partition(":")
    return int(version) if pid == str(os.getppid()) and version.isdigit() else None


def _is_global_rank_zero() -> bool:
    """From the environment alone (before any process group): torchrun's RANK, Slurm's SLURM_PROCID."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))) == 0


def claim_version(trainer_config: Any) -> Optional[int]:
    """Claims ``version_N`` for every logger of ``trainer_config`` that leaves its version open, and sets it in
    their ``init_args``; returns N, or None when there is nothing to claim (no such logger) or this process is
    not the one that claims (a rank other than 0 under torchrun or Slurm, whose logger writes nothing)."""
    loggers = _loggers(trainer_config)
    if not loggers:
        return None
    version = _launched_version()
    if version is None:
        if not _is_global_rank_zero():
            return None
        roots = {Path(args["save_dir"]) / (args.get("name") or "") for args in loggers}
        version = _claim(sorted(roots))
        os.environ[VERSION_ENV] = f"{os.getpid()}:{version}"  # for the ranks this process will launch
    for args in loggers:
        args["version"] = version
    return version


def _claim(roots: list[Path]) -> int:
    """The lowest N above every existing ``version_*`` under ``roots`` whose folders this process created."""
    pattern = re.compile(r"^version_(\d+)$")
    taken = [int(m.group(1)) for root in roots if root.is_dir() for p in root.iterdir() if (m := pattern.match(p.name))]
    version = max(taken, default=-1) + 1
    while True:
        try:
            roots[0].mkdir(parents=True, exist_ok=True)
            (roots[0] / f"version_{version}").mkdir()  # atomic: exactly one claimant succeeds
        except FileExistsError:
            version += 1
            continue
        for root in roots[1:]:
            (root / f"version_{version}").mkdir(parents=True, exist_ok=True)
        return version
