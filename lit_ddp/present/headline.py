"""The answer first: the one line that opens the end-of-fit block and ``python -m lit_ddp.report RUN``, saying what
bounds the step, its share, and the one change the numbers back with its measured or forecast effect, or "can't
tell", with why. The tables after it hold the figures it rests on.

    python -m lit_ddp.fit --config configs/mini_train_profile.yaml --devices 2     # its first line at the end

What to try for each bound, and why: docs/output.md, "If X bounds the step".
"""

from typing import Optional

from lit_ddp.analysis.run_analysis import RunAnalysis
from lit_ddp.formatting import fmt_ms
from lit_ddp.present.bound import LEAD_SHARE, Bound, cpu_bound, steady_count
from lit_ddp.present.phases import BUSY_BOUND, busy_bound

# Where no figure of the run backs a change: the change that each part's bound asks for, named as a thing to try.
TRY = {
    "forward": "fewer FLOPs per sample (a smaller model, bf16-mixed on a GPU)",
    "backward": "fewer FLOPs per sample (a smaller model, bf16-mixed on a GPU)",
    "update": "a fused or foreach optimizer step (fused=True for torch's Adam, AdamW, SGD)",
    "data": "more DataLoader workers (num_workers), pin_memory=True on a GPU",
    "other": "less Python per step (callbacks, logging every step, .item() calls)",
}
NAMES = {"forward": "forward's compute", "backward": "backward's compute", "update": "the optimizer's step",
         "data": "the input pipeline", "other": "Python between the phases", "exposed": "the all-reduce"}  # fmt: skip


def headline(analysis: RunAnalysis) -> Optional[str]:
    """The block's first line; None where the run has no phase record (the all-reduce table alone)."""
    record = analysis.phases
    if record is None:
        return None
    straggler = analysis.named_straggler
    if straggler is not None:
        cause = f"its {straggler.cause} phase, {straggler.cause_extra_ms:+.1f} ms" if straggler.cause else "no phase"
        r = straggler.rank
        return (f"Bound by a straggler: rank {r} arrives {straggler.late_ms:.1f} ms late at the all-reduce ({cause} "
                f"over the others' median); the others wait for it, so no DDP knob helps: make rank {r}'s work the "
                "others' size")  # fmt: skip
    busy = record.ranks[0].busy_ms
    if busy:
        shares = [row.ms.step / analysis.step_ms if analysis.step_ms else 0.0 for row in busy]
        bound = busy_bound(shares)
        if bound == "gpu":
            return (f"Bound by the GPU (busy {min(shares):.0%} or more of the step): fewer FLOPs or bf16; no figure "
                    "here backs one")  # fmt: skip
        if bound == "host":
            return (f"Bound by the host (the GPU busy {max(shares):.0%} of the step at most): larger batches or fewer "
                    "kernel launches (fused optimizer, CUDA graphs); no figure here backs one")  # fmt: skip
        return f"Can't tell whether the GPU or the host bounds the step: its busy share crosses {BUSY_BOUND:.0%}"
    if record.meta.clock == "cuda_event":
        return "Can't tell what bounds the step: the GPU's busy time was not measured (PhaseTimer(kernel_steps=N))"
    b = cpu_bound(analysis)
    if b is None:
        return f"Can't tell what bounds the step: only {steady_count(analysis)} steady step(s) were kept"
    return _cpu_headline(analysis, b)


def _name(part: str) -> str:
    return NAMES.get(part, part)


def _cpu_headline(analysis: RunAnalysis, b: Bound) -> str:
    first, second = b.first, b.second
    if not b.called:
        a, z = f"{_name(first)} ({b.share[first]:.0%})", f"{_name(second)} ({b.share[second]:.0%})"
        apart = f"{fmt_ms(b.gap.low)} to {fmt_ms(b.gap.high)}"
        if not b.gap.excludes(0.0):
            return (
                f"Can't tell what bounds the step: {a} and {z} are level within the noise ({apart} apart, {b.n} steps)"
            )
        return (f"Can't tell what bounds the step: {a} leads {z} by {apart} per step ({b.n} steps), not surely by "
                f"{LEAD_SHARE:.0%} of the step")  # fmt: skip
    if first == "wait":
        return (f"Can't tell what bounds the step: its largest part ({b.share[first]:.0%}) is rank 0's wait for a "
                "later rank, and no rank is late steadily; run again to see whether it repeats")  # fmt: skip
    said = f"Bound by {_name(first)} ({b.share[first]:.0%})"
    if first != "exposed":  # a phase added to the table names no change to try until TRY has one for it
        tried = f"try {TRY[first]}; " if first in TRY else ""
        return f"{said}: {tried}no figure here backs one change"
    step_ms, comm = analysis.step_ms, analysis.comm
    if analysis.savings:
        label, saved = max(analysis.savings.items(), key=lambda item: item[1])
        return f"{said}: {label}, forecast {fmt_ms(step_ms)} -> {fmt_ms(step_ms - saved)}"
    if comm is not None and comm.compression:
        return f"{said}, {comm.compression} on the wire already: a faster link (report RUN --forecast N --link ...)"
    return f"{said}: fp16 compression halves its bytes (python -m lit_ddp.report RUN --forecast N forecasts it)"
