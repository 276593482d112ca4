"""The GPU check's events section: PhaseTimer's CUDA-event phase times against a loop timed with ``synchronize()``.

    python benchmarks/gpu_check.py out.txt --sections events

It reads PhaseTimer's figures from the record of ``gpu_fits.profiled_fit`` (``lit_ddp.records.schema``, by field name)
and times the same model in a loop of its own; ``events_section`` says what each clock includes.
"""

import time
from typing import Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from benchmarks.common import fmt_num, fmt_share, median, ratio
from benchmarks.gpu_fits import BATCH, DIM, KERNEL_STEPS, Budget, Section, in_process_run, profiled_fit
from lit_ddp import LinearRegression
from lit_ddp.callbacks.phase_timer import FIRST_PROFILED_STEP
from lit_ddp.formatting import table
from lit_ddp.lab.data import shard
from lit_ddp.records.phases import names
from lit_ddp.records.schema import PhaseRecord, StepRow

TIMED = names()[:3]  # forward, backward, update: what the synchronized loop times as well


def phase_medians(rows: list[StepRow]) -> list[float]:
    """Median ms of each of ``TIMED`` over ``rows`` (NaN for none)."""
    return [median(getattr(row.ms, phase) for row in rows) for phase in TIMED]


def event_rows(record: PhaseRecord, first: int) -> list[StepRow]:
    """Rank 0's kept steps from step ``first`` on that the profiler did not slow."""
    return [row for row in record.steady_rows(0) if row.step >= first]


def synchronized_phases(steps: int, warmup: int, device: Optional[torch.device] = None) -> list[float]:
    """Median forward, backward and update ms of a plain loop on the same model, batch and optimizer (the module's
    own ``configure_optimizers``; DDP over a 1-rank NCCL group, as in the fit), each phase between two
    ``torch.cuda.synchronize()`` + ``perf_counter``. ``zero_grad`` is outside the phases, as in PhaseTimer.
    (``device`` cpu, with gloo and no synchronize, only exercises this code without a GPU.)"""
    device = device or torch.device("cuda", torch.cuda.current_device())
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else lambda: None
    with in_process_run():
        dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
        torch.manual_seed(0)
        module = LinearRegression(dim=DIM).to(device)
        model = DistributedDataParallel(module, device_ids=[device.index] if cuda else None)
        optimizer = module.configure_optimizers()
        x, y = (t.to(device) for t in shard(DIM, BATCH, seed=0, rank=0, world_size=1))
        times = []
        for _ in range(steps):
            sync()
            t0 = time.perf_counter()
            loss = ((model(x) - y) ** 2).mean()
            sync()
            t1 = time.perf_counter()
            optimizer.zero_grad()
            sync()
            t2 = time.perf_counter()
            loss.backward()
            sync()
            t3 = time.perf_counter()
            optimizer.step()
            sync()
            t4 = time.perf_counter()
            times.append(((t1 - t0) * 1e3, (t3 - t2) * 1e3, (t4 - t3) * 1e3))
        del model, optimizer  # DDP's reducer goes while its process group is alive
    return [median(t[i] for t in times[warmup:]) for i in range(len(TIMED))]


def events_rows(events: list[float], busy: list[float], synced: list[float]) -> list[tuple]:
    return [
        (phase, fmt_num(e), fmt_num(b), fmt_num(s), fmt_num(ratio(e, s), 2), fmt_share(ratio(b, e)))
        for phase, e, b, s in zip(TIMED, events, busy, synced, strict=True)
    ]


def events_section(budget: Budget) -> Section:
    """CUDA-event phase times against a synchronized measurement of the same region.

    PhaseTimer's event medians come from the steps of ``profiled_fit`` after its profiled ones and after DDP's
    first 10 iterations (step 11 on: ``Budget.sync_first``), its GPU-busy medians from the profiled steps. The
    synchronized loop runs the same model, batch and optimizer with ``torch.cuda.synchronize()`` +
    ``perf_counter`` around forward, backward and update. The two clocks measure different things when the GPU
    waits for Python: an event pair spans everything between its records, idle gaps between tiny host-bound
    kernels included; the synchronized time also holds the launch overhead and the synchronize's own latency.
    Neither is "the GPU's time": the busy column says whether the GPU worked; events - busy is the time the GPU
    idled inside the phase.
    """
    section = Section(f"CUDA events against a synchronized loop (dim {DIM}, batch {BATCH}, medians)")
    run = profiled_fit(budget.fit_steps)
    first_steady = max(FIRST_PROFILED_STEP + KERNEL_STEPS, budget.sync_first)  # after DDP's first 10 iterations
    steady = event_rows(run.phases, first_steady)
    busy = run.phases.ranks[0].busy_ms
    events, busy_medians = phase_medians(steady), phase_medians(busy)
    synced = synchronized_phases(budget.loop_steps, budget.loop_warmup)
    header = ("phase", "CUDA events ms", "GPU busy ms", "synchronized ms", "events/sync", "busy/events")
    section.lines += table(header, events_rows(events, busy_medians, synced)).splitlines()
    section.lines += [
        f"events: {len(steady)} steady steps (from step {first_steady}); busy: {len(busy)} profiled steps; "
        f"synchronized: {budget.loop_steps - budget.loop_warmup} steps of a plain loop",
        "Events include the GPU's idle gaps between kernels; the synchronized loop includes launch overhead and the",
        "synchronize itself. When the GPU waits for Python the two differ, and busy/events says how much of the phase",
        "the GPU worked (near 100%: GPU-bound; then events and synchronized agree).",
    ]
    per_phase = [
        f"{phase} events {ratio(e, s):.2f}x synchronized, GPU busy {fmt_share(ratio(b, e))}"
        for phase, e, b, s in zip(TIMED, events, busy_medians, synced, strict=True)
    ]
    section.verdicts.append("events: " + "; ".join(per_phase))
    return section
