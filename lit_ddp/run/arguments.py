"""The command line before LightningCLI parses it, and the checks whose messages Lightning words without
naming the option.

    python -m lit_ddp.fit --devices 2 --config configs/mini_train.yaml     # runs on 2 processes
"""

from typing import Any

import torch
import yaml

from lit_ddp.errors import UsageError


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


def check_devices(accelerator: Any, devices: Any) -> None:
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
