"""The all-reduce probe's measuring: a sweep of buffer sizes on local ranks, or across the nodes of a torchrun
job (within each node, between them, and each pair point to point); the command is ``lit_ddp.allreduce_probe``.

    python -m lit_ddp.allreduce_probe --nproc 2 --out probe.json

What it measures and how: docs/forecast.md.
"""

import json
import math
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lit_ddp.maths.bus_factors import allreduce_bus_factor
from lit_ddp.records.probe import ProbePoint

KIB = 1024
# (backend, rank, world_size, port, timeout, device) -> None: makes a local rank's process group.
InitGroup = Callable[[str, int, int, int, timedelta, torch.device], None]
# Fits a link to a probe's rows (``lit_ddp.scaling.links.fit_probe``: the command wires it in, as the forecast's
# floor is no business of measurement's); what comes back has ``hop_latency_us`` and ``busbw_gbps``.
FitLink = Callable[[list[ProbePoint], int], Any]


@dataclass(frozen=True)
class ProbeConfig:
    """What each rank runs; pickled to the spawned ranks."""

    world_size: int
    backend: str
    sizes: tuple[int, ...]
    warmup: int
    iters: int
    port: int
    result_path: str


def sizes_between(min_bytes: int, max_bytes: int) -> list[int]:
    """Doubling sizes from ``min_bytes`` up to ``max_bytes``, which is always the last one (the largest bucket
    need not be a power of two), all rounded down to whole fp32 elements."""
    sizes, size = [], min_bytes
    while size < max_bytes:
        sizes.append(size // 4 * 4)
        size *= 2
    sizes.append(max_bytes // 4 * 4)
    return sizes


def probe_points(sizes: list[int], times_ms: list[list[float]], world_size: int) -> list[ProbePoint]:
    """Per size, the median time over iterations, algbw = S / t and busbw = algbw x 2(n-1)/n (nccl-tests)."""
    ring = allreduce_bus_factor(world_size)
    points = []
    for nbytes, per_iter in zip(sizes, times_ms, strict=True):
        ms = statistics.median(per_iter)
        algbw = nbytes / ms / 1e6  # bytes per ms -> GB/s
        points.append(ProbePoint(nbytes=nbytes, ms=ms, algbw_gbps=algbw, busbw_gbps=algbw * ring))
    return points


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sweep(config: ProbeConfig, device: torch.device, group=None) -> list[list[float]]:
    """Times (ms) of the all-reduce of every size and iteration over ``group``, each the slowest rank's."""
    cuda = device.type == "cuda"
    times = torch.zeros(len(config.sizes), config.iters, dtype=torch.float64)
    for i, nbytes in enumerate(config.sizes):
        # Zeros: the sums stay finite however many iterations run.
        buffer = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
        for _ in range(config.warmup):
            dist.all_reduce(buffer, group=group)
        for j in range(config.iters):
            dist.barrier(group=group)
            if cuda:
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            dist.all_reduce(buffer, group=group)
            if cuda:
                torch.cuda.synchronize(device)
            times[i, j] = (time.perf_counter() - start) * 1e3
    # An iteration is over when its slowest rank is done.
    slowest = times.to(device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return slowest.cpu().tolist()


def _worker(rank: int, config: ProbeConfig, init_group: InitGroup) -> None:
    torch.set_num_threads(1)  # the ranks share this machine's cores; gloo's reduction runs on its own threads
    cuda = config.backend == "nccl"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    init_group(config.backend, rank, config.world_size, config.port, timedelta(seconds=60), device)
    try:
        times = _sweep(config, device)
        if rank == 0:
            Path(config.result_path).write_text(json.dumps(times))
    finally:
        dist.destroy_process_group()


def probe(init_group: InitGroup, fit_link: FitLink, nproc: int, max_bytes: int, min_bytes: int = KIB, warmup: int = 3,
          iters: int = 10, backend: str | None = None) -> dict:  # fmt: skip
    """Runs the probe on ``nproc`` local ranks and returns the JSON record (``rows`` and ``fit``).

    Args:
        init_group: Makes each rank's process group (``lit_ddp.run.rendezvous.init_loopback_process_group``:
            the command wires it in, as the run's floor is above this one).
        fit_link: Fits the link to the rows (``lit_ddp.scaling.links.fit_probe``, wired in by the command).
        nproc: Ranks to start (at least 2: one rank has nothing to reduce).
        max_bytes: The largest buffer, e.g. the largest gradient bucket of a run.
        min_bytes: The smallest buffer.
        warmup: Untimed all-reduces per size.
        iters: Timed all-reduces per size; the median is reported.
        backend: ``gloo`` or ``nccl``; ``None`` picks nccl when there are ``nproc`` GPUs, gloo otherwise.
    """
    if nproc < 2:
        raise ValueError(f"`probe(nproc={nproc!r})` must be >= 2: one rank has nothing to all-reduce")
    if not 4 <= min_bytes <= max_bytes:
        raise ValueError(f"`probe(min_bytes={min_bytes!r}, max_bytes={max_bytes!r})` needs 4 <= min <= max")
    if warmup < 0 or iters < 1:
        raise ValueError(f"`probe(warmup={warmup!r}, iters={iters!r})` needs warmup >= 0 and iters >= 1")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= nproc else "gloo"
    sizes = sizes_between(min_bytes, max_bytes)
    with tempfile.TemporaryDirectory() as tmp:
        config = ProbeConfig(nproc, backend, tuple(sizes), warmup, iters, _free_port(), os.path.join(tmp, "t.json"))
        mp.start_processes(_worker, args=(config, init_group), nprocs=nproc, join=True, start_method="spawn")
        times = json.loads(Path(config.result_path).read_text())
    rows = probe_points(sizes, times, nproc)
    fit = fit_link(rows, nproc)
    return {
        "backend": backend,
        "world_size": nproc,
        "dtype": "float32",
        "warmup": warmup,
        "iters": iters,
        "rows": [asdict(r) for r in rows],
        "fit": {"hop_latency_us": fit.hop_latency_us, "busbw_gbps": fit.busbw_gbps},
    }


SLOW_LINK_SHARE = 0.75  # a node's link below this share of the other nodes' median is named


def node_links(pairs: dict[tuple[int, int], float], nodes: int) -> list[float]:
    """Each node's link rate from the point-to-point rates of the pairs of nodes, every node's link joining one
    switch: a pair runs at the slower of its two links, so a node's link is (at least) its fastest pair's rate."""
    return [max(rate for pair, rate in pairs.items() if k in pair) for k in range(nodes)]


def slow_nodes(links: list[float]) -> list[int]:
    """The nodes whose link is below ``SLOW_LINK_SHARE`` of the other nodes' median. Only with three nodes or
    more: with two, each byte crosses both links, and the pair's rate is all a measurement can show."""
    if len(links) < 3:
        return []
    return [k for k, rate in enumerate(links)
            if rate < SLOW_LINK_SHARE * statistics.median(r for j, r in enumerate(links) if j != k)]  # fmt: skip


def _pair_rates(nbytes: int, iters: int, leaders: list[int], rank: int) -> dict[tuple[int, int], float]:
    """Bytes per second between each pair of nodes: their first ranks send ``nbytes`` one way, then the other,
    timed by the receiver from a barrier of all ranks to the last byte; per direction the best of ``iters``
    after one warm-up, and the pair's rate is its slower direction's. (Both ways at once, the acknowledgements of
    one direction queue behind the other's data at a slow link, and a 2 MB exchange ran at 60-75% of the rate.)"""
    n = len(leaders)
    buffer = torch.zeros(nbytes // 4, dtype=torch.float32)
    seen = torch.full((n, n), math.inf, dtype=torch.float64)
    for i in range(n):
        for j in range(n):
            if i == j:
                continue
            best = 0.0
            for it in range(iters + 1):
                dist.barrier()
                if rank == leaders[i]:
                    dist.send(buffer, leaders[j])
                elif rank == leaders[j]:
                    start = time.perf_counter()
                    dist.recv(buffer, leaders[i])
                    if it:
                        best = max(best, buffer.numel() * 4 / (time.perf_counter() - start))
            if rank == leaders[j]:
                seen[min(i, j), max(i, j)] = min(seen[min(i, j), max(i, j)].item(), best)
    dist.all_reduce(seen, op=dist.ReduceOp.MIN)
    return {(i, j): seen[i, j].item() for i in range(n) for j in range(i + 1, n)}


def _rows_and_fit(sizes: list[int], times: list[list[float]], world_size: int, fit_link: FitLink) -> dict:
    rows = probe_points(sizes, times, world_size)
    fit = fit_link(rows, world_size)
    return {"world_size": world_size, "rows": [asdict(r) for r in rows],
            "fit": {"hop_latency_us": fit.hop_latency_us, "busbw_gbps": fit.busbw_gbps}}  # fmt: skip


def probe_nodes(
    fit_link: FitLink, max_bytes: int, min_bytes: int = KIB, warmup: int = 3, iters: int = 10
) -> dict | None:
    """This rank's part of the probe under torchrun (gloo): all ranks, within each node (several ranks per node),
    between the nodes (one rank each) and each pair of nodes; rank 0 returns the record, the others None."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    nodes, node = world_size // per_node, rank // per_node  # torchrun numbers a node's ranks together
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    cpu = torch.device("cpu")
    try:
        sizes = sizes_between(min_bytes, max_bytes)
        config = ProbeConfig(world_size, "gloo", tuple(sizes), warmup, iters, 0, "")
        # Every collective first, the fits after, on rank 0 alone: a fit that fails (ForecastError) must not leave
        # other ranks waiting in a collective that rank never joins.
        everyone = _sweep(config, cpu)
        leaders = [k * per_node for k in range(nodes)]
        within = between = None
        if per_node > 1:
            # Every rank creates every group, in the same order (torch.distributed.new_group).
            node_groups = [dist.new_group(list(range(k * per_node, (k + 1) * per_node))) for k in range(nodes)]
            leader_group = dist.new_group(leaders)
            within = _sweep(config, cpu, node_groups[node])  # rank 0's: node 0's
            if nodes > 1 and rank in leaders:
                between = _sweep(config, cpu, leader_group)
        pairs = _pair_rates(max_bytes, iters, leaders, rank) if nodes > 1 else {}
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return None
    record = {"backend": "gloo", "nodes": nodes, "ranks_per_node": per_node, "dtype": "float32", "warmup": warmup,
              "iters": iters, **_rows_and_fit(sizes, everyone, world_size, fit_link)}  # fmt: skip
    if within is not None:
        record["intra_node"] = _rows_and_fit(sizes, within, per_node, fit_link)
    if between is not None:
        record["inter_node"] = _rows_and_fit(sizes, between, nodes, fit_link)
    elif nodes > 1 and per_node == 1:
        record["inter_node"] = {key: record[key] for key in ("world_size", "rows", "fit")}
    if nodes > 1:
        links = node_links(pairs, nodes)
        record["pairs"] = [{"nodes": list(pair), "bytes_per_s": rate} for pair, rate in pairs.items()]
        record["pair_bytes"] = max_bytes // 4 * 4
        record["node_links_bytes_per_s"] = links
        record["slow_nodes"] = slow_nodes(links)
    return record
