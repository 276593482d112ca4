"""Which rank runs on which device, and the notes' device-indexing pitfalls, checked on hand-made maps too.

    python -m lit_ddp.fit --devices 2      # the DeviceMap callback prints the map once, at fit start

The notes: under Slurm, either ``CUDA_VISIBLE_DEVICES=$SLURM_LOCALID`` and ``set_device(0)``, or all devices
visible and ``device_ids=[local_rank]``; "never mix the two, or device indexing skews". The rules below flag
two ranks on one physical device, and a device index that is not the local rank while several devices are
visible, and a Slurm local id that disagrees with LOCAL_RANK.
"""

import os
import socket
from typing import Optional, TypedDict

import torch

from lit_ddp.formatting import table


class RankPlacement(TypedDict):
    rank: int
    local_rank: int
    node_rank: int
    host: str
    device: str  # "cpu" or "cuda:<index as seen by the process>"
    cuda_visible_devices: Optional[str]
    env_local_rank: Optional[str]
    slurm_localid: Optional[str]


def this_rank(rank: int, local_rank: int, node_rank: int, device: torch.device) -> RankPlacement:
    """This process's row of the map."""
    return RankPlacement(
        rank=rank,
        local_rank=local_rank,
        node_rank=node_rank,
        host=socket.gethostname(),
        device=str(device),
        cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
        env_local_rank=os.environ.get("LOCAL_RANK"),
        slurm_localid=os.environ.get("SLURM_LOCALID"),
    )


def _physical_gpu(row: RankPlacement) -> Optional[str]:
    """The GPU behind ``cuda:i``: the i-th entry of CUDA_VISIBLE_DEVICES, or i when it is unset."""
    if not row["device"].startswith("cuda"):
        return None
    index = int(row["device"].partition(":")[2] or 0)
    visible = row["cuda_visible_devices"]
    if visible is None:
        return str(index)
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    return entries[index] if index < len(entries) else f"?{index}"


def problems(rows: list[RankPlacement]) -> list[str]:
    """Human-readable findings; empty when the placement is consistent."""
    found = []
    by_gpu: dict[tuple[str, str], list[int]] = {}
    for row in rows:
        gpu = _physical_gpu(row)
        if gpu is not None:
            by_gpu.setdefault((row["host"], gpu), []).append(row["rank"])
    for (host, gpu), ranks in sorted(by_gpu.items()):
        if len(ranks) > 1:
            found.append(f"ranks {ranks} share GPU {gpu} on {host}: each rank needs its own device")
    for row in rows:
        r = row["rank"]
        if row["device"].startswith("cuda"):
            index = int(row["device"].partition(":")[2] or 0)
            visible = row["cuda_visible_devices"]
            n_visible = len([e for e in visible.split(",") if e.strip()]) if visible is not None else None
            if index != row["local_rank"] and (n_visible is None or n_visible > 1):
                found.append(
                    f"rank {r} uses cuda:{index} but its local rank is {row['local_rank']} while "
                    f"CUDA_VISIBLE_DEVICES={visible} leaves several GPUs visible: are CUDA_VISIBLE_DEVICES "
                    f"and device_ids mixed?"
                )
        if row["slurm_localid"] is not None and row["slurm_localid"] != str(row["local_rank"]):
            found.append(
                f"rank {r}: SLURM_LOCALID={row['slurm_localid']} but local rank {row['local_rank']}"
                f" (LOCAL_RANK={row['env_local_rank']})"
            )
    return found


PER_RANK_UP_TO = 8  # more ranks than this: one line per run of alike ranks, a line of its own for one that differs


def format_table(rows: list[RankPlacement]) -> str:
    """One line per rank, or past ``PER_RANK_UP_TO`` ranks one per run of consecutive ranks of one node whose
    rows differ only by their local rank (``rank 0-15 ... cuda:0-15``): 32 ranks alike are a few lines, and a rank
    that differs keeps its own."""
    header = ("rank", "local", "node", "host", "device", "CUDA_VISIBLE_DEVICES", "LOCAL_RANK", "SLURM_LOCALID")
    groups: list[list[RankPlacement]] = []
    for r in rows:
        alike = len(rows) > PER_RANK_UP_TO and groups and _pattern(groups[-1][-1]) == _pattern(r)
        if alike and groups[-1][-1]["rank"] + 1 == r["rank"] and groups[-1][-1]["local_rank"] + 1 == r["local_rank"]:
            groups[-1].append(r)
        else:
            groups.append([r])
    body = [_line(group) for group in groups]
    return table(header, body, left=len(header))  # names and labels, no figures: every column left-aligned


def _pattern(r: RankPlacement) -> tuple:
    """A row with its local rank taken out where it follows it (``cuda:<local>``, ``LOCAL_RANK=<local>``)."""
    local = str(r["local_rank"])

    def follows(value: Optional[str], prefix: str = "") -> Optional[str]:
        return "<local>" if value == f"{prefix}{local}" else value

    return (r["node_rank"], r["host"], follows(r["device"], "cuda:"), r["cuda_visible_devices"],
            follows(r["env_local_rank"]), follows(r["slurm_localid"]))  # fmt: skip


def _line(group: list[RankPlacement]) -> tuple[str, ...]:
    first, last = group[0], group[-1]

    def span(key: str, prefix: str = "") -> str:
        a, b = ("-" if r[key] is None else str(r[key]) for r in (first, last))
        return a if a == b else f"{a}-{b.removeprefix(prefix)}"

    return (span("rank"), span("local_rank"), str(first["node_rank"]), first["host"], span("device", "cuda:"),
            first["cuda_visible_devices"] or "-", span("env_local_rank"), span("slurm_localid"))  # fmt: skip
