"""The tuner's command line: fit's options and configs with the tuner in place of training; writes the winner.

    python -m lit_ddp.tune --devices 2                                # the notes' model, fit's options
    python -m lit_ddp.tune --config configs/mini_train_profile.yaml --devices 2 --tune.budget_s 60
    python -m lit_ddp.tune --model my_module.MyModel --data my_module.MyData --devices 2 --out tuned.yaml
    python -m lit_ddp.fit --config tuned.yaml                          # runs what it found

Every option of ``lit_ddp.fit`` (so its configs), plus ``--tune.*`` (``lit_ddp.tuner.DDPTuner``) and
``--out``. Rank 0 writes the YAML, a JSON of every trial beside it, and prints the ``LitDDPStrategy(...)`` line
for a script. How the search goes and what it leaves alone: docs/tuning.md.
"""

import copy
import importlib
import inspect
import json
import re
import sys
from pathlib import Path

import yaml
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.cli import LightningArgumentParser
from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel

from lit_ddp.callbacks import DeviceMap
from lit_ddp.errors import Ending, UsageError
from lit_ddp.fit import LitDDPCLI, build_cli
from lit_ddp.run import console, lifecycle
from lit_ddp.run.arguments import LAB_CLASSES, TRAINER_DEFAULTS
from lit_ddp.run.strategy import LitDDPStrategy
from lit_ddp.tuner.callback import DDPTuner, knobs_of, takes_optimizer_impl
from lit_ddp.tuner.knobs import Knobs
from lit_ddp.tuner.verdict import script_lines

STRATEGY = "lit_ddp.run.strategy.LitDDPStrategy"
TIMEDELTA = re.compile(r"(\d+):(\d\d):(\d\d(?:\.\d+)?)")  # str(timedelta) under a day, as a config dumps it
HOOK_PATHS = {
    h: f"torch.distributed.algorithms.ddp_comm_hooks.default_hooks.{h}_compress_hook" for h in ("fp16", "bf16")
}

DESCRIPTION = (
    "lit_ddp's DDP tuner: starts the ranks as `python -m lit_ddp.fit` would (same options and configs, any "
    "LightningModule with --model/--data), then, instead of training, measures DDP configurations on the model's "
    "first batch in short trials (bucket_cap_mb, gradient_as_bucket_view, static_graph, broadcast_buffers, "
    "find_unused_parameters, the optimizer's foreach/fused step; fp16/bf16 and PowerSGD compression with "
    "--tune.allow_lossy), each in several rounds, and keeps a change only when it is faster beyond the noise the "
    "rounds show. It prints every trial and the verdict, writes the winner as a config for `python -m lit_ddp.fit "
    "--config` (--out) with a JSON of every trial beside it, and prints the strategy line for a script. Gradient "
    "accumulation and the batch size are never touched (they change the training)."
)


class TuneCLI(LitDDPCLI):
    """fit's options and configs, ``--tune.*`` and ``--out``; the Trainer keeps only the tuner (and the device map)."""

    script, module, description = "lit-ddp-tune", "lit_ddp.tune", DESCRIPTION

    def add_core_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        help_out = "Where rank 0 writes the winner as a fit config (and every trial as JSON, .json)."
        parser.add_argument("--out", default="tuned.yaml", help=help_out)
        parser.add_lightning_class_args(DDPTuner, "tune")
        super().add_core_arguments_to_parser(parser)

    def before_instantiate_classes(self) -> None:
        self.fit_config = copy.deepcopy(self.config)  # what --out writes, with the winner's knobs
        for key in ("tune", "out"):
            del self.fit_config[key]
        super().before_instantiate_classes()
        self.config.trainer.logger = False  # a tuning run trains nothing: no log folder
        # ... and nothing keeps it training once the tuner has stopped it (Lightning's should_stop waits for these).
        self.config.trainer.min_steps = self.config.trainer.min_epochs = None
        if Path(self.config.out).suffix == ".json":
            raise UsageError(f"--out {self.config.out}: the config is YAML (every trial goes beside it, as .json)")

    def instantiate_classes(self) -> None:
        super().instantiate_classes()
        trainer = self.trainer
        trainer.callbacks = [c for c in trainer.callbacks if not type(c).__module__.startswith("lit_ddp.")
                             or isinstance(c, (DDPTuner, DeviceMap))]  # fmt: skip
        if isinstance(trainer.strategy, DDPStrategy):
            try:
                knobs_of(trainer.strategy)  # a hook it cannot measure: said here, before any rank starts
            except ValueError as e:
                raise UsageError(str(e)) from None
        tuner = next(c for c in trainer.callbacks if isinstance(c, DDPTuner))
        if any(c.get("comm_hook") == "bf16" for c in tuner.compare or []) and not isinstance(
            trainer.accelerator, CUDAAccelerator
        ):
            raise UsageError("--tune.compare asks for bf16 compression, which only NCCL (CUDA) runs")


def strategy_args(strategy: object) -> tuple[dict, list[str]]:
    """The user's strategy options (a config's ``trainer.strategy``) that ``LitDDPStrategy`` takes by the same name,
    and the names of those it does not (another class's: the tuned config leaves them out, and says so)."""
    if not isinstance(strategy, dict):  # a name ("ddp") or nothing: no options of its own
        return {}, []
    given = strategy.get("init_args") or {}
    takes = inspect.signature(LitDDPStrategy).parameters
    module, _, name = strategy["class_path"].rpartition(".")
    # The dumped config holds every option, the defaults too (DDP's own, through the class's **kwargs), as YAML
    # writes them (a timedelta as "0:30:00").
    params = {**inspect.signature(DistributedDataParallel).parameters,
              **inspect.signature(getattr(importlib.import_module(module), name)).parameters}  # fmt: skip
    changed = {k: v for k, v in given.items() if k not in params or str(v) != str(params[k].default)}
    carried = {k: v for k, v in given.items() if k in takes}
    timeout = TIMEDELTA.fullmatch(str(changed.pop("timeout", "")))  # DDPStrategy's process-group timeout
    if timeout:
        h, m, sec = timeout.groups()
        carried["timeout_s"] = float(h) * 3600 + float(m) * 60 + float(sec)
    return carried, [k for k in changed if k not in takes]


def tuned_config(cli: TuneCLI, knobs: Knobs) -> str:
    """The user's config with the strategy (``LitDDPStrategy``) set to ``knobs``, as YAML for ``fit --config``. The
    knobs go into the dumped YAML, not through jsonargparse (which cannot dump a hook given by its path)."""
    config = yaml.safe_load(cli.parser.dump(cli.fit_config, skip_check=True))
    init_args, _ = strategy_args(config["trainer"].get("strategy"))
    init_args.update(bucket_cap_mb=knobs.bucket_cap_mb, gradient_as_bucket_view=knobs.gradient_as_bucket_view,
                     static_graph=knobs.static_graph, broadcast_buffers=knobs.broadcast_buffers,
                     find_unused_parameters=knobs.find_unused_parameters,
                     ddp_comm_hook=HOOK_PATHS.get(knobs.comm_hook), powersgd_rank=powersgd_rank(knobs))  # fmt: skip
    config["trainer"]["strategy"] = {"class_path": STRATEGY, "init_args": init_args}
    _own_log_name(config)
    if knobs.optimizer != "as_configured" and takes_optimizer_impl(cli.model):
        model_args = config["model"].setdefault("init_args", {})
        model_args["foreach"], model_args["fused"] = knobs.optimizer == "foreach", knobs.optimizer == "fused"
    return yaml.safe_dump(config, sort_keys=False)


def _own_log_name(config: dict) -> None:
    """fit's default log folder is the lab's (``runs/mini_train``): a config for the user's model logs under its
    class's name (``MyCNN`` -> ``runs/my_cnn``) unless it names a folder of its own."""
    logger, model = config["trainer"].get("logger"), config["model"].get("class_path", LAB_CLASSES["model"])
    lab_name = TRAINER_DEFAULTS["logger"]["init_args"]["name"]
    if (
        isinstance(logger, dict)
        and logger.get("init_args", {}).get("name") == lab_name
        and model != LAB_CLASSES["model"]
    ):
        logger["init_args"]["name"] = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", model.rpartition(".")[2]).lower()


def powersgd_rank(knobs: Knobs) -> int | None:
    """The matrix rank of a PowerSGD ``comm_hook`` (``LitDDPStrategy(powersgd_rank=...)``); None for the others."""
    return int(knobs.comm_hook.removeprefix("powersgd")) if knobs.comm_hook.startswith("powersgd") else None


def write(cli: TuneCLI, record: dict, out: Path) -> str:
    """Writes ``out`` (YAML) and its ``.json`` (``record``, every trial); the lines that say so."""
    best = Knobs(**record["best"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(tuned_config(cli, best))
    json_path = out.with_suffix(".json")
    json_path.write_text(json.dumps(record, indent=1) + "\n")
    lines = [f"Wrote {out} (python -m lit_ddp.fit --config {out}) and {json_path}",
             "In a script, for Trainer(strategy=...):", *(f"    {line}" for line in script_lines(best))]  # fmt: skip
    strategy = yaml.safe_load(cli.parser.dump(cli.fit_config, skip_check=True))["trainer"].get("strategy")
    carried, left_out = strategy_args(strategy)
    if left_out:
        lines.append(f"Left out of {out}: {strategy['class_path']}'s {', '.join(left_out)} (LitDDPStrategy, which "
                     "the config names, takes no such option)")  # fmt: skip
    if powersgd_rank(best):
        start = carried.get("powersgd_start_step", 1000)
        lines.append(f"PowerSGD compresses from step {start} of a fit (all-reduces plainly before it, as its "
                     "authors advise; the trials measured it compressing): powersgd_start_step sets it")  # fmt: skip
    return "\n".join(lines)


def cli_main(args: list[str] | None = None) -> Ending:
    console.setup()
    if "" not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # the console script: --model my_module.MyModel from here
    cli = build_cli(sys.argv[1:] if args is None else list(args), cli_class=TuneCLI, save_config_callback=None)
    if cli.datamodule is None:
        raise UsageError("the tuner needs --data (a LightningDataModule)")
    tuner = next(c for c in cli.trainer.callbacks if isinstance(c, DDPTuner))
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    lifecycle.teardown_process_group()
    if cli.trainer.is_global_zero and tuner.record is not None:
        print(write(cli, tuner.record, Path(cli.config.out)), flush=True)
    return Ending.FINISHED


def main() -> None:
    code = lifecycle.exit_code(cli_main, prog="lit-ddp-tune")
    if code:
        sys.exit(code)
