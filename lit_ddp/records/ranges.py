"""The range names the tool emits through ``torch.profiler.record_function`` (PhaseTimer's phases and steps,
CommMonitor's buckets), and so reads back from a profiler trace (``lit_ddp.derive.trace``).

    python -m lit_ddp.report --trace runs/mini_train_profile/version_0     # finds them in the traces
"""

STEP_PREFIX = "lit_ddp.step#"  # + the global step: one training step
FORWARD = "lit_ddp.forward"
BACKWARD = "lit_ddp.backward"
UPDATE = "lit_ddp.update"
DATA = "lit_ddp.data"  # the batch's end to the next step's start (PhaseTimer's data phase)
OTHER = "lit_ddp.other"
BUCKET_PREFIX = "lit_ddp.bucket#"  # + the bucket's index: the all-reduce of one DDP gradient bucket
TRACE_PHASES = ("forward", "backward", "update", "data", "other")
OWN_PHASES = dict(zip((FORWARD, BACKWARD, UPDATE, DATA, OTHER), TRACE_PHASES, strict=True))  # range -> phase
