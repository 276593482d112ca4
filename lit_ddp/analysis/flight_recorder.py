"""torch's Flight Recorder entries as lit_ddp's collectives, and dumps that any job wrote, read back and compared.

    python -m lit_ddp.report --flight-recorder DIR     # DIR: one dump per rank, <prefix><rank> (torch's pickles)

A dump is what ``torch._C._distributed_c10d._dump_fr_trace()`` returns (NCCL writes one per rank on a timeout,
``TORCH_NCCL_DUMP_ON_TIMEOUT=1`` with ``TORCH_FR_DUMP_TEMP_FILE``): the process group's last collectives, each
with its sequence number, op, sizes, dtypes, state and the Python stack that called it. Read DDP-aware: an
all-reduce called from autograd's backward is a gradient bucket's (numbered in its backward), each backward pass
is a step (counted from the oldest entry a dump still holds; a pass ends where its first bucket's size comes round
again), and the user's line is the innermost frame outside
torch, Lightning and lit_ddp. The ranks' records are then compared as a live job's are
(``lit_ddp.analysis.divergence``). A dump is a pickle: read only dumps you trust.
"""

import importlib.util
import json
import linecache
import os
import pickle
import re
from pathlib import Path
from typing import Any, NamedTuple, Optional

from lit_ddp.analysis.divergence import Collective, RankReport, divergences, never_arrived
from lit_ddp.records import phases

# Where library frames live: the user's line is the innermost frame outside them (and Python's own).
LIT_DDP = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Found, not imported: reading a dump must not start Lightning (seconds of import).
LIBRARIES = tuple(
    os.path.dirname(os.path.abspath(p)) + os.sep
    for p in (importlib.util.find_spec("torch").origin, importlib.util.find_spec("lightning").origin, os.__file__)
)
LIBRARIES += (LIT_DDP + os.sep,)
BACKWARD = "run_backward"  # autograd's engine in a frame's name: DDP's reducer launched the all-reduce there


class Frame(NamedTuple):
    filename: str
    lineno: int
    name: str
    line: str = ""


def user_frame(frames: list[Frame]) -> str:
    """``logkeys.py:21 training_step: self.log('rare_metric', ...)``: the innermost frame outside the libraries
    (``frames`` from the outermost in, as ``traceback.extract_tb`` gives them), or ``""``."""
    for frame in reversed(frames):
        path = os.path.abspath(frame.filename)
        if path.startswith(LIBRARIES) or "site-packages" in path or not path.endswith(".py"):
            continue
        line = (frame.line or linecache.getline(path, frame.lineno)).split("  #")[0].strip()
        return f"{os.path.basename(path)}:{frame.lineno} {frame.name}: {line}"
    return ""


def _frames(entry: dict[str, Any]) -> list[Frame]:
    """An entry's Python stack, outermost first (Flight Recorder lists it innermost first)."""
    return [Frame(f.get("filename", ""), int(f.get("line", 0)), f.get("name", "")) for f in entry.get("frames") or []][
        ::-1
    ]


def in_backward(entry: dict[str, Any]) -> bool:
    # A frame without a name or a file is in no backward.
    return any(BACKWARD in f.get("name", "") or BACKWARD in f.get("filename", "") for f in entry.get("frames") or [])


def collective_of(entry: dict[str, Any], step: Optional[int] = None, phase: str = "",
                  bucket: Optional[int] = None) -> Collective:  # fmt: skip
    """One Flight Recorder entry as a collective."""
    op = str(entry.get("profiling_name", "")).rpartition(":")[2]
    dtypes = entry.get("input_dtypes") or [""]
    sizes = [list(s) for s in entry.get("input_sizes") or []]
    where = "" if bucket is not None else user_frame(_frames(entry))  # a bucket's line is autograd's
    return Collective(int(entry["collective_seq_id"]), op, sizes, dtypes[0], step, phase, bucket, where)


def default_group(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The default process group's collectives (group 0; point-to-point sends are numbered apart)."""
    return [e for e in entries if str(e.get("pg_id", 0)) == "0" and not e.get("is_p2p")]


def dump_report(rank: int, dump: dict[str, Any]) -> RankReport:
    """A rank's dump as its report: buckets named, steps counted by backward passes."""
    collectives: list[Collective] = []
    # bucket < 0: no pass under way.
    step, bucket, first_sizes, framed = -1, -1, None, has_frames(dump)
    for entry in default_group(dump.get("entries", [])):
        # An entry without a name is no all-reduce.
        backward = in_backward(entry) and "all_reduce" in str(entry.get("profiling_name", ""))
        sizes = entry.get("input_sizes")
        # A new backward pass: after other collectives, or where the pass's first bucket comes round again (DDP
        # all-reduces its buckets in one order each step; two buckets of one size would split a step in two).
        if backward and (bucket < 0 or sizes == first_sizes):
            step, bucket, first_sizes = step + 1, -1, sizes
        bucket = bucket + 1 if backward else -1
        outside = "after the backward" if step >= 0 else "before the first backward"
        phase = phases.ALL_REDUCING if backward else outside
        phase = phase if framed else ""  # no stacks (a JSON dump): no backward to tell the phase by
        collectives.append(collective_of(entry, step if step >= 0 else None, phase, bucket if backward else None))
    last = collectives[-1] if collectives else None
    return RankReport(rank, 0.0, "dump", "", last.where if last else "", last.step if last else None,
                      last.phase if last else "", collectives)  # fmt: skip


def read_dump(path: Path) -> dict[str, Any]:
    """torch's pickle, or the JSON of ``_dump_fr_trace_json``."""
    data = path.read_bytes()
    try:
        return json.loads(data)
    except (UnicodeDecodeError, ValueError):
        return pickle.loads(data)


def read_dumps(directory: Path, since: float = 0.0) -> dict[int, dict[str, Any]]:
    """Every rank's dump in ``directory``: files whose names end in the rank (``<prefix><rank>``, an extension
    allowed), written at ``since`` (``time.time()``) or later."""
    dumps = {}
    for path in sorted(directory.iterdir()):
        match = re.search(r"(\d+)(\.\w+)?$", path.name)
        if path.is_file() and match and path.stat().st_mtime >= since:
            dumps[int(match.group(1))] = read_dump(path)
    return dumps


def has_frames(dump: dict[str, Any]) -> bool:
    """Whether the dump holds the Python stacks (torch's pickles do; its JSON, ``_dump_fr_trace_json`` and
    NCCL's ``dump_nccl_trace_json``, holds none: no bucket, step or user's line can be named from it)."""
    return any(entry.get("frames") for entry in dump.get("entries", []))


def dumps_divergence(directory: Path, since: float = 0.0) -> Optional[str]:
    """The first divergence of the dumps in ``directory`` written since ``since``, or the ranks that left no dump;
    None without dumps, or when they agree and every rank left one."""
    dumps = read_dumps(directory, since)
    if not dumps:
        return None
    # The dict's keys name the ranks: a report's own rank is read by neither comparison.
    reports = {rank: dump_report(rank, dump) for rank, dump in dumps.items()}
    world_size = max(_world_size(dumps), max(reports) + 1)
    found = divergences(reports, world_size)
    return found[0] if found else never_arrived(reports, world_size, "the last collective")


def _world_size(dumps: dict[int, dict[str, Any]]) -> int:
    """The default group's size as a dump's ``pg_config`` gives it (its ranks), 0 where it does not."""
    for dump in dumps.values():
        for name, group in (dump.get("pg_config") or {}).items():  # keyed "0" under NCCL, "" under gloo
            if isinstance(group, dict) and (str(name) in ("0", "") or group.get("desc") == "default_pg"):
                try:
                    return len(json.loads(group["ranks"]) if isinstance(group["ranks"], str) else group["ranks"])
                except (KeyError, TypeError, ValueError):
                    return 0
    return 0


def flight_recorder_text(directory: Path) -> str:
    """What ``python -m lit_ddp.report --flight-recorder DIR`` prints."""
    dumps = read_dumps(directory)
    if not dumps:
        raise ValueError(f"{directory}: no Flight Recorder dump (files named <prefix><rank>)")
    reports = {rank: dump_report(rank, dump) for rank, dump in dumps.items()}  # a report's rank unread, as above
    world_size = max(_world_size(dumps), max(reports) + 1)
    lines = [f"Flight Recorder dumps of {len(reports)} rank(s) in {directory}:"]
    if not all(has_frames(d) for d in dumps.values() if d.get("entries")):  # an empty dump tells no format
        lines.append("(JSON dumps hold no Python stacks: DDP's buckets, the steps and the user's lines are not named)")
    for rank, report in sorted(reports.items()):
        buckets = sum(c.bucket is not None for c in report.collectives)
        steps = len({c.step for c in report.collectives if c.bucket is not None})
        last = report.collectives[-1] if report.collectives else None
        state = next((e.get("state") for e in reversed(default_group(dumps[rank].get("entries", [])))), "")
        lines.append(f"rank {rank}: {len(report.collectives)} collectives ({buckets} DDP gradient bucket all-reduces "
                     f"in {steps} backward pass(es)); the last, #{last.seq if last else '-'}: "
                     f"{last.call() if last else '-'} ({state})")  # fmt: skip
    found = divergences(reports, world_size) or [
        never_arrived(reports, world_size, "the last collective") or "every rank's record agrees"
    ]
    return "\n".join([*lines, *found])
