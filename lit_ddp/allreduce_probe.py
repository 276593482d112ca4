"""All-reduce latency and bandwidth of this machine, like nccl-tests' ``all_reduce_perf``.

    python -m lit_ddp.allreduce_probe --nproc 2 --out probe.json

Starts ``--nproc`` ranks with ``torch.multiprocessing`` on loopback (a free port, the store bound to
127.0.0.1 as in ``lit_ddp.run.rendezvous``), gloo on CPU and NCCL on GPUs (one GPU per rank), and all-reduces fp32
buffers of 1 KiB, 2 KiB, ... up to ``--max-bytes``. Each size gets a few warm-up iterations, then timed
ones: a barrier first so the ranks start together, then one all-reduce (on GPUs followed by a
``synchronize``, which a probe may add). An iteration takes as long as its slowest rank; the size's time is
the median over iterations. ``algbw = S / t`` and ``busbw = algbw * 2(n-1)/n`` as in nccl-tests
(``doc/PERFORMANCE.md``). Rank 0 prints the table, the latency-bandwidth fit that ``lit_ddp.forecast``
uses for ``--link measured``, and writes the JSON.
"""

import argparse
import json
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
from lit_ddp.analysis.trace import allreduce_bus_factor
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


def _worker(rank: int, config: ProbeConfig) -> None:
    torch.set_num_threads(1)  # the ranks share this machine's cores; gloo's reduction runs on its own threads
    cuda = config.backend == "nccl"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    init_loopback_process_group(config.backend, rank, config.world_size, config.port, timedelta(seconds=60), device)
    try:
        times = torch.zeros(len(config.sizes), config.iters, dtype=torch.float64)
        for i, nbytes in enumerate(config.sizes):
            # Zeros: the sums stay finite however many iterations run.
            buffer = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
            for _ in range(config.warmup):
                dist.all_reduce(buffer)
            for j in range(config.iters):
                dist.barrier()
                if cuda:
                    torch.cuda.synchronize(device)
                start = time.perf_counter()
                dist.all_reduce(buffer)
                if cuda:
                    torch.cuda.synchronize(device)
                times[i, j] = (time.perf_counter() - start) * 1e3
        # An iteration is over when its slowest rank is done.
        slowest = times.to(device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        if rank == 0:
            Path(config.result_path).write_text(json.dumps(slowest.cpu().tolist()))
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lit_ddp.allreduce_probe", description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks to start (>= 2)")
    parser.add_argument("--max-bytes", type=parse_bytes, default=64 * KIB**2,
                        help="largest buffer, e.g. 64M or a run's largest bucket in bytes (default 64M)")  # fmt: skip
    parser.add_argument("--min-bytes", type=parse_bytes, default=KIB, help="smallest buffer (default 1K)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed iterations per size")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations per size (median reported)")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default=None, help="default: nccl on GPUs")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here")
    args = parser.parse_args(argv)
    if args.nproc < 2:
        parser.error(f"--nproc must be >= 2 (one rank has nothing to all-reduce), got {args.nproc}")
    if args.min_bytes > args.max_bytes:
        parser.error(f"--min-bytes {args.min_bytes} is larger than --max-bytes {args.max_bytes}")
    if args.warmup < 0 or args.iters < 1:
        parser.error(f"--warmup must be >= 0 and --iters >= 1, got {args.warmup} and {args.iters}")
    if args.backend == "nccl" and torch.cuda.device_count() < args.nproc:
        parser.error(f"--backend nccl needs {args.nproc} GPUs, this machine has {torch.cuda.device_count()}")
    record = probe(args.nproc, args.max_bytes, args.min_bytes, args.warmup, args.iters, args.backend)
    print(format_probe(record))
    if args.out is not None:
        args.out.write_text(json.dumps(record, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
