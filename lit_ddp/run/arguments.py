"""The command line before LightningCLI parses it, and the checks whose messages Lightning words without
naming the option.

    python -m lit_ddp.fit --devices 2 --config configs/mini_train.yaml     # runs on 2 processes
"""

from typing import Any

import torch

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
        if arg == "--config" and i + 1 < len(args):
            configs += args[i : i + 2]
            i += 2
            continue
        if arg.startswith("--config="):
            configs.append(arg)

        elif arg == "--devices" or arg.startswith("--devices="):
            rest.append(arg.replace("--devices", "--trainer.devices", 1))
        else:
            rest.append(arg)
        i += 1
    return configs + rest


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
