"""The timeline's size at 64 ranks, simulated from a real record, as ``benchmarks/record_size.py`` simulates the
record's gather.

    python benchmarks/timeline_size.py                  # one real 2-rank run (~1 min), then 64 ranks from it
    python benchmarks/timeline_size.py --run RUN_DIR --ranks 64,512

The run: the profiled config at ``--model.dim 256 --model.num_layers 8`` with ``bucket_cap_mb 0.25`` (8 gradient
buckets, where the config's one layer has one) and 100 steps, so that each rank keeps the record's whole window (the
first 10 steps, the 3 profiled, the last 50). Its rank 0 part is given to every simulated rank (each start and
arrival moved by a few microseconds per rank, as another process's would be), and the timeline is written from
that record alone (no profiler traces: each rank's trace adds what the profiler wrote for it) and with the real
run's traces of its 2 ranks, for what they add per rank.
"""

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ROOT, child_env  # noqa: E402
from lit_ddp.analysis.run_analysis import analyze  # noqa: E402
from lit_ddp.formatting import fmt_ms, fmt_si, table  # noqa: E402
from lit_ddp.present import timeline  # noqa: E402
from lit_ddp.records.schema import load_run, save  # noqa: E402


def real_run(out: Path) -> Path:
    args = [sys.executable, "-m", "lit_ddp.fit", "--config", str(ROOT / "configs" / "mini_train_profile.yaml"),
            "--devices", "2", "--trainer.accelerator", "cpu", "--model.dim", "256", "--model.num_layers", "8",
            "--trainer.strategy.init_args.bucket_cap_mb", "0.25", "--trainer.max_steps", "100",
            "--loss_monitor.every_n_steps", "0", "--sync_check.every_n_steps", "0"]  # fmt: skip
    subprocess.run(args, cwd=out, env=child_env(), check=True, capture_output=True, timeout=1200)
    return next((out / "runs").glob("*/version_*"))


def simulate(run_dir: Path, world_size: int, out: Path) -> dict:
    """Rank 0's record given to ``world_size`` ranks, and its timeline written with and without traces."""
    phases, comm = load_run(run_dir)
    ranks_p, ranks_c = [], []
    for rank in range(world_size):
        mine_p, mine_c = copy.deepcopy(phases.ranks[0]), copy.deepcopy(comm.ranks[0])
        mine_p.rank, mine_c.rank = rank, rank
        for row in mine_p.rows:
            row.start_s += rank * 1e-6
        for row in mine_c.rows:
            row.arrival_s = [t + rank * 1e-6 for t in row.arrival_s]
        ranks_p.append(mine_p)
        ranks_c.append(mine_c)
    phases.ranks, comm.ranks = ranks_p, ranks_c
    phases.meta.world_size = comm.meta.world_size = world_size
    comm.clock_offset_s, comm.clock_error_s = [0.0] * world_size, [0.0] * world_size
    sim = out / f"ranks{world_size}"
    save(phases, sim / "phases.json"), save(comm, sim / "comm.json")
    start = time.perf_counter()
    bare = timeline.write_timeline(sim, out / f"timeline{world_size}.json")
    elapsed = time.perf_counter() - start
    traced = timeline.write_timeline(run_dir, out / "traced.json")  # the real 2 ranks, with their traces
    plain = timeline.timeline(analyze(*load_run(run_dir)))
    per_rank_traces = (traced.stat().st_size - len(json.dumps(plain, separators=(",", ":")))) / len(phases.ranks[:2])
    return {"ranks": world_size, "size": bare.stat().st_size, "seconds": elapsed, "buckets": len(comm.layout),
            "steps": len(phases.ranks[0].rows), "events": bare.read_text().count('"ph"'),
            "traces_per_rank": per_rank_traces}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, help="a run directory to simulate from (default: make one)")
    parser.add_argument("--ranks", default="64", help="simulated world sizes, comma-separated")
    args = parser.parse_args(argv)
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores (the write's time moves with it)")
    with tempfile.TemporaryDirectory(prefix="lit_ddp_timeline_") as tmp:
        run_dir = args.run or real_run(Path(tmp))
        rows = []
        for world_size in (int(n) for n in args.ranks.split(",")):
            found = simulate(run_dir, world_size, Path(tmp))
            rows.append((found["ranks"], found["steps"], found["buckets"], f"{found['events']:,}",
                         fmt_si(found["size"], "B"), fmt_ms(found["seconds"] * 1e3),
                         fmt_si(found["traces_per_rank"], "B")))  # fmt: skip
        print("The timeline of a real record's rank 0 given to every rank (dim 256 x 8 layers, bucket_cap_mb 0.25, "
              "100 steps, 2 CPU ranks):")  # fmt: skip
        print(table(("ranks", "kept steps", "buckets", "events", "file", "written in", "+ CPU traces per rank"),
                    rows))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
