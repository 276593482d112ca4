"""``LeanCallback``: the base of the tool's callbacks, whose batch hooks that no class of it overrides Lightning does
not call at all (relies on ``trainer.call._call_callback_hooks``, in ``lit_ddp._lightning``'s register).

    python benchmarks/callback_cost.py       # what a callback costs a host-bound step (docs/performance.md)
"""

from typing import Any

from lightning.pytorch import Callback

from lit_ddp.run import start_watch

# Lightning's hooks of a callback that run for every batch (training, validation, test, predict).
BATCH_HOOKS = (
    *("on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step"),
    *("on_before_zero_grad", "on_train_batch_end", "on_validation_batch_start", "on_validation_batch_end"),
    *("on_test_batch_start", "on_test_batch_end", "on_predict_batch_start", "on_predict_batch_end"),
)


class LeanCallback(Callback):
    """A ``Callback`` whose batch hooks that no class of it overrides are not called at all. Lightning calls every
    hook of every callback for every batch, each inside a profiler context (``trainer.call._call_callback_hooks``:
    ``fn = getattr(callback, hook_name); if callable(fn): with trainer.profiler.profile(...): fn(...)``), whether
    the hook does anything or not: the CLI's eight callbacks took some 0.2 ms of a host-bound step that way
    (docs/performance.md). Such a hook is ``None`` on the instance, which that dispatch passes over; a subclass
    that overrides it, and ``super()`` calls to the class's own, are untouched.

    Making one arms this process's start watch (``lit_ddp.run.start_watch``): in a script of one's own the tool's
    first code in a rank, before the rendezvous."""

    def __new__(cls, *args: Any, **kwargs: Any) -> "LeanCallback":
        start_watch.arm()
        self = super().__new__(cls)
        for hook in BATCH_HOOKS:
            if getattr(cls, hook) is getattr(Callback, hook):
                setattr(self, hook, None)
        return self
