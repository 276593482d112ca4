"""The run's analysis as one row for the Trainer's loggers, logged once at the end of fit beside the per-step rows
(``time/*``, ``comm/*``, ``memory/*``) the callbacks log while it runs: a run's figures side by side with another's in
TensorBoard, MLflow or ``metrics.csv``.

    python -m lit_ddp.fit --config configs/mini_train_profile.yaml --devices 2   # the fit/* columns of metrics.csv

What each figure is: docs/output.md#the-loggers-rows.
"""

from lit_ddp.analysis.run_analysis import RunAnalysis, median_parts
from lit_ddp.records import phases as phase_table

PREFIX = "fit/"


def logger_row(analysis: RunAnalysis) -> dict[str, float]:
    """``fit/step_ms`` and ``fit/<part>_ms``: rank 0's steady medians of the step and of the parts the verdict
    weighs; ``fit/straggler_rank`` and ``fit/straggler_late_ms`` where a straggler is named; ``fit/peak_memory_bytes``
    and ``fit/peak_memory_rank``: the highest rank's median step peak, where memory was measured. Empty without a
    phase record."""
    if analysis.phases is None:
        return {}
    row = {f"{PREFIX}step_ms": analysis.step_ms}
    row.update({f"{PREFIX}{part}_ms": ms for part, ms in median_parts(analysis).items()})
    straggler = analysis.named_straggler
    if straggler is not None:
        row[f"{PREFIX}straggler_rank"] = float(straggler.rank)
        row[f"{PREFIX}straggler_late_ms"] = straggler.late_ms
    memory = analysis.memory
    if memory is not None and memory.peak[phase_table.STEP].count:
        row[f"{PREFIX}peak_memory_bytes"] = float(memory.peak[phase_table.STEP].median)
        row[f"{PREFIX}peak_memory_rank"] = float(memory.rank)
    return row
