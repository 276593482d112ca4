"""The run record's size, the tool's memory and its end-of-run time as a run gets longer, and its gather at 512
ranks by simulation.

    python benchmarks/record_size.py                 # 1,000, 10,000 and 100,000 steps on 2 CPU ranks (~10 min)
    python benchmarks/record_size.py --steps 1000,10000

Each row is one real ``python -m lit_ddp.fit --config configs/mini_train_profile.yaml --devices 2`` run at
``--model.dim 16`` (a step costs little but Lightning's loop, so a long run is quick) with PhaseTimer and
CommMonitor on, per-step printing off: the sizes of ``phases.json`` and ``comm.json``, the peak RSS of each
rank (``StepClock``), and the end of the run: from the start of the last step's mark to the process's exit
(the records' gather to rank 0, writing them, the tables, the teardown).

The 512-rank rows take the longest run's record, give its rank 0 part to 512 ranks, and measure what
``dist.gather_object`` would send to rank 0 (each rank's part, pickled), the record's size, and rank 0's time
to write it and print its tables. Before the record had a bounded window, every step of every rank was
all-gathered to every rank: the last column prices what each rank received then, from the bytes per step and
rank of the same record's kept rows.
"""

import argparse
import copy
import json
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ROOT, child_env, clock_args, read_rank_files  # noqa: E402
from lit_ddp.analysis.run_analysis import analyze
from lit_ddp.formatting import fmt_ms, fmt_si, table  # noqa: E402
from lit_ddp.present.comm import comm_table  # noqa: E402
from lit_ddp.present.phases import phase_table  # noqa: E402
from lit_ddp.records.schema import load_run, save  # noqa: E402

PROFILE = ROOT / "configs" / "mini_train_profile.yaml"


def fmt_bytes(n: float) -> str:
    return fmt_si(n, "B")


def run(steps: int, out: Path) -> dict:
    """One 2-rank run of ``steps`` steps; its record's sizes, peak RSS and end-of-run time."""
    args = [sys.executable, "-m", "lit_ddp.fit", "--config", str(PROFILE), "--devices", "2", "--model.dim", "16",
            "--trainer.accelerator", "cpu", "--trainer.max_steps", str(steps), "--loss_monitor.every_n_steps", "0",
            "--sync_check.every_n_steps", "0", *clock_args(out)]  # fmt: skip
    subprocess.run(args, cwd=out, env=child_env(), check=True, capture_output=True, timeout=3600)
    exited = time.time()
    run_dir = next((out / "runs").glob("*/version_*"))
    ranks = read_rank_files(out)
    return {
        "steps": steps,
        "phases": (run_dir / "phases.json").stat().st_size,
        "comm": (run_dir / "comm.json").stat().st_size,
        "rss": [r["max_rss_mb"] for r in ranks],
        "end_s": exited - max(r["step_starts"][-2] for r in ranks),  # the last step's start -> exit
        "run_dir": run_dir,
    }


def simulate(run_dir: Path, world_size: int, out: Path) -> dict:
    """Rank 0's part of the run's record given to ``world_size`` ranks: what the gather sends to rank 0, the
    record's size, and rank 0's time to write it and print its tables."""
    phases, comm = load_run(run_dir)
    per_rank = len(pickle.dumps(phases.ranks[0])) + len(pickle.dumps(comm.ranks[0]))
    phases.ranks = [copy.deepcopy(phases.ranks[0]) for _ in range(world_size)]
    comm.ranks = [copy.deepcopy(comm.ranks[0]) for _ in range(world_size)]
    phases.meta.world_size = comm.meta.world_size = world_size
    start = time.perf_counter()
    size = save(phases, out / "phases.json").stat().st_size + save(comm, out / "comm.json").stat().st_size
    phase_table(analyze(phases, None)), comm_table(analyze(None, comm))
    elapsed = time.perf_counter() - start
    kept = len(phases.ranks[0].rows)
    row_bytes = len(json.dumps([phases.ranks[0].rows[0].__dict__ | {"ms": phases.ranks[0].rows[0].ms.__dict__}]))
    return {"gathered": per_rank * world_size, "size": size, "rank0_s": elapsed, "kept": kept, "row": row_bytes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", default="1000,10000,100000", help="run lengths, comma-separated")
    parser.add_argument("--ranks", type=int, default=512, help="simulated world size for the gather")
    args = parser.parse_args(argv)
    lengths = [int(s) for s in args.steps.split(",")]
    with tempfile.TemporaryDirectory(prefix="lit_ddp_record_") as tmp:
        results = []
        for steps in lengths:
            out = Path(tmp) / f"run_{steps}"
            out.mkdir()
            results.append(run(steps, out))
            print(f"ran {steps:,} steps", file=sys.stderr)
        rows = [(f"{r['steps']:,}", fmt_bytes(r["phases"]), fmt_bytes(r["comm"]),
                 " / ".join(f"{mb:.0f}" for mb in r["rss"]), f"{r['end_s']:.2f}") for r in results]  # fmt: skip
        print("2 CPU ranks, dim 16, PhaseTimer + CommMonitor (configs/mini_train_profile.yaml), per-step printing off:")
        print(table(("steps", "phases.json", "comm.json", "peak RSS MB (rank 0 / 1)", "end of run s"), rows))
        longest = results[-1]
        sim_dir = Path(tmp) / "simulated"
        sim_dir.mkdir()
        sim = simulate(longest["run_dir"], args.ranks, sim_dir)
        all_steps = sim["row"] * longest["steps"] * args.ranks  # what each rank received: every step of every rank
        print(f"\nThe {longest['steps']:,}-step record given to {args.ranks} ranks (simulated gather):")
        print(table(("ranks", "sent to rank 0", "record on disk", "rank 0 writes + tables",
                     "each rank received before"),
                    [(args.ranks, fmt_bytes(sim["gathered"]), fmt_bytes(sim["size"]), fmt_ms(sim["rank0_s"] * 1e3),
                      fmt_bytes(all_steps))]))  # fmt: skip
        print(f"(each rank keeps {sim['kept']} steps in full, about {sim['row']} bytes each as JSON, and summaries)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
