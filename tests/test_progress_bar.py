"""The callbacks' tables in a user's script that keeps Lightning's progress bar: each starts on a line of its own
and stays whole. With tqdm's bar written to a file (tqdm cannot clear its bar there, and the table was glued onto
the bar's last line); with Rich's (what Lightning draws when rich is installed) in an 80-column terminal, where it
draws live (its stdout proxy word-wrapped every line longer than the terminal, and split a block where the bar
redrew)."""

import re

import pytest

from tests.runner import run_in_terminal, run_module

SCRIPT = """
import sys

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lit_ddp import FixedBatchDataModule, LinearRegression
from lit_ddp.callbacks import CommMonitor, PhaseTimer

if __name__ == "__main__":
    bar = RichProgressBar() if sys.argv[1] == "rich" else TQDMProgressBar()
    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp_fork", max_steps=4, logger=False,
                      enable_checkpointing=False, callbacks=[bar, PhaseTimer(print_steps=1), CommMonitor()])
    trainer.fit(LinearRegression(dim=32), FixedBatchDataModule(dim=32, batch_size=4))
"""

ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # colours, cursor moves, line erases


def screen_text(raw: str) -> str:
    """What the lines say, escape sequences dropped, and of a line that ``\\r`` overwrote its last state."""
    lines = ESCAPE.sub("", raw).replace("\r\n", "\n").split("\n")
    return "\n".join(line.rsplit("\r", 1)[-1] for line in lines)


@pytest.mark.slow
@pytest.mark.parametrize("bar", ["tqdm", "rich"])
def test_tables_start_their_own_lines_below_a_bar(tmp_path, bar):
    (tmp_path / "user_script.py").write_text(SCRIPT)
    if bar == "rich":
        pytest.importorskip("rich")
        result = run_in_terminal("user_script", "rich", cwd=tmp_path, timeout=120, columns=80)
    else:
        result = run_module("user_script", "tqdm", cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    out = screen_text(result.stdout)
    assert ("Epoch 0: 100%" if bar == "tqdm" else "4/4 ") in out, out[-2000:]  # the bar was drawn
    for title in ("Phase times (", "Gradient all-reduce per step ("):
        assert re.search(rf"^{re.escape(title)}", out, re.M), out[-2000:]
    # Whole: the step block in one piece, and a line longer than the terminal is one line.
    assert re.search(r"^Step 0\n forward : .*\n backward: .*\n update  : ", out, re.M), out[-3000:]
    assert re.search(r"^Memory per rank \(exact, from the live objects\): parameters 4,224 bytes; .* before "
                     r"activations\.$", out, re.M), out  # fmt: skip
