"""DDPTuner: measures DDP's knobs on the model the Trainer was given, in its ranks, and names the fastest.

    python -m lit_ddp.tune --devices 2 --tune.budget_s 120
    trainer = Trainer(strategy=LitDDPStrategy(), devices=2, callbacks=[DDPTuner()]); trainer.fit(model, data)

At ``on_fit_start`` (the ranks started, the process group up) it runs the search of ``lit_ddp.tuner.search``
with a ``TrialBench`` on the first batch of the training data, prints every trial and the verdict, and ends
the fit before any training step. ``outcome`` holds the result (carried back to a ``ddp_fork`` parent).
"""

import dataclasses
import inspect
from functools import partial
from typing import Any, Optional, get_args

import torch.distributed as dist
from jsonargparse.typing import PositiveFloat, PositiveInt
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import CombinedLoader
from torch import Tensor
from typing_extensions import override

from lit_ddp import _lightning
from lit_ddp.callbacks.shared import say
from lit_ddp.run.lean import LeanCallback
from lit_ddp.tuner.bench import TrialBench, no_logging, optimizer_impls
from lit_ddp.tuner.knobs import Hook, Knobs, Model, OptimizerImpl
from lit_ddp.tuner.search import Outcome, grid, head_to_head, search, to_record
from lit_ddp.tuner.verdict import report

# The user's communication hook (by its function's name; PowerSGD's as powersgd<rank>) -> a trial's comm_hook
KNOWN_HOOKS = {"fp16_compress_hook": "fp16", "bf16_compress_hook": "bf16", **{h: h for h in ("powersgd1", "powersgd4")}}


class DDPTuner(LeanCallback):
    """Tries DDP configurations on the Trainer's own model and prints which is fastest, beyond the noise.

    Args:
        budget_s: Seconds of trials (every rank's slowest) after which no new configuration is started (the
            pick's confirmation, head to head with yours, comes after it).
        steps: Timed steps per round of a trial.
        warmup: Untimed steps before them (DDP rebuilds its buckets in the first; PowerSGD all-reduces plainly in
            them, at least 2, and compresses from the first timed step).
        rounds: Interleaved rounds per configuration (one round of each in turn; a close call gets up to as many
            again): its figure is the median step over them, "faster" the noise model's word (docs/noise.md).
        allow_lossy: Also try fp16/bf16 compression and PowerSGD at matrix rank 1 and 4 (they change the numbers:
            reported with the loss and max |Δw| against your configuration after the same steps).
        grid: Measure every combination of the knobs instead (no budget; the reference benchmarks/tune_grid.py
            holds the search against).
        compare: Measure exactly these configurations against yours instead, head to head (one round of each in
            turn, ``rounds`` times): each a dict of the knobs it changes, e.g. ``{"bucket_cap_mb": 4.0}`` (the
            names of ``lit_ddp.tuner.knobs.Knobs``; a tune's ``.json`` holds them as ``best``). A repeated
            configuration, or yours, is measured once.
    """

    carried_back = ("record",)

    def __init__(self, budget_s: PositiveFloat = 120.0, steps: PositiveInt = 10, warmup: PositiveInt = 2,
                 rounds: PositiveInt = 3, allow_lossy: bool = False, grid: bool = False,
                 compare: Optional[list[dict[str, Any]]] = None) -> None:  # fmt: skip
        if not (budget_s > 0 and steps >= 1 and warmup >= 1 and rounds >= 2):
            given = f"budget_s={budget_s!r}, steps={steps!r}, warmup={warmup!r}, rounds={rounds!r}"
            raise ValueError(f"`DDPTuner({given})`: budget_s must be > 0, steps and warmup >= 1, rounds >= 2")
        if grid and compare is not None:
            raise ValueError("DDPTuner: grid and compare are two ways to choose what to measure: give one")
        self.budget_s, self.steps, self.warmup, self.rounds = budget_s, steps, warmup, rounds
        self.allow_lossy, self.grid = allow_lossy, grid
        self.compare = None if compare is None else [_changes(c) for c in compare]
        powersgd = allow_lossy or any(str(c.get("comm_hook")).startswith("powersgd") for c in self.compare or [])
        if powersgd and warmup < 2:
            raise ValueError(f"`DDPTuner(warmup={warmup!r})`: PowerSGD (tried with allow_lossy, or asked in compare) "
                             "all-reduces plainly in its first 2 steps: warmup must be >= 2")  # fmt: skip
        self.outcome: Optional[Outcome] = None
        self.record: Optional[dict] = None  # the outcome as JSON-ready data (lit_ddp.tuner.search.to_record)
        self.rows = 0  # samples per step, every rank together

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not pl_module.automatic_optimization:
            raise ValueError("DDPTuner: the model uses manual optimization; the tuner steps automatic ones only")
        if not trainer.optimizers:
            raise ValueError("DDPTuner: configure_optimizers returned no optimizer")
        if not isinstance(trainer.strategy, DDPStrategy) or not dist.is_initialized():
            raise ValueError(f"DDPTuner tunes DDP and needs a DDP strategy (LitDDPStrategy, strategy='ddp'), got "
                             f"{type(trainer.strategy).__name__}")  # fmt: skip
        strategy = trainer.strategy
        batch = strategy.batch_to_device(_first_batch(trainer))
        self.rows = _rows(batch) * trainer.world_size
        bench = TrialBench(pl_module, batch, trainer.optimizers[0], strategy.root_device, self.steps, self.warmup,
                           self.rounds, step_context=strategy.precision_plugin.train_step_context)  # fmt: skip
        base = knobs_of(strategy)
        one_round = partial(bench.measure, rounds=1)  # the search interleaves the rounds itself
        model = Model(
            grad_bytes=_grad_bytes(pl_module),
            has_buffers=any(True for _ in pl_module.buffers()),
            # On any rank (Lightning's reduction): every rank must try the same knobs, or their collectives differ.
            unused_parameters=strategy.reduce_boolean_decision(not _all_get_grads(pl_module, batch), all=False),
            optimizer_impls=optimizer_impls(trainer.optimizers[0]),
            world_size=trainer.world_size,
            bf16=strategy.root_device.type == "cuda",
        )
        if self.compare is not None:
            configs = [dataclasses.replace(base, **c) for c in self.compare]
            if not model.bf16 and any(k.comm_hook == "bf16" for k in configs):
                raise ValueError("DDPTuner: compare asks for bf16 compression, which only NCCL (CUDA) runs")
            for knobs in configs:
                if knobs.optimizer not in ("as_configured", *model.optimizer_impls):
                    raise ValueError(f"DDPTuner: compare asks for optimizer={knobs.optimizer}, which "
                                     f"{type(trainer.optimizers[0]).__name__} does not take")  # fmt: skip
            self.outcome = head_to_head(one_round, base, configs, self.rounds)
        elif self.grid:
            self.outcome = grid(one_round, model, base, self.rounds, self.allow_lossy)
        else:
            self.outcome = search(one_round, model, base, self.budget_s, self.rounds, self.allow_lossy,
                                  optimizer_in_config=takes_optimizer_impl(pl_module))  # fmt: skip
        self.record = to_record(self.outcome, self.rows)
        say(trainer, report(self.outcome, self.rows))
        trainer.should_stop = True  # the fit ends before its first step: this was a tuning run


def takes_optimizer_impl(model: object) -> bool:
    """The model takes ``foreach`` and ``fused`` as options (the lab's does): a config can carry the choice, where
    otherwise it is a change to the user's ``configure_optimizers``."""
    return {"foreach", "fused"} <= set(inspect.signature(type(model)).parameters)


def _changes(config: dict[str, Any]) -> dict[str, Any]:
    """One configuration of ``compare``, checked: known knob names, and the values each takes."""
    names = {f.name for f in dataclasses.fields(Knobs)}
    if not isinstance(config, dict) or set(config) - names:
        raise ValueError(f"DDPTuner: compare takes dicts of {', '.join(sorted(names))}; got {config!r}")
    hooks = tuple(h for h in get_args(Hook) if h != "noop")  # noop: the tuner's reference, not a configuration
    for name, values in (("comm_hook", hooks), ("optimizer", get_args(OptimizerImpl))):
        if name in config and config[name] not in values:
            raise ValueError(f"DDPTuner: compare's {name} is one of {', '.join(values)}; got {config[name]!r}")
    for name in names - {"comm_hook", "optimizer", "bucket_cap_mb"}:
        if name in config and not isinstance(config[name], bool):
            raise ValueError(f"DDPTuner: compare's {name} is true or false; got {config[name]!r}")
    cap = config.get("bucket_cap_mb")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0):
        raise ValueError(f"DDPTuner: compare's bucket_cap_mb is a number of MiB > 0 (or null: torch's); got {cap!r}")
    return config


def _first_batch(trainer: Trainer) -> Any:
    """The first training batch as ``training_step`` gets it (through Lightning's ``CombinedLoader``, as fit),
    wherever fit's data comes from (a datamodule, the module, or loaders passed to ``fit``)."""
    batch, _, _ = next(iter(CombinedLoader(_lightning.train_dataloader(trainer), "max_size_cycle")))
    return batch


def _rows(batch: Any) -> int:
    """The batch's rows: the first dimension of its first tensor."""
    if isinstance(batch, Tensor):
        return batch.shape[0] if batch.dim() else 1
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else []
    return next((_rows(item) for item in items if isinstance(item, (Tensor, list, tuple, dict))), 0)


def _grad_bytes(module: LightningModule) -> tuple[int, ...]:
    params = [p for p in module.parameters() if p.requires_grad]
    return tuple(p.numel() * p.element_size() for p in reversed(params))


def _all_get_grads(module: LightningModule, batch: Any) -> bool:
    """One forward and backward outside DDP: does every trainable parameter get a gradient?"""
    saved = [p.grad for p in module.parameters()]
    for p in module.parameters():
        p.grad = None
    try:
        with no_logging(module):
            out = module.training_step(batch, 0)
        (out["loss"] if isinstance(out, dict) else out).backward()
        used = all(p.grad is not None for p in module.parameters() if p.requires_grad)
    finally:
        for p, grad in zip(module.parameters(), saved, strict=True):
            p.grad = grad
    return used


def knobs_of(strategy: DDPStrategy) -> Knobs:
    """The user's configuration: the strategy's DDP options. A communication hook the tuner cannot measure (any but
    fp16/bf16 compression and PowerSGD at rank 1 or 4, or a wrapper) is refused: its trials would measure something
    else."""
    kwargs = _lightning.ddp_kwargs(strategy)
    configured = _lightning.configured_comm_hook(strategy)
    hook = getattr(configured.hook, "__name__", None)
    named = configured.wrapper or configured.hook
    given = getattr(named, "__name__", None) or repr(named)
    if hook == "powerSGD_hook":  # LitDDPStrategy(powersgd_rank=...) or the hook and its state given
        rank = getattr(configured.state, "matrix_approximation_rank", None)
        hook, given = f"powersgd{rank}", f"{given} at rank {rank}"
    if configured.wrapper is not None or (configured.hook is not None and hook not in KNOWN_HOOKS):
        raise ValueError(f"DDPTuner: the strategy's communication hook {given} is not one the tuner measures (fp16 or "
                         "bf16 compression, PowerSGD at rank 1 or 4, or none): tune without it")  # fmt: skip
    return Knobs(
        comm_hook=KNOWN_HOOKS.get(hook, "none"),  # type: ignore[arg-type]
        bucket_cap_mb=kwargs.get("bucket_cap_mb"),
        gradient_as_bucket_view=bool(kwargs.get("gradient_as_bucket_view", False)),
        static_graph=bool(kwargs.get("static_graph", False)),
        # LitDDPStrategy passes torch >= 2.13's name, forward_sync_buffers, for broadcast_buffers=False.
        broadcast_buffers=bool(kwargs.get("forward_sync_buffers", kwargs.get("broadcast_buffers", True))),
        find_unused_parameters=bool(kwargs.get("find_unused_parameters", False)),
    )
