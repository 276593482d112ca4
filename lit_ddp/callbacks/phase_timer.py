"""Forward, backward and update time of every step on every rank: the notes' ``mini_train_profile.py``.

    python -m lit_ddp.fit --config configs/mini_train_profile.yaml --devices 2

Boundaries, in Lightning's hook order for automatic optimization (checked against lightning 2.6: the
optimizer's ``step(closure)`` runs the closure -- training_step, zero_grad, backward -- then
``on_before_optimizer_step``, then the update)::

    on_train_batch_start                       step starts, forward starts
      training_step                            forward
    on_before_zero_grad                        forward ends   (zero_grad -> "other")
    on_before_backward                         backward starts
      loss.backward()                          backward, including DDP's wait for the last all-reduce
    on_after_backward                          backward ends
    on_before_optimizer_step                   update starts  (hooks in between -> "other")
      Adam's update
    optimizer step post-hook                   update ends
    on_train_batch_end                         step ends

PhaseTimer moves itself first in the callback list, so other callbacks' batch-end work (a sync check, the
loss print) falls between steps and is not counted.

``other`` is the step minus the three phases, so the phases add up to the step. On CUDA the marks are CUDA
events resolved without blocking once they complete (see ``clock.py``); on CPU, ``perf_counter``. Per-rank
timings are all-gathered once, at the end of training, written to ``phases.json`` in the run's log dir,
logged as ``time/{forward,backward,update,step}_ms`` and summarised by rank 0 in one table.
"""

import json
import logging
from pathlib import Path
from typing import Any, Optional

import torch
from jsonargparse.typing import NonNegativeInt, PositiveFloat
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from typing_extensions import override

from lit_ddp import report
from lit_ddp.callbacks.clock import HostClock, clock_for

log = logging.getLogger(__name__)

BOUNDARIES = ("start", "forward_end", "backward_start", "backward_end", "update_start", "update_end", "end")


def linear_flops(model: nn.Module, rows: int) -> tuple[int, int]:
    """FLOPs of forward and backward for the ``nn.Linear`` layers of ``model`` on ``rows`` input rows.

    Forward: one matmul per layer, ``2 * rows * in * out``. Backward: the weight gradient ``x^T @ dy`` for
    every layer, and the input gradient ``dy @ W`` for every layer but the first, whose input needs none.
    Bias terms are O(rows * out) and left out.
    """
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    per_layer = [2 * rows * m.in_features * m.out_features for m in linears]
    return sum(per_layer), sum(per_layer) + sum(per_layer[1:])


def adam_bytes(model: nn.Module) -> int:
    """Bytes Adam moves per step: reads param, grad, exp_avg, exp_avg_sq; writes param, exp_avg, exp_avg_sq."""
    return sum(7 * p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


class PhaseTimer(Callback):
    """Times forward, backward and update of each step on each rank, correctly on GPUs.

    Args:
        print_steps: Rank 0 prints the notes' per-step breakdown for the first ``print_steps`` steps.
        peak_tflops: Peak matmul TFLOP/s of one device; when given, the roofline shows the fraction reached.
        peak_gbps: Peak memory bandwidth (GB/s) of one device, for the update's fraction of peak.
        filename: Name of the JSON written in the run's log dir.
    """

    def __init__(
        self,
        print_steps: NonNegativeInt = 3,
        peak_tflops: Optional[PositiveFloat] = None,
        peak_gbps: Optional[PositiveFloat] = None,
        filename: str = "phases.json",
    ) -> None:
        if print_steps < 0:
            raise ValueError(f"`PhaseTimer(print_steps={print_steps!r})` must be >= 0")
        for name, value in (("peak_tflops", peak_tflops), ("peak_gbps", peak_gbps)):
            if value is not None and not value > 0:
                raise ValueError(f"`PhaseTimer({name}={value!r})` must be > 0")
        self.print_steps = print_steps
        self.peak_tflops = peak_tflops
        self.peak_gbps = peak_gbps
        self.filename = filename
        self._clock: Any = HostClock()
        self._marks: dict[str, Any] = {}
        self._pending: list[tuple[int, dict[str, Any]]] = []  # steps whose marks are not resolved yet
        self._ms: dict[int, list[float]] = {}  # step -> [forward, backward, update, other, step] in ms
        self._rows = 0
        self._hook_handle: Any = None

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # First in the list: the step starts before, and ends before, the other callbacks' batch hooks, so a
        # sync check or loss printing between steps is not counted as part of the step.
        trainer.callbacks.remove(self)
        trainer.callbacks.insert(0, self)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._clock = clock_for(trainer.strategy.root_device)
        self._pending, self._ms = [], {}
        # The update ends when the optimizer's step() returns: Lightning has no hook there.
        self._hook_handle = trainer.optimizers[0].register_step_post_hook(self._on_optimizer_step_end)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._marks = {"start": self._clock.mark()}
        self._rows = len(batch[0])
        self._resolve(trainer, block=False)

    @override
    def on_before_zero_grad(self, trainer: Trainer, pl_module: LightningModule, optimizer) -> None:
        self._marks.setdefault("forward_end", self._clock.mark())

    @override
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        mark = self._clock.mark()
        self._marks.setdefault("forward_end", mark)  # no zero_grad (e.g. accumulation): forward ends here
        self._marks["backward_start"] = mark

    @override
    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._marks["backward_end"] = self._clock.mark()

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer) -> None:
        self._marks["update_start"] = self._clock.mark()

    def _on_optimizer_step_end(self, optimizer, args, kwargs) -> None:
        self._marks["update_end"] = self._clock.mark()

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx) -> None:
        self._marks["end"] = self._clock.mark()
        self._marks.setdefault("update_end", self._marks["end"])
        if all(b in self._marks for b in BOUNDARIES):  # a skipped optimizer step has no phases to report
            self._pending.append((trainer.global_step - 1, self._marks))
        self._resolve(trainer, block=False)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._hook_handle is not None:
            self._hook_handle.remove()
        self._resolve(trainer, block=True)
        data = self._gather(trainer, pl_module)
        log_dir = trainer.log_dir  # a broadcast: every rank asks
        if data is None or not trainer.is_global_zero:
            return
        log.info(report.phase_table(data))
        if log_dir is not None:
            path = Path(log_dir) / self.filename
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(data))

    def _resolve(self, trainer: Trainer, block: bool) -> None:
        """Turns marks into milliseconds, oldest first, as far as they have completed."""
        while self._pending:
            step, marks = self._pending[0]
            if block:
                self._clock.wait(marks["end"])
            elif not self._clock.ready(marks["end"]):
                return
            self._pending.pop(0)
            ms = self._clock.elapsed_ms
            forward = ms(marks["start"], marks["forward_end"])
            backward = ms(marks["backward_start"], marks["backward_end"])
            update = ms(marks["update_start"], marks["update_end"])
            total = ms(marks["start"], marks["end"])
            self._ms[step] = [forward, backward, update, total - forward - backward - update, total]
            self._publish(trainer, step)

    def _publish(self, trainer: Trainer, step: int) -> None:
        if not trainer.is_global_zero:
            return
        values = self._ms[step]
        if step < self.print_steps:
            log.info(report.format_step(step, values))
        if trainer.logger is not None:
            names = ("time/forward_ms", "time/backward_ms", "time/update_ms", "time/other_ms", "time/step_ms")
            trainer.logger.log_metrics(dict(zip(names, values, strict=True)), step=step)

    def _gather(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any] | None:
        steps = sorted(self._ms)
        if not steps:
            return None
        local = torch.tensor([self._ms[s] for s in steps], dtype=torch.float64, device=trainer.strategy.root_device)
        gathered = trainer.strategy.all_gather(local)  # the one collective: [world, steps, phases]
        if gathered.dim() == local.dim():
            gathered = gathered.unsqueeze(0)
        forward_flop, backward_flop = linear_flops(pl_module, self._rows)
        return {
            "clock": self._clock.name,
            "device": str(trainer.strategy.root_device),
            "world_size": trainer.world_size,
            "phases": list(report.PHASES),
            "steps": steps,
            "ms": gathered.cpu().tolist(),
            "roofline": {
                "rows_per_rank": self._rows,
                "forward_flop": forward_flop,
                "backward_flop": backward_flop,
                "update_bytes": adam_bytes(pl_module),
                "peak_tflops": self.peak_tflops,
                "peak_gbps": self.peak_gbps,
            },
        }
