"""The GPU check, in one go (under 5 minutes on a CUDA machine): prints one table and writes it to OUT.

    python benchmarks/gpu_check.py gpu_check.txt

1. the GPU tests (``pytest -k "cuda or gpu"``);
2. the profile config on 1 GPU and on all GPUs (steady step time from PhaseTimer);
3. PhaseTimer's CUDA-event figures against a synchronized measurement of the same phases (a plain loop with
   ``torch.cuda.synchronize()`` around each phase, same model, batch and optimizer): they should agree within
   5% in steady state;
4. a few training steps under ``torch.cuda.set_sync_debug_mode("warn")`` with loss printing and checks off
   and PhaseTimer + CommMonitor on: the number of host syncs they add per step should be 0;
5. the update phase's achieved GB/s with torch's default Adam and with ``fused=True``.
"""

import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DIM, BATCH, STEPS = 4096, 32, 30


def trainer_run(tmp: Path, fused: bool, callbacks: list, steps: int = STEPS):
    """One in-process single-GPU fit; returns the PhaseTimer JSON."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.loggers import CSVLogger

    from lit_ddp import FixedBatchDataModule, LinearRegression
    from lit_ddp.callbacks import LossMonitor
    from lit_ddp.strategy import LitDDPStrategy

    trainer = Trainer(accelerator="gpu", devices=1, strategy=LitDDPStrategy(), max_steps=steps,
                      callbacks=[*callbacks, LossMonitor(every_n_steps=0, check_finite=False)],
                      logger=CSVLogger(tmp, name="gpu", version=0), enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False)  # fmt: skip
    trainer.fit(LinearRegression(dim=DIM, fused=fused), FixedBatchDataModule(dim=DIM, batch_size=BATCH))
    path = tmp / "gpu" / "version_0" / "phases.json"
    return json.loads(path.read_text()) if path.exists() else None


def synchronized_phases(fused: bool) -> list[float]:
    """forward/backward/update medians (ms) of a plain loop timed with a synchronize around each phase."""
    torch.manual_seed(0)
    model = torch.nn.Linear(DIM, DIM).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=fused or None)
    x, y = torch.randn(BATCH, DIM, device="cuda"), torch.randn(BATCH, DIM, device="cuda")
    times = []
    for _ in range(STEPS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = ((model(x) - y) ** 2).mean()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        opt.zero_grad()
        loss.backward()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        opt.step()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        times.append(((t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3))
    return [statistics.median(t[i] for t in times[3:]) for i in range(3)]


def timer_medians(phases: dict) -> list[float]:
    steady = phases["ms"][0][3:]
    return [statistics.median(s[i] for s in steady) for i in range(3)]


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: python benchmarks/gpu_check.py OUT_FILE")
    if not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA GPU here; nothing was run")
    out_file, rows = Path(sys.argv[1]), []
    n_gpus = torch.cuda.device_count()
    rows.append(("device", f"{n_gpus} x {torch.cuda.get_device_name()}, torch {torch.__version__}"))

    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "slow or not slow", "-k", "cuda or gpu",
                            str(ROOT / "tests")], capture_output=True, text=True, cwd=ROOT, timeout=240)  # fmt: skip
    rows.append(("GPU tests", (tests.stdout.strip().splitlines() or ["no output"])[-1]))

    for devices in sorted({1, n_gpus}):
        with tempfile.TemporaryDirectory() as tmp:
            run = subprocess.run([sys.executable, "-m", "lit_ddp.fit", "--config", "configs/mini_train_profile.yaml",
                                  "--devices", str(devices), "--trainer.max_steps", "20",
                                  "--loss_monitor.every_n_steps", "0", f"--trainer.logger.init_args.save_dir={tmp}"],
                                 capture_output=True, text=True, cwd=ROOT, timeout=240)  # fmt: skip
            step = re.search(r"^step\s+\S+ \w+\s+(\S+ \w+)", run.stdout, re.M)
            rows.append((f"profile config, {devices} GPU(s), steady step", step.group(1) if step else
                         f"failed (exit {run.returncode}): {run.stderr.strip().splitlines()[-1:]}"))  # fmt: skip

    from lit_ddp.callbacks import CommMonitor, PhaseTimer

    for fused in (False, True):
        with tempfile.TemporaryDirectory() as tmp:
            phases = trainer_run(Path(tmp), fused, [PhaseTimer(print_steps=0)])
        events, synced = timer_medians(phases), synchronized_phases(fused)
        name = "fused" if fused else "default"
        for phase, e, s in zip(("forward", "backward", "update"), events, synced, strict=True):
            rows.append((f"{phase} ({name} Adam): CUDA events vs synchronized",
                         f"{e:.3f} ms vs {s:.3f} ms ({(e - s) / s:+.1%})"))  # fmt: skip
        gbps = phases["roofline"]["update_bytes"] / (events[2] / 1e3) / 1e9
        rows.append((f"update achieved bandwidth, {name} Adam", f"{gbps:,.0f} GB/s"))

    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            trainer_run(Path(tmp), True, [PhaseTimer(print_steps=0), CommMonitor()], steps=10)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    where = sorted({f"{Path(w.filename).name}:{w.lineno}" for w in syncs})
    rows.append(("host syncs in 10 steps (PhaseTimer + CommMonitor on)", f"{len(syncs)} {where[:6]}"))

    width = max(len(k) for k, _ in rows)
    table = "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)
    print(table)
    out_file.write_text(table + "\n")


if __name__ == "__main__":
    main()
