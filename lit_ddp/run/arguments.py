"""The command line before LightningCLI parses it, how its help and errors read, and the checks whose messages
Lightning words without naming the option.

    python -m lit_ddp.fit --devices 2 --config configs/mini_train.yaml     # runs on 2 processes
    torchrun --nproc_per_node 2 -m lit_ddp.fit                             # devices taken from torchrun
"""

import difflib
import importlib
import inspect
import os
import re
from collections.abc import Iterable
from typing import Any

import torch
import yaml
from jsonargparse import DefaultHelpFormatter
from lightning.pytorch.plugins.environments import TorchElasticEnvironment

from lit_ddp.errors import UsageError

# The lab's classes, where the command line and the config files name none (``default_classes``).
LAB_CLASSES = {"model": "lit_ddp.lab.module.LinearRegression", "data": "lit_ddp.lab.data.FixedBatchDataModule"}
# The command's defaults for Lightning's Trainer, which --help shows as each option's default.
TRAINER_DEFAULTS = {
    "strategy": {"class_path": "lit_ddp.run.strategy.LitDDPStrategy"},
    "accelerator": "auto",
    "devices": "auto",
    "max_steps": 5,
    "logger": {
        "class_path": "lightning.pytorch.loggers.CSVLogger",
        "init_args": {"save_dir": "runs", "name": "mini_train"},
    },
    "enable_checkpointing": False,  # LastCheckpoint (--checkpoint.*) writes the run's last.ckpt
    "enable_progress_bar": False,  # the Step lines are the progress report
    "enable_model_summary": False,
    "log_every_n_steps": 1,
    # Where config.yaml goes when there is no logger (`--trainer.logger false`): not the working directory.
    "default_root_dir": "runs",
}


# --help opens with these, the tool's own options before the model's, the data's and Lightning's Trainer's.
DESCRIPTION = (
    "lit_ddp: the notes' DDP lab experiment in PyTorch Lightning, instrumented. It trains a Linear regression on N "
    "processes (CPU with gloo, or GPUs with NCCL) and prints where each rank runs, each step's global loss and a "
    "check that every rank holds the same weights; configs/mini_train_profile.yaml adds where each step's time "
    "went. The tool's own options come first (--devices, then its callbacks: --loss_monitor.*, --sync_check.*, "
    "--step_sync.*, --checkpoint.*), then Lightning's --trainer.*, the model's --model.* and the data's --data.*; "
    "any of them can come from a YAML config (--config). Any LightningModule and LightningDataModule importable "
    "from here can take the lab's place: --model my_module.MyModel --data my_module.MyData (--model.help CLASS "
    "lists a class's options). Every option: docs/options.md."
)
USAGE = "%(prog)s [-h] [--devices N] [-c CONFIG] [--print_config] [--GROUP.OPTION VALUE ...]"


def parser_kwargs(prog: str, description: str) -> dict[str, Any]:
    """The parser's settings: errors raised (to be one line, exit 2), no abbreviated options (``--trainer.max_step``
    is refused, not taken as ``max_steps``), the tidied help."""
    return {"exit_on_error": False, "allow_abbrev": False, "formatter_class": HelpFormatter, "prog": prog,
            "description": description, "usage": USAGE}  # fmt: skip


def expand_shorthands(args: list[str]) -> list[str]:
    """``--devices N`` -> ``--trainer.devices N``, ``--key -1e-3`` -> ``--key=-1e-3``, and every ``--config`` first.

    argparse reads a value that starts with ``-`` and is no plain number (``-1e-3``) as the next option, so the
    error would name ``--model`` and not the value's option; joined to its key, it reaches the option's own check.

    jsonargparse applies arguments in order, so ``--devices 2 --config X.yaml`` would let the file's
    ``devices`` silently win. Moving the config files (in their own order) ahead of everything else makes
    explicit options beat config files wherever they are written.
    """
    args = _join_negative_values(args)
    configs, rest, i = [], [], 0
    while i < len(args):
        arg = args[i]
        if arg in ("--config", "-c") and i + 1 < len(args):
            configs += args[i : i + 2]
            i += 2
            continue
        if arg.startswith(("--config=", "-c=")):
            configs.append(arg)

        elif arg == "--devices" or arg.startswith("--devices="):
            rest.append(arg.replace("--devices", "--trainer.devices", 1))
        else:
            rest.append(arg)
        i += 1
    return configs + rest


def default_classes(args: list[str], defaults: dict[str, str]) -> list[str]:
    """``--GROUP=CLASS`` first for each group of ``defaults`` that neither the command line nor a config file names
    a class for: the lab's model and data when the user brings none.

    Not a parser default: jsonargparse would carry the default class's init args (``batch_size: 32``) over to a
    class of the user's that takes the same names, in place of that class's own defaults.
    """
    named = set()
    for i, arg in enumerate(args):
        for group in defaults:
            if arg == f"--{group}" or arg.startswith(f"--{group}="):
                named.add(group)
        if arg in ("--config", "-c") and i + 1 < len(args) or arg.startswith(("--config=", "-c=")):
            path = arg.partition("=")[2] or args[i + 1]
            named |= {group for group in defaults if _config_names_class(path, group)}
    return [f"--{group}={cls}" for group, cls in defaults.items() if group not in named] + args


def _config_names_class(path: str, group: str) -> bool:
    try:
        with open(path) as f:
            config = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return False  # the parser reports it, in its own words
    section = config.get(group) if isinstance(config, dict) else None
    return isinstance(section, str) or (isinstance(section, dict) and "class_path" in section)


def _negative_number(text: str) -> bool:
    try:
        return text.startswith("-") and float(text) < 0
    except ValueError:
        return False


def _join_negative_values(args: list[str]) -> list[str]:
    joined, i = [], 0
    while i < len(args):
        if args[i].startswith("--") and "=" not in args[i] and i + 1 < len(args) and _negative_number(args[i + 1]):
            joined.append(f"{args[i]}={args[i + 1]}")
            i += 2
        else:
            joined.append(args[i])
            i += 1
    return joined


def check_devices(config: Any) -> None:
    """The parsed config's devices: no top-level ``devices`` (the command line's shorthand, rewritten before
    parsing), a count Lightning takes (``check_device_count``), and under torchrun torchrun's
    (``take_launcher_devices``).

    Raises:
        UsageError: For any of them.
    """
    if "devices" in config:
        raise UsageError(f"devices: {config.devices!r} in a config file: --devices is a command-line shorthand; a "
                         "config file says trainer.devices")  # fmt: skip
    check_device_count(config.trainer.accelerator, config.trainer.devices)
    take_launcher_devices(config.trainer)


def check_device_count(accelerator: Any, devices: Any) -> None:
    """Lightning reports a bad ``devices`` as "`Trainer(devices=0)` value is not a valid input"; name the option
    a user typed instead.

    Raises:
        UsageError: ``devices`` is not a positive count, ``-1`` on GPUs, a GPU index list or ``auto``.
    """
    on_gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    if isinstance(devices, str) and devices.lstrip("-").isdigit():
        devices = int(devices)
    if isinstance(devices, int) and (devices == 0 or devices < -1 or (devices == -1 and not on_gpu)):
        allowed = "a positive number of processes" + (", -1 (all GPUs)" if on_gpu else "") + " or 'auto'"
        raise UsageError(f"--trainer.devices must be {allowed}, got {devices}")
    if isinstance(devices, str) and devices != "auto" and not all(p.strip().isdigit() for p in devices.split(",")):
        raise UsageError(f"--trainer.devices must be a number, a list of GPU indices or 'auto', got {devices!r}")


def take_launcher_devices(trainer: Any) -> None:
    """Under torchrun the processes are torchrun's: ``devices: auto`` becomes its ``--nproc_per_node`` and
    ``num_nodes: 1`` (the default) its node count. Any other figure that does not match is refused in one line;
    Lightning's own error names ``devices=1``, which the user never set.

    Args:
        trainer: The parsed (not yet instantiated) ``trainer`` section of the config; changed in place.

    Raises:
        UsageError: ``devices`` or ``num_nodes`` disagrees with torchrun's.
    """
    if not TorchElasticEnvironment.detect():
        return
    local, world = int(os.environ["LOCAL_WORLD_SIZE"]), int(os.environ["WORLD_SIZE"])
    devices = trainer.devices
    count = _device_count(devices)
    if devices == "auto":
        trainer.devices = local
    elif count is not None and count != local:
        raise UsageError(f"--trainer.devices {devices} under torchrun --nproc_per_node {local}: leave it out "
                         f"(torchrun's count is taken) or make it {local}")  # fmt: skip
    nodes = world // local
    if trainer.num_nodes == 1 and nodes != 1:
        trainer.num_nodes = nodes
    elif trainer.num_nodes != nodes:
        raise UsageError(f"--trainer.num_nodes {trainer.num_nodes} under torchrun with {nodes} node(s) of {local} "
                         f"process(es): leave it out or make it {nodes}")  # fmt: skip


def _device_count(devices: Any) -> int | None:
    if isinstance(devices, str) and devices.strip().isdigit():
        return int(devices)
    if isinstance(devices, int) and devices > 0:
        return devices
    if isinstance(devices, str) and "," in devices:
        return len([d for d in devices.split(",") if d.strip()])
    if isinstance(devices, (list, tuple)):
        return len(devices)
    return None  # "auto", -1 (all GPUs): Lightning resolves them


# Lightning's docstrings end some options' help with its own default ("Default: ``True``."), which jsonargparse
# follows with the tool's (enable_progress_bar: "Default: ``True``. (type: Optional[bool], default: False)").
_DOCSTRING_DEFAULT = re.compile(r"\s*Default:\s*(``[^`]*``|[^\s.]+)\.?")
_KNOWN_SUBCLASSES = re.compile(r", known subclasses: [^)]*")
# A Trainer option's help is its docstring's first sentence (the rest is Lightning's Trainer documentation).
_FIRST_SENTENCE = re.compile(r"^(.*?\.)\s+[A-Z`:(].*$", re.S)


class HelpFormatter(DefaultHelpFormatter):
    """``--help`` with one default per option (the one the command takes), a Trainer option's docstring cut to its
    first sentence, without each group's ``--GROUP CONFIG`` line (``--config`` says it once) and without the lists
    of known subclasses (``--trainer.strategy.help`` shows a class's options)."""

    def _get_help_string(self, action) -> str:
        text = _KNOWN_SUBCLASSES.sub("", _DOCSTRING_DEFAULT.sub("", super()._get_help_string(action)))
        doc, typed, facts = text.rpartition(" (type:")
        if action.dest.startswith("trainer.") and typed:
            text = _FIRST_SENTENCE.sub(r"\1", doc) + typed + facts
        return text

    def _format_action(self, action) -> str:
        if action.metavar == "CONFIG" and "--config" not in action.option_strings:  # a group's own config file
            return ""
        return super()._format_action(action)


def names_class(class_path: str, cls: type) -> bool:
    """Whether ``class_path`` (``module.Name``) is ``cls``."""
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name, None) is cls


# jsonargparse's error for a class in subclass mode (--model, --data, each of trainer.callbacks) tries each member
# of a Union in turn, about 900 characters: the class's own complaint is the one to show.
_SUBCLASS_ERROR = re.compile(r'Parser key "([\w.]+)":.*?Problem with given class_path \'([^\']+)\': (.*?)'
                             r"(?: - (?:Not a valid subclass|Expected a <class 'NoneType'>).*)?$")  # fmt: skip
_INNER_KEY = re.compile(r'Parser key "([^"]+)": (.*)$')
_UNRECOGNIZED = re.compile(r"unrecognized arguments: (--[\w.]+)")
_NOT_ACCEPTED = re.compile(r"Option '(\w+)' is not accepted")
_GROUP_OPTION = re.compile(r"Group '([\w.]+)' does not accept option '(\w+)'")  # a config file's mistyped key


def one_line(err: BaseException, options: Iterable[str] = ()) -> str:
    """A parser's or a class's error as the one line the command prints, with the nearest of ``options`` (the
    parser's option strings) or of the class's arguments where a name was mistyped."""
    text = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
    unknown = _UNRECOGNIZED.match(text)
    if unknown:
        return text + _did_you_mean(unknown[1], options)
    in_group = _GROUP_OPTION.match(text)
    if in_group:
        prefix = f"--{in_group[1]}."
        return text + _did_you_mean(in_group[2], [o.removeprefix(prefix) for o in options if o.startswith(prefix)])
    subclass = _SUBCLASS_ERROR.match(text)
    if not subclass:
        return text
    group, class_path, message = subclass.groups()
    message = message.split(" Given value type: ")[0]  # jsonargparse's repr of what it was given
    inner = _INNER_KEY.match(message)
    if inner:
        return f'Parser key "{group}.{inner[1]}": {inner[2]}'
    mistyped = _NOT_ACCEPTED.search(message)
    hint = _did_you_mean(mistyped[1], _arguments_of(class_path)) if mistyped else ""
    return f'Parser key "{group}" ({class_path}): {message}{hint}'


def _did_you_mean(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.8)  # 0.7 took --device_map for --devices
    return f"; did you mean {close[0]}?" if close else ""


def _arguments_of(class_path: str) -> list[str]:
    """The names ``class_path``'s constructor takes (none where it cannot be imported)."""
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
        parameters = inspect.signature(cls.__init__).parameters.values()
    except (ImportError, AttributeError, TypeError, ValueError):
        return []
    return [p.name for p in parameters if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
