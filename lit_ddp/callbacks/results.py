"""What the callbacks share: speaking on rank 0 the way Lightning's own callbacks do, and the end-of-training
ending of the timers (all-gather per-rank rows, write a JSON into the run's log dir)."""

import json
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from tqdm import tqdm


def say(trainer: Trainer, text: str) -> None:
    """Rank 0 reports ``text`` through Lightning's logging (shown in any script), or through the progress bar
    when one is drawn, so that lines and bar stay apart."""
    if not trainer.is_global_zero:
        return
    bar = trainer.progress_bar_callback
    if isinstance(bar, TQDMProgressBar) and bar.is_enabled:
        # Above the bar while one is drawn, plainly when none is (the bar's own print() drops text then).
        tqdm.write(text)
    elif bar is not None and bar.is_enabled:
        bar.print(text)
    else:
        rank_zero_info(text)


def is_last_step(trainer: Trainer, batch_idx: int) -> bool:
    """In ``on_train_batch_end``: this batch ends training (``max_steps`` reached, or the last batch of the last
    epoch)."""
    if trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps:
        return True
    max_epochs = trainer.max_epochs
    return (
        max_epochs is not None
        and max_epochs > 0
        and trainer.current_epoch >= max_epochs - 1
        and batch_idx + 1 >= trainer.num_training_batches
    )


def gather(trainer: Trainer, columns: dict[str, list]) -> dict[str, list]:
    """Every rank's ``columns`` on every rank, as ``{name: [rank][...]}``; each value must have the same shape
    on every rank (pad with NaN). One small collective per column, at the end of training."""
    gathered = {}
    for name, values in columns.items():
        local = torch.tensor(values, dtype=torch.float64, device=trainer.strategy.root_device)
        result = trainer.strategy.all_gather(local)
        if result.dim() == local.dim():  # world size 1: no leading rank dimension
            result = result.unsqueeze(0)
        gathered[name] = result.cpu().tolist()
    return gathered


def write_json(trainer: Trainer, filename: str, data: dict[str, Any]) -> Optional[Path]:
    """Writes ``data`` to ``<log_dir>/<filename>`` from rank 0; every rank must call it (``log_dir`` is a
    broadcast). Returns the path on rank 0 when there is a log dir."""
    log_dir = trainer.log_dir
    if log_dir is None or not trainer.is_global_zero:
        return None
    path = Path(log_dir) / filename
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path
