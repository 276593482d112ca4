"""All-reduce latency and bandwidth of this machine, like nccl-tests' all_reduce_perf.

The command; the measuring is ``lit_ddp.measure.allreduce``.

    python -m lit_ddp.allreduce_probe --nproc 2 --out probe.json
    torchrun --nnodes N --nproc_per_node K ... -m lit_ddp.allreduce_probe   # also within, between and across nodes

Rank 0 prints the nccl-tests-style table (``algbw = S / t``, ``busbw = algbw * 2(n-1)/n``), the latency-bandwidth
fit that ``lit_ddp.forecast`` uses for ``--link measured``, and writes the JSON; under torchrun or ``srun`` it also
names a node whose link is slower than the others'. How it measures: docs/forecast.md.
"""

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

from lit_ddp.errors import ForecastError, UsageParser
from lit_ddp.formatting import fmt_bandwidth, table
from lit_ddp.measure.allreduce import KIB, SLOW_LINK_SHARE, probe, probe_nodes
from lit_ddp.run.rendezvous import init_loopback_process_group
from lit_ddp.scaling.links import fit_probe


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
    parser = UsageParser(prog="python -m lit_ddp.allreduce_probe", description=__doc__.splitlines()[0])
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
            record = probe_nodes(fit_probe, args.max_bytes, args.min_bytes, args.warmup, args.iters)
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
        record = probe(
            init_loopback_process_group,
            fit_probe,
            args.nproc,
            args.max_bytes,
            args.min_bytes,
            args.warmup,
            args.iters,
            args.backend,
        )
    except ForecastError as e:
        return _no_fit(parser, e)
    print(format_probe(record))
    if args.out is not None:
        args.out.write_text(json.dumps(record, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
