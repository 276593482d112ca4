"""The callbacks' tables in a user's script that keeps Lightning's progress bar, written to a file: each starts on
a line of its own (tqdm cannot clear its bar there, and the table was glued onto the bar's last line)."""

import re

import pytest

from tests.runner import run_module

SCRIPT = """
from lightning.pytorch import Trainer
from lit_ddp import FixedBatchDataModule, LinearRegression
from lit_ddp.callbacks import CommMonitor, PhaseTimer

if __name__ == "__main__":
    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_steps=4, logger=False,
                      enable_checkpointing=False, callbacks=[PhaseTimer(print_steps=0), CommMonitor()])
    trainer.fit(LinearRegression(dim=32), FixedBatchDataModule(dim=32, batch_size=4))
"""


@pytest.mark.slow
def test_tables_start_their_own_lines_below_a_bar_in_a_file(tmp_path):
    (tmp_path / "user_script.py").write_text(SCRIPT)
    result = run_module("user_script", cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Epoch 0: 100%" in result.stdout  # the bar was drawn
    for title in ("Phase times (", "Gradient all-reduce per step ("):
        assert re.search(rf"^{re.escape(title)}", result.stdout, re.M), result.stdout[-2000:]
