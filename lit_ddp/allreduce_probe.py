"""All-reduce latency and bandwidth of this machine, like nccl-tests' ``all_reduce_perf``.

    python -m lit_ddp.allreduce_probe --nproc 2 --out probe.json

Starts ``--nproc`` ranks with ``torch.multiprocessing`` on loopback (a free port, the store bound to
127.0.0.1 as in ``lit_ddp.run.rendezvous``), gloo on CPU and NCCL on GPUs (one GPU per rank), and all-reduces fp32
buffers of 1 KiB, 2 KiB, ... up to ``--max-bytes``. Each size gets a few warm-up iterations, then timed
ones: a barrier first so the ranks start together, then one all-reduce (on GPUs followed by a
``synchronize``, which a probe may add). An iteration takes as long as its slowest rank; the size's time is
the median over iterations. ``algbw = S / t`` and ``busbw = algbw * 2(n-1)/n`` as in nccl-tests
(``doc/PERFORMANCE.md``). Rank 0 prints the table, the latency-bandwidth fit that ``lit_ddp.forecast``
uses for ``--link measured``, and writes the JSON. Under torchrun (``torchrun --nnodes N ... -m
lit_ddp.allreduce_probe``, or ``srun``, as nccl-tests under mpirun) it also measures within each node, between
the nodes, and each pair of nodes point to point, which names a node whose link is slower than the others'.
"""

import argparse
import json
import math
import os
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lit_ddp.analysis.tables import fmt_bandwidth, table
from lit_ddp.errors import ForecastError
from lit_ddp.maths.bus_factors import allreduce_bus_factor
from lit_ddp.run.rendezvous import init_loopback_process_group
from lit_ddp.scaling.links import ProbePoint, fit_probe

KIB = 1024


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


def parse_bytes(text: str) -> int:
    """``4096``, ``64K``, ``4M``, ``1G`` (binary units, as nccl-tests' ``-e``) -> bytes."""
    units = {"K": KIB, "M": KIB**2, "G": KIB**3}
    scale = units.get(text[-1:].upper(), 1)
    number = text[:-1] if scale != 1 else text
    try:
        value = int(float(number) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size like 4096, 64K or 4M, got {text!r}") from None
    if value < 4:
        raise argparse.ArgumentTypeError(f"a size must be at least one fp32 element (4 bytes), got {text!r}")
    return value


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


def _worker(rank: int, config: ProbeConfig) -> None:
    torch.set_num_threads(1)  # the ranks share this machine's cores; gloo's reduction runs on its own threads
    cuda = config.backend == "nccl"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    init_loopback_process_group(config.backend, rank, config.world_size, config.port, timedelta(seconds=60), device)
    try:
        times = _sweep(config, device)
        if rank == 0:
            Path(config.result_path).write_text(json.dumps(times))
    finally:
        dist.destroy_process_group()


def probe(nproc: int, max_bytes: int, min_bytes: int = KIB, warmup: int = 3, iters: int = 10,
          backend: str | None = None) -> dict:  # fmt: skip
    """Runs the probe on ``nproc`` local ranks and returns the JSON record (``rows`` and ``fit``).

    Args:
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
        mp.start_processes(_worker, args=(config,), nprocs=nproc, join=True, start_method="spawn")
        times = json.loads(Path(config.result_path).read_text())
    rows = probe_points(sizes, times, nproc)
    fit = fit_probe(rows, nproc)
    return {
        "backend": backend,
        "world_size": nproc,
        "dtype": "float32",
        "warmup": warmup,
        "iters": iters,
        "rows": [asdict(r) for r in rows],
        "fit": {"hop_latency_us": fit.hop_latency_us, "busbw_gbps": fit.busbw_gbps},
    }


def format_probe(record: dict) -> str:
    """The nccl-tests-style table and the fitted link."""
    lines = [f"all-reduce, {record['backend']}, {record['world_size']} ranks, {record['dtype']}, "
             f"median of {record['iters']} after {record['warmup']} warm-up:"]  # fmt: skip
    rows = [(f"{r['nbytes']:,}", f"{r['ms']:.3f}", fmt_bandwidth(r["algbw_gbps"]), fmt_bandwidth(r["busbw_gbps"]))
            for r in record["rows"]]  # fmt: skip
    lines.append(table(("size (B)", "time (ms)", "algbw", "busbw"), rows))
    n, fit = record["world_size"], record["fit"]
    lines.append(f"fit: t = 2(n-1) x {fit['hop_latency_us']:.1f} us + 2(n-1)/n x S / "
                 f"{fmt_bandwidth(fit['busbw_gbps'])} (n = {n})")  # fmt: skip
    return "\n".join(lines)


SLOW_LINK_SHARE = 0.75  # a node's link below this share of the other nodes' median is named


def under_torchrun() -> bool:
    """Started by torchrun (or a launcher that sets the same env:// variables and LOCAL_WORLD_SIZE)."""
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR"))


def srun_env() -> dict[str, str] | None:
    """Under srun (a task of a job step of two tasks or more), torchrun's env:// variables from Slurm's, as
    Lightning's ``SLURMEnvironment`` derives them (the first node of the step's list, a port from the job id);
    None elsewhere: a batch script outside srun, an interactive shell's step. The probe groups a node's ranks as
    torchrun numbers them, so the step must hold as many tasks on every node, numbered node by node (Slurm's
    default block distribution); raises ``RuntimeError`` with one line otherwise."""
    if "SLURM_STEP_ID" not in os.environ or int(os.environ.get("SLURM_NTASKS", "1")) < 2:
        return None
    from lightning.fabric.plugins.environments import SLURMEnvironment

    if not SLURMEnvironment.detect():  # Lightning's rule: `srun --pty bash` and the like launch nothing
        return None
    slurm = SLURMEnvironment()
    rank, world = slurm.global_rank(), slurm.world_size()
    per_node = world // int(os.environ.get("SLURM_STEP_NUM_NODES", os.environ.get("SLURM_NNODES", "1")))
    layout = os.environ.get("SLURM_STEP_TASKS_PER_NODE", str(per_node))
    counts = [int(part.split("(")[0]) for part in layout.split(",")]  # "2(x3)" or "3,2": tasks on each node
    if set(counts) != {per_node} or (slurm.node_rank(), slurm.local_rank()) != divmod(rank, per_node):
        raise RuntimeError(f"the probe needs as many tasks on every node, numbered node by node (--ntasks-per-node, "
                           f"block distribution); this step has {layout} tasks per node, and rank {rank} is task "
                           f"{slurm.local_rank()} of node {slurm.node_rank()}")  # fmt: skip
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(per_node),
            "MASTER_ADDR": slurm.main_address, "MASTER_PORT": str(slurm.main_port)}  # fmt: skip


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


def _rows_and_fit(sizes: list[int], times: list[list[float]], world_size: int) -> dict:
    rows = probe_points(sizes, times, world_size)
    fit = fit_probe(rows, world_size)
    return {"world_size": world_size, "rows": [asdict(r) for r in rows],
            "fit": {"hop_latency_us": fit.hop_latency_us, "busbw_gbps": fit.busbw_gbps}}  # fmt: skip


def probe_nodes(max_bytes: int, min_bytes: int = KIB, warmup: int = 3, iters: int = 10) -> dict | None:
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
              "iters": iters, **_rows_and_fit(sizes, everyone, world_size)}  # fmt: skip
    if within is not None:
        record["intra_node"] = _rows_and_fit(sizes, within, per_node)
    if between is not None:
        record["inter_node"] = _rows_and_fit(sizes, between, nodes)
    elif nodes > 1 and per_node == 1:
        record["inter_node"] = {key: record[key] for key in ("world_size", "rows", "fit")}
    if nodes > 1:
        links = node_links(pairs, nodes)
        record["pairs"] = [{"nodes": list(pair), "bytes_per_s": rate} for pair, rate in pairs.items()]
        record["pair_bytes"] = max_bytes // 4 * 4
        record["node_links_bytes_per_s"] = links
        record["slow_nodes"] = slow_nodes(links)
    return record


def _rate(bytes_per_s: float) -> str:
    return f"{fmt_bandwidth(bytes_per_s / 1e9)} ({bytes_per_s * 8 / 1e6:.1f} Mbit/s)"


def format_nodes(record: dict) -> str:
    """What a probe across nodes adds to the all-ranks table: within a node, between nodes, each pair of nodes,
    and the node whose link is slow, if any."""
    lines, n = [], record["nodes"]
    for key, what in (("intra_node", f"within node 0 ({record['ranks_per_node']} ranks)"),
                      ("inter_node", f"between the {n} nodes (one rank each)")):  # fmt: skip
        if key in record:
            largest, fit = record[key]["rows"][-1], record[key]["fit"]
            lines.append(f"{what}: busbw {fmt_bandwidth(largest['busbw_gbps'])} at {largest['nbytes']:,} bytes; "
                         f"fit: {fit['hop_latency_us']:.1f} us per ring step, busbw "
                         f"{fmt_bandwidth(fit['busbw_gbps'])}")  # fmt: skip
    if "pairs" not in record:
        return "\n".join(lines)
    lines.append(f"point to point between the nodes ({record['pair_bytes']:,} bytes one way, then the other; the "
                 f"slower direction, best of {record['iters']}):")  # fmt: skip
    lines.append(table(("nodes", "rate"), [(f"{p['nodes'][0]}-{p['nodes'][1]}", _rate(p["bytes_per_s"]))
                                           for p in record["pairs"]]))  # fmt: skip
    links = record["node_links_bytes_per_s"]
    if n == 2:
        lines.append("with two nodes each byte crosses both nodes' links: which one bounds the pair's rate cannot be "
                     "told apart (a third node can)")  # fmt: skip
    for k in record["slow_nodes"]:
        others = statistics.median(r for j, r in enumerate(links) if j != k)
        lines.append(f"node {k}'s link is slow: {_rate(links[k])}, {links[k] / others:.2f} of the other nodes' "
                     f"median {_rate(others)}; every pair with node {k} runs at it")  # fmt: skip
    if n > 2 and not record["slow_nodes"]:
        lines.append(f"no node's link is below {SLOW_LINK_SHARE:.0%} of the others' (slowest: node "
                     f"{min(range(n), key=links.__getitem__)}, {_rate(min(links))})")  # fmt: skip
    return "\n".join(lines)


def _no_fit(parser: argparse.ArgumentParser, error: ForecastError) -> int:
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"{parser.prog}: {error} (larger sizes: --max-bytes)", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lit_ddp.allreduce_probe", description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=None,
                        help="ranks to start (>= 2; default 2); under torchrun or srun, the launcher's")  # fmt: skip
    parser.add_argument("--max-bytes", type=parse_bytes, default=64 * KIB**2,
                        help="largest buffer, e.g. 64M or a run's largest bucket in bytes (default 64M)")  # fmt: skip
    parser.add_argument("--min-bytes", type=parse_bytes, default=KIB, help="smallest buffer (default 1K)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed iterations per size")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations per size (median reported)")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default=None, help="default: nccl on GPUs")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here")
    args = parser.parse_args(argv)
    if not under_torchrun():
        try:
            slurm = srun_env()
        except RuntimeError as e:  # Lightning's SLURMEnvironment refusing the step's settings, in one line
            parser.error(f"under srun: {e}")
        os.environ.update(slurm or {})
    if under_torchrun():
        if args.nproc is not None:
            parser.error("--nproc: under torchrun or srun the ranks are the launcher's (nodes x ranks per node)")
        if args.backend == "nccl":
            parser.error("--backend nccl: the probe across nodes runs gloo")
        try:
            record = probe_nodes(args.max_bytes, args.min_bytes, args.warmup, args.iters)
        except ForecastError as e:  # no fit to these times (every rank computes it): one line, from rank 0
            return _no_fit(parser, e)
        if record is not None:  # rank 0
            print(f"{record['nodes']} node(s) x {record['ranks_per_node']} rank(s)")
            print(format_probe(record))
            print(format_nodes(record))
            if args.out is not None:
                args.out.write_text(json.dumps(record, indent=1))
                print(f"wrote {args.out}")
        return 0
    args.nproc = 2 if args.nproc is None else args.nproc
    if args.nproc < 2:
        parser.error(f"--nproc must be >= 2 (one rank has nothing to all-reduce), got {args.nproc}")
    if args.min_bytes > args.max_bytes:
        parser.error(f"--min-bytes {args.min_bytes} is larger than --max-bytes {args.max_bytes}")
    if args.warmup < 0 or args.iters < 1:
        parser.error(f"--warmup must be >= 0 and --iters >= 1, got {args.warmup} and {args.iters}")
    if args.backend == "nccl" and torch.cuda.device_count() < args.nproc:
        parser.error(f"--backend nccl needs {args.nproc} GPUs, this machine has {torch.cuda.device_count()}")
    try:
        record = probe(args.nproc, args.max_bytes, args.min_bytes, args.warmup, args.iters, args.backend)
    except ForecastError as e:
        return _no_fit(parser, e)
    print(format_probe(record))
    if args.out is not None:
        args.out.write_text(json.dumps(record, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
