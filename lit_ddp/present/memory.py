"""What a run's memory figures say, as text: the phase table's memory columns, DDP's own memory under the
all-reduce table, and the line of a rank that ran out of memory.

    python -m lit_ddp.report runs/mini_train_profile/version_0     # prints them from phases.json / comm.json

How each figure is measured and what it means: docs/memory.md.
"""

from lit_ddp.derive.memory import StepMemoryFigures
from lit_ddp.formatting import CLI, Advice, fmt_bytes
from lit_ddp.records import phases as phase_table
from lit_ddp.records.schema import DDPMemory

SOURCES = {
    "cuda_allocator": "the CUDA caching allocator: bytes of live tensors, its peak reset at each phase boundary",
    "cpu_profiler": "the CPU allocator's events in the profiled steps (torch.profiler, profile_memory=True), on top "
    "of what parameters, gradients, DDP's buckets and optimizer state held at each step's start",
}


def memory_cells(memory: StepMemoryFigures) -> list[tuple[str, str]]:
    """Per phase (the phase table's order, then the step): the highest rank's median peak and median retained bytes."""
    return [tuple(fmt_bytes(kind[p].median) if kind[p].count else "-" for kind in (memory.peak, memory.retained))
            for p in phase_table.with_step()]  # fmt: skip


def memory_line(memory: StepMemoryFigures) -> str:
    """Under the phase table: whose bytes the memory columns are, over which steps, and the step's max."""
    which = memory.steps
    where = f"steps {which[0]}-{which[-1]}" if len(which) > 1 else f"step {which[0]}" if which else "no step"
    step = memory.peak[phase_table.STEP]
    over = f"{step.count} step(s)" if memory.source == "cuda_allocator" else where
    return (
        f"Memory (rank {memory.rank}, the highest; {over}; {SOURCES.get(memory.source, memory.source)}): "
        f"peak = the most held at once in the phase, retained = held at its end; the step peaked at "
        f"{fmt_bytes(step.median)} median, {fmt_bytes(step.max)} max, starting from {fmt_bytes(memory.start.median)}"
    )


def ddp_memory_lines(memory: DDPMemory, advice: Advice = CLI, detail: bool = True, comm_bound: bool = True) -> str:
    """DDP's own memory on each rank, exactly, and what each knob would change (``advice``: phrased for where it is
    read); without ``detail``, the bucket_cap note left out and the compression what-if where the all-reduce does
    not bound the step (``comm_bound``)."""
    total = sum(memory.buckets)
    sizes = ", ".join(f"{b:,}" for b in memory.buckets[:8]) + (", ..." if len(memory.buckets) > 8 else "")
    view = memory.gradient_as_bucket_view
    grads = "views into the buckets" if view else "a tensor per parameter"
    lines = [
        f"Memory per rank (exact, from the live objects): parameters {memory.parameters:,} bytes; gradients "
        f"{memory.gradients:,} bytes ({grads}); DDP's {len(memory.buckets)} gradient bucket(s) {total:,} bytes "
        f"[{sizes}]; optimizer state {memory.optimizer_state:,} bytes; held {memory.held:,} bytes "
        f"({fmt_bytes(memory.held)}) before activations.",
    ]
    if not memory.buckets:
        return "\n".join(lines)
    if view:
        lines.append(f"gradient_as_bucket_view is on: the gradients are the buckets, saving {total:,} bytes.")
    else:
        lines.append(f"The buckets are a second copy of the gradients: "
                     f"{advice.strategy_settings(gradient_as_bucket_view=True)} gives back {total:,} bytes "
                     f"({fmt_bytes(total)}) per rank.")  # fmt: skip
    largest = max(memory.buckets)
    cap = f"{memory.bucket_cap / 2**20:g} MiB" if memory.bucket_cap else "its cap"
    if detail:
        lines.append(f"bucket_cap_mb ({cap} now) changes how the {total:,} bytes split (largest bucket {largest:,}), "
                     "not their sum.")  # fmt: skip
    half = largest // 2
    if memory.compression:
        lines.append(f"{memory.compression} compression halves the bytes on the wire, not in memory: the buckets "
                     f"stay in the parameters' dtype and each all-reduce casts a copy ({half:,} bytes for the largest "
                     "bucket) for its time on the wire.")  # fmt: skip
    elif detail or comm_bound:
        lines.append(
            f"fp16/bf16 compression (CommMonitor(compression)) would halve the bytes on the wire but add a "
            f"half-size copy of each bucket while it is all-reduced ({half:,} bytes for the largest)."
        )
    return "\n".join(lines)
