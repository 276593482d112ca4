"""The ranks' meeting at exit (``lit_ddp.run.exits``), on a real store: the store's host names a rank that does
not come, from its watchdog's state, says when it came, and ends the job at the wait's end; the others wait silent.
The whole job: the zoo's ``fit_end_rank1_sleeps`` in tests/test_hang_zoo.py (slow)."""

import json
import threading
import time

import pytest
import torch.distributed as dist

from lit_ddp.analysis.divergence import RankReport
from lit_ddp.run import exits, watchdog


@pytest.fixture
def store(monkeypatch):
    monkeypatch.setattr(watchdog, "HANG_AFTER_S", 0.1)
    store = dist.HashStore()
    left = RankReport(0, 0.0, "left", "", "", 15, "the end of training", [])
    busy = RankReport(1, 0.0, "busy", "", "s.py:18 on_fit_end: time.sleep(3600)", 15, "the end of training", [])
    for rank, report in enumerate((left, busy)):
        state = {"rank": rank, "stopped_s": 12.0, "report": report.as_json(), "stack": []}
        store.set(f"{watchdog.KEY}{rank}", json.dumps(state))
    store.add(exits.EXIT_KEY, 1)  # rank 0 came
    return store


def test_the_host_names_the_rank_that_does_not_come_and_ends_the_job_at_the_wait(store, monkeypatch, capsys):
    ended = []
    monkeypatch.setattr(exits, "_end", lambda store, world_size, waited: ended.append(waited))
    exits.wait_for_the_others(store, 2, wait_s=0.5, host=True)
    lines = capsys.readouterr().err.splitlines()
    assert lines and all(" hung" not in line for line in lines)
    assert lines[0].startswith(
        "lit_ddp: waiting 12 s: rank 1 has been at s.py:18 on_fit_end: time.sleep(3600) for 12 s"
    )
    assert "outside any collective; rank 0 has left" in lines[0] and "raise timeout_s" in lines[0], lines[0]
    assert len(ended) == 1 and ended[0] >= 0.5


def test_a_rank_that_comes_late_is_said_to_have_moved_on_and_the_others_wait_silent(store, capsys):
    threading.Timer(0.4, lambda: store.add(exits.EXIT_KEY, 1)).start()
    start = time.monotonic()
    exits.wait_for_the_others(store, 2, wait_s=10.0, host=True)
    assert time.monotonic() - start < 5
    err = capsys.readouterr().err
    assert "rank 1 has been at s.py:18" in err and err.rstrip().endswith("lit_ddp: moved on after 0 s"), err
    store.add(exits.EXIT_KEY, -1)  # rank 1 gone again: a rank that is not the host waits out its wait, silent
    exits.wait_for_the_others(store, 2, wait_s=0.3, host=False)
    assert capsys.readouterr().err == ""
