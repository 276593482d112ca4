"""What ``python -m lit_ddp.fit`` shows is the same whichever way its ranks start: with ``ddp_spawn`` each rank is
a fresh interpreter, which sets up the console again when it unpickles the CLI's RunSummary."""

import pytest

from tests.runner import STEP_LINE, run_fit


def shown(stdout: str) -> list[str]:
    """The lines, without the numbers that change from run to run."""
    return [STEP_LINE.sub("Step N, Loss X", line).split(", wall ")[0] for line in stdout.splitlines()]


@pytest.mark.slow
def test_spawned_ranks_print_what_forked_ranks_print(notes_run, tmp_path):
    forked = notes_run.result  # `--devices 2`: the ranks are forked
    spawned = run_fit("--devices", "2", "--trainer.strategy", "ddp_spawn", cwd=tmp_path)
    assert forked.returncode == spawned.returncode == 0, spawned.stderr[-2000:]
    # Lightning's own ddp_spawn strategy keeps torch's 30 minutes: the callbacks leave it as it is, and say nothing.
    assert shown(spawned.stdout) == shown(forked.stdout), spawned.stdout
    assert "timeout is now" not in spawned.stdout + spawned.stderr
    assert "Trainer.fit` stopped" not in spawned.stdout and "Initializing distributed" not in spawned.stdout
    assert spawned.stderr.strip() == "", spawned.stderr[-2000:]
