"""The GPU check's ``paths`` section: issue 40's CUDA paths, each driven directly on one GPU (seconds, no fit).

    python benchmarks/gpu_check.py out.txt --sections paths

1. StepSync's row (``_HostCopy``): flags, the copy to pinned memory on a side stream and its event, queued behind
   a long GPU workload under ``torch.cuda.set_sync_debug_mode("error")``: no host sync, and the host is back long
   before the GPU is done.
2. CommMonitor's arrivals (``CudaClock.anchor``/``host_seconds``): an event queued behind the same workload is
   put on the host clock when the GPU reached it, not when the host queued it.
3. PhaseTimer's memory marks (``AllocatorMarks(steps=2)``): after the measured steps the allocator's peak is the
   user's again (``max_memory_allocated`` holds a later step's peak).
What needs two GPUs (NCCL between ranks: the clock offsets, the buckets' queue, the watchdog's timeout) is listed
as not run when fewer are visible.
"""

import time

import torch

from benchmarks.gpu_fits import Budget, Section
from lit_ddp.callbacks.step_sync import _HostCopy
from lit_ddp.measure import clock, memory

WORK_DIM = 4096  # 40 fp32 matmuls, 5.5 TFLOPs: about 0.1 s on an H200 by its datasheet (sized, not yet timed)
WORK_REPEATS = 40


def _queue_work() -> None:
    """Queues a long chain of matmuls on the current stream and returns at once."""
    a = torch.randn(WORK_DIM, WORK_DIM, device="cuda")
    for _ in range(WORK_REPEATS):
        a = a @ a
        a = a / a.norm()


def host_copy_check() -> tuple[list[str], list[str]]:
    device = torch.device("cuda", 0)
    copy = _HostCopy(device)
    torch.cuda.synchronize()
    _queue_work()
    torch.cuda.set_sync_debug_mode("error")  # any sync below raises
    try:
        start = time.perf_counter()
        row = torch.cat([copy.flags(True, False), torch.full((3,), 0.5, dtype=torch.float64, device=device)])
        host, copied = copy.start(row.view(1, -1), None)
        queued_ms = (time.perf_counter() - start) * 1e3
    finally:
        torch.cuda.set_sync_debug_mode("default")
    gpu_pending = not copied.query()
    copy.wait(copied)
    done_ms = (time.perf_counter() - start) * 1e3
    right = host.tolist() == [[1.0, 0.0, 0.5, 0.5, 0.5]]
    lines = [f"StepSync row: queued in {queued_ms:.2f} ms with no host sync (set_sync_debug_mode error); on the host "
             f"{done_ms:.1f} ms later (the GPU workload ahead of it); still pending when queued: {gpu_pending}; "
             f"values right: {right}"]  # fmt: skip
    ok = right and gpu_pending and queued_ms < done_ms / 10
    return lines, [f"paths: StepSync's CUDA row without a host sync: {'yes' if ok else 'NO'}"]


def arrival_check() -> tuple[list[str], list[str]]:
    cuda = clock.CudaClock()
    error_s = cuda.anchor()
    _queue_work()
    mark = cuda.mark()
    queued = clock.host_now()
    torch.cuda.synchronize()
    seen = clock.host_now()
    reached = cuda.host_seconds(mark)
    lines = [
        f"CommMonitor arrival: queued at host +0 ms, GPU reached it at +{(reached - queued) * 1e3:.1f} ms, "
        f"the host saw the sync end at +{(seen - queued) * 1e3:.1f} ms (anchor error {error_s * 1e6:.0f} us)"
    ]
    ok = abs(reached - seen) < 2e-3 and reached - queued > (seen - queued) / 2
    return lines, [f"paths: bucket arrivals on the GPU's timeline: {'yes' if ok else 'NO'}"]


def memory_check() -> tuple[list[str], list[str]]:
    device = torch.device("cuda", 0)
    marks = memory.AllocatorMarks(device, steps=2)
    peaks = []
    for step in range(4):
        marks.mark("forward_start")
        held = torch.empty((step + 1) * 2**20, dtype=torch.uint8, device=device)  # a larger one each step
        del held
        marks.mark("forward_end")
        marks.end_step(step)
        peaks.append(torch.cuda.max_memory_allocated(device))
    last = peaks[-1] - torch.cuda.memory_allocated(device)
    lines = [f"PhaseTimer memory marks (2 measured steps, then 2 more): max_memory_allocated after step 3 is "
             f"{last:,} bytes above what is held (step 3 allocated {4 * 2**20:,})"]  # fmt: skip
    ok = last >= 4 * 2**20
    return lines, [f"paths: the user's peak left alone after the measured steps: {'yes' if ok else 'NO'}"]


def paths_section(budget: Budget) -> Section:
    """Each check's lines and verdict; a GPU count under 2 says what was not run."""
    section = Section("Issue 40's CUDA paths, driven directly (one GPU)")
    for check in (host_copy_check, arrival_check, memory_check):
        lines, verdicts = check()
        section.lines += lines
        section.verdicts += verdicts
    if torch.cuda.device_count() < 2:
        section.lines.append("not run (needs 2 GPUs, NCCL between ranks): the clock offsets after each recv, the "
                             "buckets' NCCL queue left out of their transfer, NCCL's watchdog timeout")  # fmt: skip
    return section
