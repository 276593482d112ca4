"""The range names the tool emits through ``torch.profiler.record_function`` (its steps and CommMonitor's buckets;
each phase's is its row's in ``lit_ddp.records.phases``), and so reads back from a profiler trace
(``lit_ddp.derive.trace``).

    python -m lit_ddp.report --trace runs/mini_train_profile/version_0     # finds them in the traces
"""

STEP_PREFIX = "lit_ddp.step#"  # + the global step: one training step
BUCKET_PREFIX = "lit_ddp.bucket#"  # + the bucket's index: the all-reduce of one DDP gradient bucket
